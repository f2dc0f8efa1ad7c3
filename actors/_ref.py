"""Addresses: registry cells and the `ActorRef` handles that point at them.

A `Cell` is a registry entry for one path under one supervisor. It outlives
incarnations: when the supervisor restarts the child, the new incarnation is
installed in the same cell, so a ref resolves to the *current* incarnation
(one attribute read on the hot path). When the child is removed for good, the
cell is retired and unregistered; a ref holding a retired cell looks its path
up again, so it also reaches an actor started later at the same path (a run
re-activated after passivation, say). If nothing runs there, sends fail fast
with `ActorDead`.

`SupervisorRef` lives here too, below `_actor` (whose `system` returns it) and
`_supervisor` (re-exported there): it names the supervisor by `SupervisorLike`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Coroutine, Sized
from typing import Any, ClassVar, Protocol, Self

import anyio
import anyio.lowlevel

from ._drive import Killed, rest, resume
from ._errors import ActorDead
from ._mailbox import Ask
from ._messages import _IMMUTABLE, check_message
from ._spec import ChildSpec, Strategy
from ._stats import ActorStatistics
from ._types import NO_ITEMS, SchedulerLike, ScopedActor
from ._waiter import cancel_scope_token

__all__ = [
    "CHECKPOINT_EVERY",
    "ActorRef",
    "Cell",
    "Incarnation",
    "SupervisorLike",
    "SupervisorRef",
]

#: `tell` and inline asks skip the event loop when they can; one call in this
#: many takes an anyio checkpoint anyway, so a task that only tells or asks
#: still lets others run and still notices its cancellation.
CHECKPOINT_EVERY = 64

_checkpoint = anyio.lowlevel.checkpoint
_calls = 0


class _RefActor(ScopedActor, Protocol):
    """What a ref reads off an incarnation's actor, and the handler it runs inline."""

    _actor_ref_type: ClassVar[type[ActorRef]]
    _actor_is_supervisor: ClassVar[bool]

    def receive(self, message: Any) -> Coroutine[Any, Any, Any]: ...


class Incarnation(Protocol):
    """What refs and users of the registry need of a cell's incarnation (a `Runtime`).

    `_runtime` sits above this module (a `Runtime` holds its `Cell`), so the
    cell names what it holds by this protocol; read-only members are
    properties, so the `Runtime`'s plain attributes satisfy them.
    """

    @property
    def actor(self) -> _RefActor: ...
    @property
    def sched(self) -> SchedulerLike[Self]: ...
    @property
    def sysq(self) -> deque[Any]: ...
    @property
    def size(self) -> int: ...
    @property
    def accepting(self) -> bool: ...
    @property
    def scheduled(self) -> bool: ...
    @property
    def inline(self) -> bool: ...
    @property
    def done(self) -> bool: ...
    @property
    def reason(self) -> BaseException | None: ...
    @property
    def state(self) -> str: ...
    @property
    def timers(self) -> Sized: ...
    @property
    def started_at(self) -> int | None: ...
    @property
    def sync(self) -> bool: ...
    @property
    def stop_requested(self) -> bool: ...
    @property
    def cancelled(self) -> bool: ...

    # Writable: a ref that runs a handler inline holds the incarnation busy,
    # and the first message sent gives it its own mailbox (`_types.NO_ITEMS`).
    queue: deque[Any]
    busy: bool
    scoped: bool
    deferred: bool
    scope: anyio.CancelScope | None

    async def put(self, item: object) -> None: ...
    def tell_inline(self, message: object) -> None: ...
    async def ask_inline(self, message: object) -> Any: ...
    def release_owner(self) -> None: ...
    def inline_error(self, exc: BaseException) -> BaseException: ...
    def now_error(self, exc: BaseException) -> BaseException: ...
    def now_waited(self, coro: Coroutine[Any, Any, Any]) -> ActorDead: ...
    def cancel(self, reason: BaseException | None) -> None: ...
    async def wait_done(self) -> None: ...


class SupervisorLike(Protocol):
    """What a `SupervisorRef` calls on the `Supervisor` at its path (`_supervisor` is above)."""

    @property
    def strategy(self) -> Strategy: ...

    async def start_child(self, spec: ChildSpec) -> ActorRef: ...
    def start_child_nowait(self, spec: ChildSpec) -> ActorRef: ...
    async def stop_child(self, child_id: str) -> None: ...
    def which_children(self) -> list[tuple[str, ActorRef]]: ...
    def count_children(self) -> int: ...


