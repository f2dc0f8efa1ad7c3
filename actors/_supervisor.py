"""Supervisors in the OTP sense: they start, watch, restart and stop children.

A `Supervisor` is itself an `Actor` (so it has a path, can be killed, and can
sit under another supervisor). Its children are incarnations (`Runtime`s) it
keeps in a dict: they own no task; the system's dispatchers run them. When a
child's incarnation ends on its own, its exit is queued on the supervisor's
system queue, and the supervisor (run by a dispatcher like any actor) serves
those exits one at a time and applies the child's `Restart` type and its own
`Strategy`.

Lifecycle, in order:

1. `on_start` of the supervisor itself, then its static children start one
   after another, each handshake awaited (the child's `on_start` has
   returned) before the next begins. If one fails, those already started are
   stopped in reverse order and the supervisor fails to start (`StartFailed`).
2. Running: dynamic children come and go with `start_child` / `stop_child`.
   These are direct calls from the caller's task (the child's `on_start`, or
   its `on_stop`, runs right there), with no mailbox hop, so thousands per
   second are cheap and a slow `on_start` does not hold up other starts. A
   child with neither hook costs an object and a dict entry to start or stop.
3. Stopping (normally, or after escalating): children are stopped one by one
   in reverse start order, each gracefully within its spec's `shutdown`.
   Killed: its children are cancelled where they stand (no `on_stop`), and it
   finishes once the last of them has.

Restarts: each restart of the supervisor (one child, or a group under
`ONE_FOR_ALL` / `REST_FOR_ONE`) after a crash is recorded in the `add_restart`
sliding window; a restart after a kill (`ActorKilled`: fault injection) is not,
so the window measures the children's own failures. Every crash is logged at
WARNING with its traceback, every kill at INFO, an escalation at ERROR; the next
incarnation finds the reason in `Actor.restart_reason`.
More than `intensity` within `period` seconds of the system clock, and
the supervisor stops its children in reverse order and crashes with
`SupervisorEscalation`; its parent decides. A restart whose `on_start` fails
counts as another restart and is retried, so a child that cannot start
escalates instead of looping. Dynamic children do not survive their
supervisor's restart: the fresh supervisor starts only its static children.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from ._actor import Actor
from ._errors import (
    ActorDead,
    ActorKilled,
    StartFailed,
    SupervisorEscalation,
)
from ._intensity import add_restart
from ._lifecycle import (
    add_child,
    incarnate,
    start_inline,
    start_now,
    start_soon,
    stop_gracefully,
    take_child,
)
from ._ref import ActorRef, SupervisorRef
from ._runtime import Runtime, _Child
from ._spec import DEFAULT_WORKER_SHUTDOWN, ChildSpec, Restart, Strategy

# Restart policies as module names: a lookup on an Enum class costs ~1,400
# instructions on 3.11 (stepd/sansio/lease.py says why); one a step here.
_PERMANENT = Restart.PERMANENT
_TRANSIENT = Restart.TRANSIENT

__all__ = ["Supervisor", "SupervisorRef"]

log = logging.getLogger("stepd.actors")



class _ChildExit:
    __slots__ = ("child", "reason", "runtime")

    def __init__(self, child: _Child, runtime: Runtime, reason: BaseException | None) -> None:
        self.child = child
        self.runtime = runtime
        self.reason = reason


def _should_restart(restart: Restart, reason: BaseException | None) -> bool:
    if restart is _PERMANENT:
        return True
    if restart is _TRANSIENT:
        return reason is not None
    return False


def _child_path(parent: str, child_id: str) -> str:
    return f"/{child_id}" if parent == "/" else f"{parent}/{child_id}"


class Supervisor(Actor):
    """An actor that supervises children (static, and dynamic at run time).

    Args:
        children: static child specs, started in this order when the
            supervisor starts (and after each of its restarts).
        strategy: which siblings restart with a failed child.
        intensity: the maximum number of restarts within `period`.
        period: the sliding window for `intensity`, in seconds of the
            system's clock.

    Raises:
        ValueError: two child specs share an id, `intensity` is negative or
            `period` is not positive.
        TypeError: `strategy` is not a `Strategy`, or a child is not a
            `ChildSpec`.
    """

    def __init__(
        self,
        children: Iterable[ChildSpec] = (),
        *,
        strategy: Strategy = Strategy.ONE_FOR_ONE,
        intensity: int = 3,
        period: float = 5.0,
    ) -> None:
        specs = tuple(children)
        seen: set[str] = set()
        for spec in specs:
            if not isinstance(spec, ChildSpec):
                raise TypeError(f"children must be ChildSpec instances, got {spec!r}")
            if spec.id in seen:
                raise ValueError(f"duplicate child id {spec.id!r}")
            seen.add(spec.id)
        if not isinstance(strategy, Strategy):
            raise TypeError(f"strategy must be a Strategy, got {strategy!r}")
        add_restart((), 0.0, intensity=intensity, period=period)  # validates both
        self.static_children = specs
        self.strategy = strategy
        self.intensity = intensity
        self.period = period
        self._children: dict[str, _Child] = {}
        self._restarts: tuple[float, ...] = ()
        self._accepting = False

    # A supervisor sits above `_runtime`: it knows its incarnation for what it is.
    _actor_runtime: Runtime | None

    def _rt(self) -> Runtime:
        rt = self._actor_runtime
        if rt is None:
            raise self._not_running()
        return rt

    # -- public API ---------------------------------------------------------

    async def start_child(self, spec: ChildSpec) -> ActorRef:
        """Start a child now and return its ref once its `on_start` has returned.

        The child joins the end of the start order. Call it from any task: the
        child's `on_start` runs in the caller's task (cancelling the caller
        cancels the start and leaves nothing behind).

        Raises:
            ChildExists: this supervisor already has a child with `spec.id`.
            StartFailed: the child's `on_start` raised (``__cause__``), its
                `start` factory raised or returned something other than a
                fresh `Actor`, or it was killed or stopped before it finished
                starting. Nothing is left behind.
            ActorDead: this supervisor is not running (or is stopping).
            TypeError: `spec` is not a `ChildSpec`.
        """
        child = self._add_child(spec, "start_child")
        runtime = child.runtime
        assert runtime is not None
        if not runtime.started:
            await self._handshake(child, runtime)
        ref = child.cached_ref  # `child.ref()`, inlined
        if ref is None:
            ref = child.cached_ref = runtime.actor._actor_ref_type(child)
        return ref

    def start_child_nowait(self, spec: ChildSpec) -> ActorRef:
        """Start a child without waiting for its `on_start`; return its ref at once.

        For children whose `on_start` loads nothing (the caller hands them their
        state), on a hot path. A child without `on_start` is simply running
        when this returns; otherwise a dispatcher runs its `on_start`, and
        messages sent to the ref meanwhile wait in its mailbox. If `on_start`
        fails, that counts as a crash of the child (reason `StartFailed`, its
        ``__cause__`` the exception; its spec decides on a restart), since no
        caller is waiting to hear of it.

        Raises:
            ChildExists: this supervisor already has a child with `spec.id`.
            StartFailed: the `start` factory raised or returned a non-Actor.
            ActorDead: this supervisor is not running (or is stopping).
            TypeError: `spec` is not a `ChildSpec`.
        """
        child = self._add_child(spec, "start_child_nowait")
        runtime = child.runtime
        assert runtime is not None
        if runtime.started:
            pass
        elif runtime.actor.sync_start:
            start_now(runtime)
        else:
            start_soon(runtime)
        ref = child.cached_ref  # `child.ref()`, inlined: a new cell has none yet
        if ref is None:
            ref = child.cached_ref = runtime.actor._actor_ref_type(child)
        return ref

    # `start_child`'s and `stop_child`'s halves that never wait (`_lifecycle`):
    # methods, as `SupervisorRef` calls them on the supervisor it reaches.
    _add_child = add_child
    _take_child = take_child

    async def _handshake(self, child: _Child, runtime: Runtime) -> None:
        """Run a new child's `on_start` in the caller's task; on failure nothing stays."""
        try:
            await start_inline(runtime)
        except BaseException:
            if self._children.get(child.spec.id) is child:
                self._remove(child)
            raise

    async def stop_child(self, child_id: str) -> None:
        """Stop a child gracefully (within its spec's `shutdown`) and remove it.

        It is not restarted, whatever its restart type. Returns once it has
        finished, `on_stop` included (an idle child's `on_stop` runs in the
        caller's task, shielded from the caller's cancellation).

        Raises:
            ActorNotFound: no child has this id.
        """
        child = self._take_child(child_id)
        if child is not None:
            await self._stop_incarnation(child)

    def count_children(self) -> int:
        """How many children this supervisor has now (cheap: no list is built)."""
        return len(self._children)

    def which_children(self) -> list[tuple[str, ActorRef]]:
        """Return ``(id, ref)`` for every child, in start order."""
        return [(cid, child.ref()) for cid, child in self._children.items()]

    async def receive(self, message: Any) -> Any:
        """Supervisors handle no messages of their own; asks get `None`."""
        return None

    # -- lifecycle ------------------------------------------------------------

    async def _actor_start(self) -> None:
        rt = self._rt()
        await self.on_start()
        try:
            for spec in self.static_children:
                child = _Child(_child_path(rt.path, spec.id), rt.cell.registry, spec)
                self._children[spec.id] = child
                child.register()
                await self._start_incarnation(child)
        except Exception:
            # A static child failed to start: stop the rest in reverse order,
            # then fail (the caller of our own start hears StartFailed).
            await self._stop_all()
            raise
        except BaseException:
            self._cancel_children(rt)  # cancelled half way: nothing stays behind
            raise
        self._accepting = True

    async def _actor_stop(self, reason: BaseException | None) -> None:
        self._accepting = False
        await self._stop_all()
        await self.on_stop(reason)

    async def _stop_all(self) -> None:
        self._accepting = False
        for child in reversed(list(self._children.values())):
            self._remove(child)
            await self._stop_incarnation(child)

    def _cancel_children(self, rt: Runtime) -> None:
        """Cancel every child where it stands, last started first (kill, brutal end).

        Called by `Runtime.cancel` on this supervisor: the children are not
        reported (nor restarted), and this incarnation finishes only after the
        last of them has finished.
        """
        self._accepting = False
        for child in reversed(list(self._children.values())):
            self._remove(child)
            runtime = child.runtime
            if runtime is not None and not runtime.done:
                runtime.expected_exit = True
                runtime.cancel(None)
                if not runtime.done and runtime.blocker is None:
                    rt.holders += 1
                    runtime.blocker = rt

    def _remove(self, child: _Child) -> None:
        children = self._children
        child_id = child.spec.id
        if child_id in children and children[child_id] is child:  # no `get` call (a lease a step)
            del children[child_id]
        child.retired = True  # `child.retire()`, inlined; also says it is removed (`_Child`)
        child.cached_ref = None  # its ref points back at it: no cycle left behind
        registry = child.registry
        path = child.path
        if path in registry and registry[path] is child:
            del registry[path]
        runtime = child.runtime
        if runtime is not None and runtime.done:
            runtime.release()

    def _incarnate(self, child: _Child) -> Runtime:
        """Make the child's next incarnation (not started) and install it at its path.

        Raises:
            StartFailed: the factory raised or returned a non-Actor, or the
                actor cannot run (a bad `mailbox_size`, a reused instance).
            ActorDead: this supervisor is ending.
        """
        rt = self._actor_runtime
        if rt is None:
            raise self._not_running()
        if rt.closed or rt.cancelled:
            raise ActorDead(rt.cell.path, rt.reason)
        try:
            actor = child.spec.start()
            if not isinstance(actor, Actor):
                raise TypeError(
                    f"ChildSpec {child.spec.id!r}: start() must return an Actor, got {actor!r}"
                )
            runtime = incarnate(actor, child, rt.system, self)
        except Exception as exc:
            raise StartFailed(child.path) from exc
        actor.restart_reason, child.last_reason = child.last_reason, None
        child.runtime = runtime
        child.current = runtime  # `child.install(runtime)`, inlined
        ref = child.cached_ref
        if ref is not None and type(ref) is not actor._actor_ref_type:
            child.cached_ref = None
        return runtime

    async def _start_incarnation(self, child: _Child) -> ActorRef:
        runtime = self._incarnate(child)
        if runtime.start_hook:
            await start_inline(runtime)
        else:
            runtime.mark_started()
        return child.ref()

    def _child_exited(self, child: _Child, runtime: Runtime, reason: BaseException | None) -> None:
        rt = self._actor_runtime
        if rt is not None and not rt.closed:
            if not rt.busy and not rt.sysq and not rt.cancelled and rt.started and (
                reason is None and child.spec.restart is not _PERMANENT
            ):
                # Idle, nothing queued ahead of it, and a normal exit of a child
                # not restarted after one (a lease ending, a run passivating):
                # bookkeeping that cannot wait, done here, in the exiting
                # child's owner, exactly as a turn would have done it (one
                # handler at a time: nothing else holds this supervisor, and
                # nothing runs between the check and the bookkeeping).
                self._remove(child)
                return
            rt.add_system(_ChildExit(child, runtime, reason))

    async def _stop_incarnation(self, child: _Child) -> None:
        runtime = child.runtime
        if runtime is None or runtime.done:
            return
        runtime.expected_exit = True
        shutdown = child.spec.shutdown
        if shutdown == "brutal":
            runtime.cancel(None)
            await runtime.wait_done()
            return
        if shutdown is None:
            shutdown = float("inf") if runtime.actor._actor_is_supervisor else (
                DEFAULT_WORKER_SHUTDOWN)
        await stop_gracefully(runtime, shutdown)

    async def _actor_system_item(self, item: object) -> None:
        if type(item) is _ChildExit:
            await self._on_child_exit(item)

    def _actor_system_item_now(self, item: object) -> bool:
        # The common exit (a transient child stopping normally: a lease, a run
        # that passivates) is bookkeeping only; a restart waits, so it is driven.
        if type(item) is not _ChildExit:
            return False
        child = item.child
        if child.retired or child.runtime is not item.runtime:
            return True  # stale: stopped on purpose, or already replaced
        if item.reason is None and not _should_restart(child.spec.restart, None):
            self._remove(child)
            return True
        return False

    async def _on_child_exit(self, event: _ChildExit) -> None:
        child = event.child
        if child.retired or child.runtime is not event.runtime:
            return  # stale: stopped on purpose, or already replaced
        reason = event.reason
        if isinstance(reason, ActorKilled):
            log.info("actor %s was killed (%s); restarting it", child.path,
                     reason.detail or "fault injection")
        elif reason is not None:
            # Every crash is seen at the default level: a restart loop must
            # never be silent.
            log.warning("actor %s crashed: %s: %s; %s", child.path, type(reason).__name__,
                        reason, "restarting it" if _should_restart(child.spec.restart, reason)
                        else "not restarted (its restart type)", exc_info=reason)
        if not _should_restart(child.spec.restart, reason):
            self._remove(child)
            return
        await self._restart(child, reason)

    async def _restart(self, failed: _Child, reason: BaseException | None) -> None:
        rt = self._rt()
        while True:
            # A kill (fault injection, `ActorSystem.kill`) is restarted but not
            # counted: the intensity measures the children's own failures, and
            # an operator killing actors in a loop must not stop the daemon.
            ok = True
            if not isinstance(reason, ActorKilled):
                self._restarts, ok = add_restart(
                    self._restarts, rt.system.clock.now(), intensity=self.intensity,
                    period=self.period,
                )
            if not ok:
                log.error("supervisor %s: more than %d restarts in %.0f s; it gives up and "
                          "escalates to its parent", rt.path, self.intensity, self.period)
                raise SupervisorEscalation(rt.path, self.intensity, self.period) from reason
            group = self._group(failed)
            # Stop the running members of the group in reverse start order;
            # temporary ones are not restarted and leave the supervisor.
            for child in reversed(group):
                if child is not failed:
                    if child.spec.restart is Restart.TEMPORARY:
                        self._remove(child)
                    await self._stop_incarnation(child)
            failed.last_reason = reason  # its next incarnation learns why it is restarted
            try:
                for child in group:
                    if child.retired or (child.runtime is not None and not child.runtime.done):
                        continue
                    child.restarts += 1
                    failed = child
                    try:
                        await self._start_incarnation(child)
                    except StartFailed:
                        if child.retired:
                            continue  # stop_child() took it away meanwhile: fine
                        raise
            except StartFailed as exc:
                reason = exc
                continue  # a failed restart counts as another restart
            return

    def _group(self, failed: _Child) -> list[_Child]:
        if self.strategy is Strategy.ONE_FOR_ONE:
            return [failed]
        children = list(self._children.values())
        if self.strategy is Strategy.ONE_FOR_ALL:
            return children
        return children[children.index(failed) :]


Supervisor._actor_ref_type = SupervisorRef
# Its handlers (a child's exit, its own start and stop) start and stop other
# actors inline, so they run inside a cancel scope entered up front.
Supervisor._actor_scoped = True
Supervisor._actor_is_supervisor = True
