"""Starting and stopping an incarnation: what its supervisor, the system and a turn call.

A `Runtime` (`_runtime.py`) is an incarnation's state, its mailbox and what
its senders and inline askers need. How it comes up and goes down is here,
as functions of a `Runtime`, beside the dispatcher's turn (`_turn.py`):

* `start_inline`: the `start_child` handshake, `on_start` in the caller's task;
* `start_now`: an `on_start` that never waits (`Actor.sync_start`), in the call;
* `start_soon`: `on_start` left to a dispatcher (`start_child_nowait`);
* `stop_gracefully`: a stop its supervisor asked for, within the shutdown limit;
* `stop_sequence`: close, `on_stop` (shielded, bounded), finish; the owner
  holds `busy` (a dispatcher's turn, or `stop_gracefully`).
"""

from __future__ import annotations

import math

import anyio

from ._drive import Killed, drive
from ._errors import StartFailed
from ._runtime import RUNNING, STARTING, STOPPING, Runtime
from ._types import SchedulerLike
from ._waiter import cancel_scope_token, current_time

__all__ = [
    "start_inline",
    "start_now",
    "start_soon",
    "stop_gracefully",
    "stop_sequence",
]


async def start_inline(rt: Runtime) -> None:
    """Run the start hook in the caller's task: the `start_child` handshake.

    Raises:
        StartFailed: the hook raised (``__cause__``), or the incarnation
            was killed or stopped before it returned. Nothing is left.
        BaseException: the caller's own cancellation, after ending the
            incarnation.
    """
    rt.busy = True
    try:
        actor = rt.actor
        coro = actor.on_start() if actor._actor_plain_start else actor._actor_start()
        await drive(rt, coro, None, None, scoped=True)
    except BaseException as exc:
        reason: BaseException | None
        if rt.cancelled:
            reason = rt.cancel_reason
        elif isinstance(exc, Exception):
            reason = exc
        else:
            reason = None  # the caller was cancelled: no half-started actor stays
        rt.expected_exit = True  # the caller hears of it; the supervisor does not
        rt._end(reason)
        if isinstance(exc, Exception | Killed):
            raise StartFailed(rt.cell.path) from reason
        raise  # the caller's cancellation (or KeyboardInterrupt): as it is
    rt.mark_started()
    rt.release_owner()


def start_soon(rt: Runtime) -> None:
    """Have a dispatcher run the start hook (`start_child_nowait`)."""
    rt.start_pending = True
    rt.notify()


def start_now(rt: Runtime) -> None:
    """Run a start hook that never waits (`Actor.sync_start`) in the caller's call.

    What `start_soon` has a dispatcher do, minus the queue and the turn. A
    failure is the child's crash (`StartFailed`, its cause the exception),
    as there; a hook that waits anyway is one too.
    """
    rt.busy = True
    actor = rt.actor  # `on_start` itself unless the class wraps it (a supervisor)
    coro = actor.on_start() if actor._actor_plain_start else actor._actor_start()
    try:
        coro.send(None)
    except StopIteration:
        rt.started = True  # `rt.mark_started()`, inlined: a lease actor starts per step
        rt.stamp = rt.system._wall_stamp()
        if rt.state == STARTING:
            if rt.stop_requested:
                rt.state = STOPPING
            else:
                rt.state = RUNNING
                rt.inline = rt.accepting
        rt.busy = False
        if rt.stop_requested or rt.queue or rt.sysq:
            rt.release_owner()
        return
    except Exception as exc:  # noqa: BLE001 - nobody awaits this start: a crash
        cause: BaseException = exc
    except BaseException:
        rt._end(None)
        raise
    else:
        coro.close()
        cause = RuntimeError(f"{rt.cell.path}: the on_start of a sync_start actor waited")
    failed = StartFailed(rt.cell.path)
    failed.__cause__ = cause
    rt._end(failed)


async def stop_gracefully(rt: Runtime, timeout: float) -> None:
    """Stop it (a normal exit, expected by its supervisor) within `timeout` seconds.

    An idle incarnation is stopped right here (its `on_stop` in this task,
    bounded by `timeout`); a busy one after its handler in hand, and
    cancelled if that takes longer than `timeout`.
    """
    if rt.done:
        return
    rt.expected_exit = True
    rt.stop_requested = True
    rt.accepting = False
    rt.inline = False
    if rt.state == RUNNING:
        rt.state = STOPPING
    if not rt.busy:
        rt.busy = True
        rt.start_pending = False
        reason = rt.hook_reason if rt.hook_pending else None
        await stop_sequence(rt, reason, timeout, None, cancel_scope_token())
        return
    with anyio.move_on_after(timeout):
        await rt.wait_done()
    if not rt.done:
        rt.cancel(None)
        await rt.wait_done()


async def stop_sequence(
    rt: Runtime,
    reason: BaseException | None,
    timeout: float,
    sched: SchedulerLike[Runtime] | None,
    base: object,
) -> None:
    """Close, run `on_stop` (shielded, within `timeout`), finish. The owner holds `busy`."""
    rt._close(reason)
    rt.hook_pending = False
    rt.hook_reason = None
    if rt.started and rt.stop_hook and not rt.cancelled:
        deadline = current_time() + timeout if timeout != math.inf else math.inf
        try:
            actor = rt.actor
            coro = actor.on_stop(reason) if actor._actor_plain_stop else actor._actor_stop(reason)
            await drive(rt, coro, base, sched, shield=True, deadline=deadline, scoped=True)
        except Killed:
            if reason is None:
                reason = rt.cancel_reason
        except Exception as exc:  # noqa: BLE001 - a failing on_stop is an exit reason
            if reason is None:
                reason = exc
    rt._finish(reason)