class Cell:
    """The registry entry for one path: the current incarnation and its history."""

    __slots__ = ("cached_ref", "current", "kind", "path", "registry", "restarts", "retired")

    def __init__(self, path: str, registry: dict[str, Cell]) -> None:
        self.path = path
        self.registry = registry
        self.current: Incarnation | None = None
        self.kind = "?"
        self.restarts = 0
        self.retired = False
        #: The ref `ref()` hands out, of the ref type of the actor here (reset by
        #: `install()` when an incarnation of another ref type arrives).
        self.cached_ref: ActorRef | None = None

    def ref(self) -> ActorRef:
        """Return a ref of the current actor's ref type (`SupervisorRef` for supervisors).

        Refs hold no state of an incarnation (they reach whichever is current),
        so the cell hands out one ref per ref type instead of building one per
        lookup: the daemon resolves a path several times per step.
        """
        ref = self.cached_ref
        if ref is not None:
            return ref
        rt = self.current
        if rt is None:
            return ActorRef(self)
        ref = self.cached_ref = rt.actor._actor_ref_type(self)
        return ref

    def install(self, rt: Incarnation) -> None:
        """Make `rt` the current incarnation at this path."""
        self.current = rt
        ref = self.cached_ref
        if ref is not None and type(ref) is not rt.actor._actor_ref_type:
            self.cached_ref = None

    def register(self) -> None:
        self.registry[self.path] = self

    def retire(self) -> None:
        self.retired = True
        if self.registry.get(self.path) is self:
            del self.registry[self.path]

    def statistics(self) -> ActorStatistics:
        rt = self.current
        if rt is None:
            return ActorStatistics(self.path, self.kind, "dead", self.restarts, 0, 0, 0, None)
        return ActorStatistics(
            path=self.path,
            kind=self.kind,
            state=rt.state,
            restarts=self.restarts,
            mailbox_depth=len(rt.queue),
            mailbox_size=rt.size,
            timers=len(rt.timers),
            started_at=rt.started_at,
        )


