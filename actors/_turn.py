"""A dispatcher's turn on one incarnation: the part of `Runtime` that dispatchers run.

A dispatcher of the `Scheduler` that takes an incarnation off the ready queue
marks it busy and calls `turn(rt, ...)`: a pending `on_start` (`start_child_nowait`)
first, then, up to `TURN` items, a pending `on_stop` or stop request, the
system queue (fired timers, child exits), the mailbox. A handler's failure
ends the turn: a crash runs the stop sequence (`on_stop`) right here, a kill
ends the incarnation where it stands.

Functions of a `Runtime` (`_runtime.py`), split off to keep that class small.
"""

from __future__ import annotations

import math
import types
from collections.abc import Generator
from typing import Any

import anyio

from ._drive import Killed, drive, rest
from ._errors import StartFailed
from ._lifecycle import stop_sequence
from ._mailbox import Ask
from ._runtime import Runtime
from ._timers import TimerEntry
from ._types import SchedulerLike

__all__ = ["TURN", "turn"]

#: Items one actor handles per turn before going to the back of the queue.
TURN = 64


def _is_cancel(exc: BaseException) -> bool:
    return isinstance(exc, anyio.get_cancelled_exc_class())


#: Items a turn handles by hand before it starts a `_runner` for the rest.
RUNNER_AFTER = 4

#: What a `_runner` yields when the handler sent in has returned.
_DONE: Any = object()


@types.coroutine
def _runner(detached: list[bool]) -> Generator[Any, Any, Any]:
    """Run the told messages' handler coroutines sent in, one after another.

    ``coro.send(None)`` on a handler that returns raises `StopIteration`,
    which costs a fifth of a tell; ``yield from`` inside a generator that
    stays alive does not: `send` returns `_DONE`. A handler that suspends
    instead hands its first yield up through the runner (`send` returns
    it); the turn then sets ``detached[0]`` and drives the runner itself to
    its end (`rest`), which the runner now reaches with the handler's
    return. A handler's exception ends the runner too. A turn makes one
    once it has handled `RUNNER_AFTER` items and more messages are queued
    (a batch: a producer outrunning its consumer); the daemon's turns, one
    to a few messages, are stepped by hand: starting a runner costs about
    what two messages save, and three more calls as cProfile counts them
    (`python -m bench.calls`). Counting the turn's items costs no call,
    unlike the queue's length.
    """
    coro = yield _DONE
    while True:
        value = yield from coro
        if detached[0]:
            return value
        coro = yield _DONE



async def _start_in_turn(rt: Runtime, sched: SchedulerLike[Runtime], base: object) -> bool:
    rt.start_pending = False
    try:
        actor = rt.actor
        coro = actor.on_start() if actor._actor_plain_start else actor._actor_start()
        await drive(rt, coro, base, sched, scoped=True)
    except BaseException as exc:
        if rt.cancelled:
            rt._end(rt.cancel_reason)
            if _is_cancel(exc):
                raise
            return False
        if isinstance(exc, Exception):
            # Nobody awaits this start: it is a crash of the child.
            failed = StartFailed(rt.cell.path)
            failed.__cause__ = exc
            rt._end(failed)
            return False
        rt._end(None)
        raise
    rt.mark_started()
    return True


async def turn(rt: Runtime, sched: SchedulerLike[Runtime], base: object) -> int:
    """Serve up to `TURN` items for a dispatcher, which has set `busy`.

    Stop requests first, then the system queue, then the mailbox. Returns
    how many items were handled; re-queues the incarnation if work is left.
    """
    handled = 0
    try:
        if rt.start_pending and not await _start_in_turn(rt, sched, base):
            return 1
        receive = rt.actor.receive
        run: Any = None  # a `_runner`'s send, made for a batch of told messages
        while handled < TURN and not rt.done:
            if rt.hook_pending:
                await stop_sequence(rt, rt.hook_reason, math.inf, sched, base)
                break
            if rt.stop_requested:
                await stop_sequence(rt, None, math.inf, sched, base)
                break
            handled += 1
            try:
                # Both read per item: the first item of either gives the
                # incarnation its own deque (`_types.NO_ITEMS`), maybe mid-turn.
                sysq = rt.sysq
                queue = rt.queue
                if sysq:
                    await _serve_system(rt, sysq.popleft(), sched, base)
                elif queue:
                    item = queue.popleft()  # `rt._take()`, inlined
                    senders = rt.senders
                    if senders:
                        senders.popleft().set()
                    if type(item) is Ask:
                        await _serve_ask(rt, item, sched, base)
                    elif rt.scoped:
                        await drive(rt, receive(item), base, sched)
                    else:
                        # A told message: its handler's first step right here,
                        # so one that does not wait costs no call of ours.
                        coro = receive(item)
                        if run is None:
                            if handled <= RUNNER_AFTER or not queue:
                                # A turn's first few messages, or its last
                                # (the daemon's turns are one to a few):
                                # stepped by hand, a runner would not pay.
                                try:
                                    yielded = coro.send(None)
                                except StopIteration:
                                    continue
                                await rest(rt, coro, yielded, base, sched)
                                continue
                            detached = [False]
                            runner = _runner(detached)
                            run = runner.send
                            run(None)
                        try:
                            yielded = run(coro)
                        except BaseException:
                            run = None  # the handler raised: the runner ended with it
                            raise
                        if yielded is _DONE:
                            continue
                        detached[0] = True  # it waits: the runner finishes with it
                        run = None
                        await rest(rt, runner, yielded, base, sched)
                else:
                    handled -= 1
                    break
            except BaseException as exc:  # noqa: BLE001 - sorted out, re-raised if it must
                await _handler_failed(rt, exc, sched, base)
                break
        return handled
    finally:
        rt.busy = False
        if not rt.done and not rt.scheduled and (
            rt.queue or rt.sysq or rt.stop_requested or rt.hook_pending
        ):
            sched.schedule(rt)


async def _serve_ask(rt: Runtime, item: Ask, sched: SchedulerLike[Runtime], base: object) -> None:
    actor = rt.actor
    rt.current = item
    try:
        value = await drive(rt, actor.receive(item.message), base, sched)
    except Exception as exc:
        errors = actor.reply_errors
        if errors and isinstance(exc, errors):
            rt.current = None
            item.set_error(exc)
            return
        raise
    rt.current = None
    item.set_value(value)


async def _serve_system(
    rt: Runtime, item: Any, sched: SchedulerLike[Runtime], base: object
) -> None:
    if type(item) is TimerEntry:
        if rt.system._timers.delivered(item):
            await drive(rt, rt.actor.receive(item.message), base, sched)
    elif rt.actor._actor_system_item_now(item):
        if rt.cancelled:  # as `drive` does after a handler that did not wait
            raise Killed
    else:
        await drive(rt, rt.actor._actor_system_item(item), base, sched)


async def _handler_failed(
    rt: Runtime, exc: BaseException, sched: SchedulerLike[Runtime], base: object
) -> None:
    if rt.cancelled:
        rt._end(rt.cancel_reason)
        if not isinstance(exc, Killed) and _is_cancel(exc):
            raise exc  # the dispatcher is cancelled too (the system stops)
        return
    if isinstance(exc, Exception):
        await stop_sequence(rt, exc, math.inf, sched, base)  # a crash: on_stop runs
        return
    rt._end(None)  # the dispatcher is cancelled: the system is being torn down
    raise exc
