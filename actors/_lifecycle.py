"""Starting and stopping an incarnation: what its supervisor, the system and a turn call.

A `Runtime` (`_runtime.py`) is an incarnation's state, its mailbox and what
its senders and inline askers need. How it comes up and goes down is here,
as functions of a `Runtime`, beside the dispatcher's turn (`_turn.py`):

* `start_inline`: the `start_child` handshake, `on_start` in the caller's task;
* `start_now`: an `on_start` that never waits (`Actor.sync_start`), in the call;
* `start_soon`: `on_start` left to a dispatcher (`start_child_nowait`);
* `stop_gracefully`: a stop its supervisor asked for, within the shutdown limit;
* `stop_sequence`: close, `on_stop` (shielded, bounded), finish; the owner
  holds `busy` (a dispatcher's turn, or `stop_gracefully`);
* `incarnate`: make an incarnation (`Runtime` has no `__init__`);
* `add_child` / `take_child`: a dynamic child's start and stop up to their
  first wait, each in one call (`Supervisor._add_child` / `_take_child`);
* `end_removed`: end a removed child's idle incarnation that holds nothing.
"""

from __future__ import annotations

import math
from typing import Protocol

import anyio

from ._actor import Actor
from ._drive import Killed, drive
from ._errors import ActorDead, ActorNotFound, ChildExists, StartFailed
from ._ref import Cell
from ._runtime import (
    DEAD,
    RUNNING,
    STARTING,
    STOPPING,
    ExitWatcher,
    Runtime,
    RuntimeSystem,
    _Child,
)
from ._spec import ChildSpec
from ._types import NO_ITEMS, NO_TIMERS, SchedulerLike
from ._waiter import cancel_scope_token, current_time

__all__ = [
    "ChildOwner",
    "add_child",
    "end_removed",
    "incarnate",
    "start_inline",
    "start_now",
    "start_soon",
    "stop_gracefully",
    "stop_sequence",
    "take_child",
]


class ChildOwner(ExitWatcher, Protocol):
    """What `add_child` / `take_child` need of a `Supervisor` (`_supervisor.py`, above)."""

    _actor_runtime: Runtime | None
    _accepting: bool
    _children: dict[str, _Child]

    def _rt(self) -> Runtime: ...
    def _remove(self, child: _Child) -> None: ...
    def _not_running(self) -> RuntimeError: ...


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


_new = object.__new__


def incarnate(
    actor: Actor,
    cell: Cell,
    system: RuntimeSystem,
    sup: ExitWatcher | None = None,
    start: bool = False,
) -> Runtime:
    """Make `actor`'s incarnation at `cell`; `sup` hears of its exit.

    With `start`, an actor without `on_start` is made running (stamped, as
    `mark_started` would); any other is made not started.

    A function, not `Runtime.__init__`: on Python 3.11 calling a class whose
    `__init__` is Python code costs about a third of a microsecond more than
    calling a function, and a lease actor is made on every step. What comes
    from the actor's class is read in one lookup (`Actor._actor_traits`).

    Raises:
        RuntimeError: `actor` was started once already.
        ValueError: its class's `mailbox_size` is not an int >= 1.
    """
    if actor._actor_incarnated:
        raise RuntimeError(
            f"{type(actor).__name__} instance was already started once; "
            "ChildSpec.start must return a fresh actor for every incarnation"
        )
    cls = type(actor)
    traits = cls._actor_traits
    if traits is None or traits[0] is not cls:
        traits = cls._actor_learn_traits()  # raises for a bad mailbox_size
    _cls, size, start_hook, stop_hook, deferred, sync, kind = traits
    rt: Runtime = _new(Runtime)
    actor._actor_runtime = rt
    actor._actor_incarnated = True
    rt.actor = actor
    rt.cell = cell
    rt.system = system
    rt.sched = system._sched
    rt.sup = sup
    # The mailbox, the system queue (fired timers, child exits: served first)
    # and the timers start as shared empties, replaced by this incarnation's
    # own on the first item (`_types.NO_ITEMS`): most lease actors get no
    # message before they stop, and three allocations are a tenth of a spawn.
    rt.queue = NO_ITEMS
    rt.size = size
    rt.sysq = NO_ITEMS
    rt.timers = NO_TIMERS
    if start and not start_hook:  # `mark_started()`, folded in: nobody can have stopped it yet
        rt.state = RUNNING
        rt.inline = True
        rt.started = True
        rt.stamp = system._wall_stamp()
    else:
        rt.state = STARTING
        rt.inline = False
        rt.started = False
        rt.stamp = None
    rt.start_hook = start_hook
    rt.stop_hook = stop_hook
    rt.scoped = cls._actor_scoped  # learned at run time (`_drive`): not a trait
    rt.deferred = deferred
    rt.sync = sync
    rt.busy = False
    rt.scheduled = False
    rt.accepting = True
    rt.closed = False
    rt.done = False
    rt.reason = None
    rt.senders = None
    rt.stop_requested = False
    rt.hook_pending = False
    rt.cancelled = False
    rt.current = None
    rt.holders = 0
    rt.blocker = None
    rt._done_event = None
    cell.kind = kind
    return rt