class ActorRef:
    """A handle to the actor at a path: `tell`, `tell_nowait`, `ask`.

    Refs are cheap, hashable and compare equal by path (within one system). A
    ref always reaches the current incarnation at its path: restarts are
    invisible to holders of the ref, except that asks queued to or in flight in
    the incarnation that died fail with `ActorDead`.
    """

    __slots__ = ("_cell", "path")

    def __init__(self, cell: Cell) -> None:
        self._cell = cell
        self.path = cell.path

    def _runtime(self) -> Incarnation:
        cell = self._cell
        if cell.retired:
            found = cell.registry.get(self.path)
            if found is None:
                raise ActorDead(self.path)
            self._cell = cell = found
        rt = cell.current
        if rt is None or not rt.accepting:
            raise ActorDead(self.path, rt.reason if rt is not None else None)
        return rt

    @property
    def alive(self) -> bool:
        """Whether an incarnation at this path currently accepts messages."""
        cell = self._cell
        if not cell.retired:  # `_runtime`'s check, without raising and catching ActorDead
            rt = cell.current
            return rt is not None and rt.accepting
        try:
            self._runtime()
        except ActorDead:
            return False
        return True

    async def tell(self, message: object) -> None:
        """Put `message` in the actor's mailbox, waiting while the mailbox is full.

        Returns once the message is queued, not when it is handled. A message
        queued to an incarnation that then dies is dropped. It does not yield
        to the event loop when there is room (one call in `CHECKPOINT_EVERY`
        does): the mailbox's bound is what holds a fast producer back.

        Raises:
            MutableMessageError: `message` is not of an immutable type.
            ActorDead: no incarnation accepts messages at this path (or it died
                while this call waited for room).
        """
        global _calls
        _calls += 1
        if _calls >= CHECKPOINT_EVERY:
            _calls = 0
            await _checkpoint()
        if type(message) not in _IMMUTABLE:
            check_message(message)
        cell = self._cell  # `_runtime()` inlined: its checks, without the call
        rt = cell.current
        if rt is None or cell.retired or not rt.accepting:
            rt = self._runtime()
        queue = rt.queue
        if len(queue) < rt.size:
            if queue is NO_ITEMS:  # its first message: its own mailbox
                queue = rt.queue = deque()
            if rt.busy or rt.scheduled:
                queue.append(message)  # whoever runs it will see it: no wake-up
                return
            if rt.sync and rt.inline and not queue and not rt.sysq:
                rt.tell_inline(message)  # `Actor.sync_handlers`: handled right here
                return
            queue.append(message)
            rt.sched.schedule(rt)
            return
        await rt.put(message)

    def tell_nowait(self, message: object) -> None:
        """Put `message` in the actor's mailbox if there is room right now.

        Raises:
            WouldBlock: the mailbox is full.
            MutableMessageError: `message` is not of an immutable type.
            ActorDead: no incarnation accepts messages at this path.
        """
        if type(message) not in _IMMUTABLE:
            check_message(message)
        cell = self._cell
        rt = cell.current
        if rt is None or cell.retired or not rt.accepting:
            rt = self._runtime()
        queue = rt.queue
        if len(queue) >= rt.size:
            raise anyio.WouldBlock
        if queue is NO_ITEMS:
            queue = rt.queue = deque()
        if rt.busy or rt.scheduled:
            queue.append(message)
            return
        if rt.sync and rt.inline and not queue and not rt.sysq:
            rt.tell_inline(message)  # `Actor.sync_handlers`: handled right here
            return
        queue.append(message)
        rt.sched.schedule(rt)

    def ask_now(self, message: object) -> Any:
        """Have the actor handle `message` right here, if it is idle; return its reply.

        A synchronous inline ask, for a message whose handler never waits,
        sent where waiting is not an option (another actor's handler that must
        not yield between two steps). Idle means what an inline ask needs:
        running, nothing queued, no handler in flight; so one handler at a
        time and per-sender order hold as for any message.

        Raises:
            WouldBlock: the actor is not idle; nothing was sent (send it
                another way, or later).
            ActorDead: no incarnation accepts messages at this path, or the
                handler crashed, or waited (which is a crash of the actor).
            MutableMessageError: `message` is not of an immutable type.
            Exception: the handler's exception if listed in `reply_errors`.
        """
        if type(message) not in _IMMUTABLE:
            check_message(message)
        cell = self._cell
        rt = cell.current
        if rt is None or cell.retired or not rt.accepting:
            rt = self._runtime()
        if not rt.inline or rt.busy or rt.queue or rt.sysq:
            raise anyio.WouldBlock
        rt.busy = True  # the handler, run right here to its end
        coro = rt.actor.receive(message)
        try:
            coro.send(None)
        except StopIteration as stop:
            rt.busy = False
            if rt.stop_requested or rt.queue or rt.sysq:
                rt.release_owner()  # work for a dispatcher, or a stop to finish
            return stop.value
        except BaseException as exc:  # noqa: BLE001 - sorted out by now_error, re-raised
            raise rt.now_error(exc)  # ActorDead sets its own cause
        raise rt.now_waited(coro)

    async def ask(self, message: object, *, timeout: float | None = None) -> Any:
        """Send `message` and wait for the actor's reply (what `receive` returned).

        If the actor is idle (running, nothing queued, no handler in flight)
        and no `timeout` is given, the handler runs right here in the
        caller's task (an *inline ask*: no task switch). Otherwise the request
        goes through the mailbox and a dispatcher runs it. Cancelling the
        caller during an inline handler ends the incarnation like a kill (it
        is restarted from scratch, not counted toward its supervisor's
        intensity) and the cancellation goes on in the caller.

        Args:
            message: an immutable message.
            timeout: seconds (of the event loop's clock) to wait for room in
                the mailbox and for the reply together; `None` waits as long
                as the actor lives. A timed-out message may still be handled;
                its reply is then dropped.

        Returns:
            The value the actor's `receive` returned for this message.

        Raises:
            TimeoutError: the reply did not come within `timeout`.
            ActorDead: the actor is not running, or stopped or died before
                replying (``__cause__`` is its crash exception, if any).
            MutableMessageError: `message` is not of an immutable type.
            Exception: whatever the handler raised, if its type is listed in
                the actor's `reply_errors` (the actor lives on).
        """
        global _calls
        _calls += 1
        if _calls >= CHECKPOINT_EVERY:
            _calls = 0
            await _checkpoint()
        if type(message) not in _IMMUTABLE:
            check_message(message)
        cell = self._cell
        rt = cell.current
        if rt is None or cell.retired or not rt.accepting:
            rt = self._runtime()
        if timeout is not None:
            request = Ask(message)
            with anyio.fail_after(timeout):
                await self._send_ask(rt, request)
                return await request.wait()
        if not rt.inline or rt.busy or rt.queue or rt.sysq:
            request = Ask(message)
            await self._send_ask(rt, request)
            return await request.wait()
        if rt.scoped:
            return await rt.ask_inline(message)  # its handlers need a scope up front
        # An inline ask: the handler's first step right here, so that one that
        # does not wait costs this call alone (see `_drive.py` for the rest).
        deferred = rt.deferred
        base = None if deferred else cancel_scope_token()
        rt.busy = True
        coro = rt.actor.receive(message)
        try:
            yielded = coro.send(None)
        except StopIteration as stop:
            value = stop.value
        except BaseException as exc:  # noqa: BLE001 - sorted out by inline_error, re-raised
            raise rt.inline_error(exc)  # ActorDead sets its own cause
        else:
            try:
                if deferred:
                    value = await resume(coro, yielded, rt)
                    if rt.cancelled:
                        raise Killed
                else:
                    value = await rest(rt, coro, yielded, base, None)
            except BaseException as exc:  # noqa: BLE001 - as above
                raise rt.inline_error(exc)
        rt.busy = False
        if rt.stop_requested or rt.queue or rt.sysq:
            rt.release_owner()  # work for a dispatcher, or a stop to finish
        return value

    async def _send_ask(self, rt: Incarnation, request: Ask) -> None:
        # No checkpoint when there is room: the caller blocks on the reply
        # right after, which is the ask's checkpoint.
        queue = rt.queue
        if len(queue) < rt.size:
            if queue is NO_ITEMS:
                queue = rt.queue = deque()
            queue.append(request)
            if not rt.busy and not rt.scheduled:
                rt.sched.schedule(rt)
            return
        await rt.put(request)

    def statistics(self) -> ActorStatistics:
        """Return a snapshot of the actor at this path (see `ActorStatistics`)."""
        cell = self._cell
        if cell.retired:
            cell = cell.registry.get(self.path, cell)
        return cell.statistics()

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ActorRef):
            return NotImplemented
        return self.path == other.path and self._cell.registry is other._cell.registry

    def __hash__(self) -> int:
        return hash(self.path)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.path}>"