def add_child(sup: ChildOwner, spec: ChildSpec, api: str) -> _Child:
    """What `sup.start_child` does before it may wait: register the child and incarnate it.

    A child without `on_start` is running (stamped) when this returns: the
    whole of its start, in one call, so that `start_child` (and
    `SupervisorRef.start_child`, which calls this itself: no coroutine of
    ours in between) await nothing more. Otherwise its `on_start` is the
    caller's to run (`_handshake`, `start_now`, `start_soon`).

    Raises:
        TypeError: `spec` is not a `ChildSpec`.
        ChildExists, ActorDead, StartFailed: as `start_child`.
    """
    if type(spec) is not ChildSpec and not isinstance(spec, ChildSpec):
        raise TypeError(f"{api}() takes a ChildSpec, got {spec!r}")
    rt = sup._actor_runtime
    if rt is None:
        raise sup._not_running()
    if not sup._accepting:
        raise ActorDead(rt.cell.path, rt.reason)
    if rt.closed or rt.cancelled:  # as `_incarnate` checks
        raise ActorDead(rt.cell.path, rt.reason)
    children = sup._children
    child_id = spec.id
    parent = rt.cell
    path = parent.path
    path = "/" + child_id if path == "/" else f"{path}/{child_id}"
    if child_id in children:
        raise ChildExists(path)
    # The child record (its registry cell), its fields stored here: calling
    # a class with an `__init__` costs more than the stores (see `incarnate`).
    registry = parent.registry
    # (`current`, `runtime`, `kind` and `cached_ref` are stored once it is
    # incarnated, or by `_remove` if that fails.)
    child: _Child = _new(_Child)
    child.path = path
    child.registry = registry
    child.restarts = 0
    child.retired = False
    child.spec = spec
    child.last_reason = None
    children[child_id] = child
    registry[path] = child  # `cell.register()`, inlined
    try:  # `_incarnate`, inlined: a new child has no last reason, no ref yet
        actor = spec.start()
        if not isinstance(actor, Actor):
            raise TypeError(
                f"ChildSpec {child_id!r}: start() must return an Actor, got {actor!r}"
            )
        runtime = incarnate(actor, child, rt.system, sup, True)
    except BaseException as exc:
        child.current = child.runtime = None
        child.kind = "?"
        sup._remove(child)
        if isinstance(exc, Exception):
            raise StartFailed(path) from exc
        raise
    child.runtime = runtime
    child.current = runtime
    # Its ref, made here (a class call costs more than the two stores).
    ref = child.cached_ref = _new(actor._actor_ref_type)
    ref._cell = child
    ref.path = path
    return child


def take_child(sup: ChildOwner, child_id: str) -> _Child | None:
    """What `sup.stop_child` does before it may wait: remove the child, stop it if that is instant.

    Returns the child if its stop must be awaited (`_stop_incarnation`):
    it is busy, or has an `on_stop` to run. An idle child without one
    (a lease actor, say) is stopped and released right here.

    Raises:
        ActorNotFound: no child has this id.
    """
    child = sup._children.pop(child_id, None)
    if child is None:
        parent = sup._rt().path
        raise ActorNotFound(f"/{child_id}" if parent == "/" else f"{parent}/{child_id}")
    # `_remove(child)`, inlined (a lease actor is stopped on every step).
    child.retired = True  # also says it is removed (`_Child`)
    child.cached_ref = None  # its ref points back at it: no cycle left behind
    registry = child.registry
    path = child.path
    if path in registry and registry[path] is child:
        del registry[path]
    runtime = child.runtime
    if runtime is None:
        return None
    if runtime.done:
        runtime.release()
        return None
    if runtime.busy or (runtime.stop_hook and runtime.started):
        return child  # a handler in flight, or an on_stop to run: the caller waits
    end_removed(runtime)  # idle, no on_stop: stopped right here, in this call
    return None


def end_removed(rt: Runtime) -> None:
    """End an idle incarnation (no `on_stop`) of a child its supervisor just removed.

    `rt._close(None)` then `rt._finish(None)` in one call, which is all they do
    for one that holds nothing (no message, ask, timer, sender, watcher:
    a lease actor, stopped on every step); anything else goes the
    general way.
    """
    if (rt.closed or rt.queue or rt.sysq or rt.timers or rt.senders
            or rt.current is not None or rt.holders or rt._done_event is not None
            or rt.blocker is not None):
        rt._close(None)
        rt._finish(None)
        return
    rt.closed = True
    rt.accepting = False
    rt.inline = False
    rt.reason = None
    rt.busy = False
    rt.state = DEAD
    rt.done = True
    rt.sup = None  # removed: nobody to report to; the cycles go (`release()`)
    child = rt.cell
    if child.current is rt:
        child.current = None
    if type(child) is _Child and child.runtime is rt:
        child.runtime = None
    actor = rt.actor
    if actor._actor_runtime is rt:
        actor._actor_runtime = None