class SupervisorRef(ActorRef):
    """A ref to a supervisor's path, adding `start_child` and `stop_child`.

    Both call straight into the current supervisor incarnation (no mailbox
    hop), from the caller's task.
    """

    __slots__ = ()

    def _supervisor(self) -> SupervisorLike:
        cell = self._cell
        rt = cell.current
        if rt is None or cell.retired or not rt.accepting:
            rt = self._runtime()
        actor = rt.actor
        if not actor._actor_is_supervisor:  # True on `Supervisor` alone (_supervisor.py)
            raise TypeError(
                f"the actor at {self.path} is a {type(actor).__name__}, not a Supervisor"
            )
        return actor  # type: ignore[return-value]  # a Supervisor (no cast: no call)

    async def start_child(self, spec: ChildSpec) -> ActorRef:
        """Start a dynamic child under this supervisor (see `Supervisor.start_child`).

        Raises:
            ChildExists: the id is taken.
            StartFailed: the child's `on_start` failed.
            ActorDead: the supervisor is not running.
            TypeError: the actor at this path is not a supervisor.
        """
        cell = self._cell  # `_supervisor()`, inlined
        rt = cell.current
        if rt is None or cell.retired or not rt.accepting or not rt.actor._actor_is_supervisor:
            return await self._supervisor().start_child(spec)  # raises
        sup = rt.actor  # a Supervisor: `Supervisor.start_child`'s body, one coroutine fewer
        child = sup._add_child(spec, "start_child")  # type: ignore[attr-defined]
        runtime = child.runtime
        if not runtime.started:
            await sup._handshake(child, runtime)  # type: ignore[attr-defined]
        ref = child.cached_ref
        if ref is None:
            ref = child.cached_ref = runtime.actor._actor_ref_type(child)
        return ref  # type: ignore[no-any-return]

    def start_child_nowait(self, spec: ChildSpec) -> ActorRef:
        """Start a dynamic child without waiting for its `on_start` (see
        `Supervisor.start_child_nowait`).

        Raises:
            ChildExists: the id is taken.
            StartFailed: the child's factory failed.
            ActorDead: the supervisor is not running.
            TypeError: the actor at this path is not a supervisor.
        """
        cell = self._cell  # `_supervisor()`, inlined: a lease actor starts on every step
        rt = cell.current
        if rt is None or cell.retired or not rt.accepting or not rt.actor._actor_is_supervisor:
            return self._supervisor().start_child_nowait(spec)  # raises
        return rt.actor.start_child_nowait(spec)  # type: ignore[attr-defined,no-any-return]

    async def stop_child(self, child_id: str) -> None:
        """Stop and remove a child (see `Supervisor.stop_child`).

        Raises:
            ActorNotFound: no child has this id.
            ActorDead: the supervisor is not running.
            TypeError: the actor at this path is not a supervisor.
        """
        cell = self._cell  # `_supervisor()`, inlined
        rt = cell.current
        if rt is None or cell.retired or not rt.accepting or not rt.actor._actor_is_supervisor:
            await self._supervisor().stop_child(child_id)  # raises
            return
        sup = rt.actor  # a Supervisor: `Supervisor.stop_child`'s body, one coroutine fewer
        child = sup._take_child(child_id)  # type: ignore[attr-defined]
        if child is not None:
            await sup._stop_incarnation(child)  # type: ignore[attr-defined]

    def which_children(self) -> list[tuple[str, ActorRef]]:
        """Return ``(id, ref)`` for every child, in start order.

        Raises:
            ActorDead: the supervisor is not running.
            TypeError: the actor at this path is not a supervisor.
        """
        return self._supervisor().which_children()

    def count_children(self) -> int:
        """How many children the supervisor has now.

        Raises:
            ActorDead: the supervisor is not running.
            TypeError: the actor at this path is not a supervisor.
        """
        return self._supervisor().count_children()
