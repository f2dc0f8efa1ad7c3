"""The actor: the class you subclass (its runtime side is `_runtime.Runtime`).

An `Actor` subclass overrides some of:

* ``async on_start()``: load state (from storage, in stepd). The actor's
  parent learns it has started only after this returns (the startup
  handshake), and messages sent meanwhile wait in the mailbox. If it raises,
  the start fails (`StartFailed`).
* ``async receive(message)``: handle one message. For an ask, the return
  value is the reply. One message at a time, in mailbox order; fired timers
  and stop requests are served ahead of the mailbox.
* ``async on_stop(reason)``: clean up after a normal stop (`reason` is
  `None`) or a crash (`reason` is the exception). It is not called when the
  actor is killed, cancelled from outside, brutally shut down, or never
  finished `on_start`. It runs shielded from outside cancellation, bounded by
  the child spec's `shutdown`.

and calls `stop()`, `arm_timer()`, `cancel_timer()`, and reads `path`, `ref`,
`clock` and `system`.

How an incarnation ends (the *exit reason* its supervisor sees):

* normal (`None`): `stop()` was called, or the supervisor stopped it;
* crash (the exception): `on_start`, `receive` or `on_stop` raised an
  `Exception` not listed in `reply_errors` (or listed, but for a tell);
* killed (`ActorKilled`): `ActorSystem.kill`, or its supervisor was killed,
  or the task running its handler inline (an asker's) was cancelled mid-way.

Whatever the reason, before `on_stop` runs the incarnation stops accepting
messages, its in-flight and queued asks fail with `ActorDead`, and its timers
are cancelled. Every step of that cleanup is synchronous, so it cannot be
interrupted half way.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import Any, ClassVar, Protocol

from ._clock import Clock
from ._errors import ActorDead
from ._messages import _IMMUTABLE, check_message
from ._ref import ActorRef, Cell, SupervisorRef
from ._spec import ChildSpec
from ._stats import ActorStatistics, ActorTree
from ._timers import TimerOwner, TimerService

__all__ = ["Actor", "ActorRuntime", "SystemView"]


class SystemView(Protocol):
    """`Actor.system`: the `ActorSystem` the actor runs in, by its public API.

    `ActorSystem` (`_system.py`) sits above this module (it starts a root
    `Supervisor`, an `Actor`), so the actor names it by this protocol, which
    it satisfies (mypy checks so wherever a `Runtime` is made).
    """

    @property
    def clock(self) -> Clock: ...
    @property
    def _timers(self) -> TimerService: ...
    @property
    def root(self) -> SupervisorRef: ...

    def resolve(self, path: str) -> ActorRef: ...
    def find(self, path: str) -> ActorRef | None: ...
    def supervisor(self, path: str = "/") -> SupervisorRef: ...
    async def spawn(self, spec: ChildSpec) -> ActorRef: ...
    async def stop(self, path: str) -> None: ...
    async def kill(self, path: str) -> None: ...
    def tree(self) -> ActorTree: ...
    def statistics(self, path: str) -> ActorStatistics: ...


class ActorRuntime(TimerOwner, Protocol):
    """What an actor needs of its incarnation (a `Runtime`, from `_runtime.py`, above)."""

    @property
    def cell(self) -> Cell: ...
    @property
    def system(self) -> SystemView: ...
    @property
    def path(self) -> str: ...
    @property
    def closed(self) -> bool: ...
    @property
    def reason(self) -> BaseException | None: ...

    def request_stop(self) -> None: ...
    def has_pending(self) -> bool: ...


class Actor:
    """Subclass me. One instance is one incarnation; a restart makes a new one.

    Class attributes to override:
        kind: the name shown in introspection (default: the class name).
        mailbox_size: the mailbox's capacity (default 1024); a full mailbox
            makes `tell` wait and `tell_nowait` raise `WouldBlock`.
        reply_errors: exception types that `receive` may raise for an *ask*
            without crashing: they are raised to the caller instead, and the
            actor handles its next message. Expected rejections (a conflict,
            invalid input) belong here; for a tell they are still a crash,
            since nobody would hear of them otherwise.
    """

    kind: ClassVar[str | None] = None
    mailbox_size: ClassVar[int] = 1024
    reply_errors: ClassVar[tuple[type[Exception], ...]] = ()

    _actor_runtime: ActorRuntime | None = None
    _actor_incarnated: bool = False
    _actor_ref_type: ClassVar[type[ActorRef]] = ActorRef
    #: Run this class's handlers inside a cancel scope entered before their
    #: first step (see `_drive.py`); learned when one suspended inside a scope
    #: of its own, set for supervisors.
    _actor_scoped: ClassVar[bool] = False
    _actor_is_supervisor: ClassVar[bool] = False
    #: True: every wait of this class's handlers (its `on_start` and messages;
    #: not `on_stop`) ends by itself (a storage commit, another actor's answer,
    #: a bounded retry), so a kill may wait for the wait in hand to end and is
    #: delivered at the handler's next resumption (`Killed` thrown in), the way
    #: `_drive.py` step 3 does: no cancel scope at all, never learned scoped.
    #: A class whose handler may wait for something that never comes (an event
    #: another actor may never set) must leave it False: a kill must interrupt it.
    deferred_kill: ClassVar[bool] = False
    #: True: `receive` never waits (it only reads and changes this actor's own
    #: state and sends without waiting). A tell to it while it is idle (running,
    #: nothing queued, no handler in flight) is then handled right in the
    #: teller's `tell`/`tell_nowait` call: no ready queue, no dispatcher turn,
    #: the same one-handler-at-a-time and per-sender order. A handler that
    #: waits anyway is a crash. The daemon's registry is one.
    sync_handlers: ClassVar[bool] = False
    #: True: `on_start` never waits (the actor is handed its state, or reads it
    #: without waiting). `start_child_nowait` then runs it on the spot, in the
    #: caller's call, instead of leaving it to a dispatcher; a failure is still
    #: the child's crash (`StartFailed`), never the caller's. One that waits
    #: anyway is a crash. The daemon's lease actor is one (one start per step).
    sync_start: ClassVar[bool] = False

    #: Why the incarnation before this one ended, when this one is a restart
    #: of the same child: the crash exception, `ActorKilled` for a kill, or
    #: None (the first start, or a sibling's failure restarted it). Set by the
    #: supervisor before `on_start`, so an actor can tell a crash loop (count
    #: it durably, give up) from fault injection.
    restart_reason: BaseException | None = None

    # -- hooks ----------------------------------------------------------------

    async def on_start(self) -> None:
        """Load the actor's state before it is reported started. Default: nothing.

        Raises:
            Exception: any; the start fails with `StartFailed` chained from it.
        """

    async def receive(self, message: Any) -> Any:
        """Handle one message; for an ask, return the reply.

        Raises:
            Exception: a crash (unless listed in `reply_errors` and the
                message was an ask). The default raises `NotImplementedError`.
        """
        raise NotImplementedError(f"{type(self).__name__} does not handle {message!r}")

    async def on_stop(self, reason: BaseException | None) -> None:
        """Clean up after a normal stop (`reason` is `None`) or a crash.

        Raises:
            Exception: any; after a normal stop it turns the exit into a crash.
        """

    # -- API for the actor's own code ----------------------------------------

    def _rt(self) -> ActorRuntime:
        rt = self._actor_runtime
        if rt is None:
            raise self._not_running()
        return rt

    def _not_running(self) -> RuntimeError:
        if self._actor_incarnated:
            return RuntimeError(f"{type(self).__name__} has stopped and left its supervisor")
        return RuntimeError(
            f"{type(self).__name__} is not running: start it with a ChildSpec "
            "through a Supervisor or ActorSystem.spawn()"
        )

    @property
    def path(self) -> str:
        """This actor's path, e.g. ``/runs/r_1``.

        Raises:
            RuntimeError: the actor was never started.
        """
        return self._rt().cell.path

    @property
    def ref(self) -> ActorRef:
        """A ref to this actor's path (it reaches future incarnations too).

        Raises:
            RuntimeError: the actor was never started.
        """
        return self._actor_ref_type(self._rt().cell)

    @property
    def system(self) -> SystemView:
        """The actor system this actor runs in.

        Raises:
            RuntimeError: the actor was never started.
        """
        return self._rt().system

    @property
    def clock(self) -> Clock:
        """The system's clock: read time here, never from `time`.

        Raises:
            RuntimeError: the actor was never started.
        """
        return self._rt().system.clock

    def stop(self) -> None:
        """Stop normally once the current message is handled.

        A normal stop: `on_stop(None)` runs, and a `TRANSIENT` child is not
        restarted (a `PERMANENT` one is). Messages still queued are dropped
        and queued asks fail with `ActorDead`.

        Raises:
            RuntimeError: the actor was never started.
        """
        rt = self._actor_runtime  # `_rt()` inlined: a lease actor stops on every step
        if rt is None:
            raise self._not_running()
        rt.request_stop()

    def has_pending(self) -> bool:
        """True when messages or fired timers wait to be handled.

        An actor that stops itself when it has nothing to do (a passivating
        run) checks this first, so it never drops work already queued for it.
        """
        return self._rt().has_pending()

    def arm_timer(self, key: Hashable, deadline: float, message: object) -> None:
        """Deliver `message` to this actor at `deadline` (of `self.clock.now()`).

        One-shot. Re-arming `key` replaces its timer, even one that has fired
        and is not delivered yet. A deadline already past fires at once. The
        timer dies with this incarnation.

        Raises:
            MutableMessageError: `message` is not of an immutable type.
            ValueError: `deadline` is NaN.
            ActorDead: the incarnation is already shutting down.
            RuntimeError: the actor was never started.
        """
        rt = self._actor_runtime  # `_rt()` inlined: timers are armed and cancelled on every step
        if rt is None:
            raise self._not_running()
        if type(message) not in _IMMUTABLE:  # as ActorRef.tell: a known type is immutable
            check_message(message)
        if math.isnan(deadline):
            raise ValueError("deadline must be a number of seconds, got NaN")
        if rt.closed:
            raise ActorDead(rt.path, rt.reason)
        rt.system._timers.arm(rt, key, deadline, message)

    def cancel_timer(self, key: Hashable) -> bool:
        """Cancel timer `key` so it never delivers; return whether it existed.

        Raises:
            RuntimeError: the actor was never started.
        """
        rt = self._actor_runtime  # `_rt()` inlined, as in `arm_timer`
        if rt is None:
            raise self._not_running()
        if key not in rt.timers:
            return False  # the common case (a handler re-checking its deadline): nothing to retire
        return rt.system._timers.cancel(rt, key)

    def timer_deadline(self, key: Hashable) -> float | None:
        """Return the deadline of timer `key`, or `None` if it is not armed.

        Raises:
            RuntimeError: the actor was never started.
        """
        entry = self._rt().timers.get(key)
        return None if entry is None else entry.deadline

    # -- runtime hooks (private) --------------------------------------------

    #: Whether the class has a start / stop hook worth running: set for every
    #: subclass when it is created (`__init_subclass__`).
    _actor_start_hook: ClassVar[bool] = False
    _actor_stop_hook: ClassVar[bool] = False

    #: The class keeps `Actor`'s `_actor_start` / `_actor_stop` (only `Supervisor`
    #: does not): the runtime then calls `on_start` / `on_stop` directly, one
    #: coroutine frame fewer (a lease actor starts on every step).
    _actor_plain_start: ClassVar[bool] = True
    _actor_plain_stop: ClassVar[bool] = True

    #: What an incarnation copies from its class, in one lookup (`_lifecycle.incarnate`):
    #: ``(cls, mailbox_size, start hook, stop hook, deferred_kill, sync_handlers,
    #: kind)``, made on the class's first start (`_actor_learn_traits`). It names
    #: its class, so a subclass (which inherits it) learns its own.
    _actor_traits: ClassVar[tuple[type, int, bool, bool, bool, bool, str] | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._actor_plain_start = cls._actor_start is Actor._actor_start
        cls._actor_plain_stop = cls._actor_stop is Actor._actor_stop
        cls._actor_start_hook = cls.on_start is not Actor.on_start or not cls._actor_plain_start
        cls._actor_stop_hook = cls.on_stop is not Actor.on_stop or not cls._actor_plain_stop

    @classmethod
    def _actor_learn_traits(cls) -> tuple[type, int, bool, bool, bool, bool, str]:
        """Read and keep `_actor_traits` (on a class's first start).

        Raises:
            ValueError: `mailbox_size` is not an int >= 1 (the start fails;
                nothing is kept, so every start says so).
        """
        size = cls.mailbox_size
        if type(size) is not int or size < 1:
            raise ValueError(f"{cls.__name__}.mailbox_size must be an int >= 1, got {size!r}")
        traits = (cls, size, cls._actor_start_hook, cls._actor_stop_hook, cls.deferred_kill,
                  cls.sync_handlers, cls.kind or cls.__name__)
        cls._actor_traits = traits
        return traits

    async def _actor_start(self) -> None:
        await self.on_start()

    async def _actor_stop(self, reason: BaseException | None) -> None:
        await self.on_stop(reason)

    async def _actor_system_item(self, item: object) -> None:
        """Handle an item of the system queue other than a timer (supervisors)."""

    def _actor_system_item_now(self, item: object) -> bool:
        """Handle `item` at once if that needs no waiting; False leaves it to `_actor_system_item`.

        What cannot wait cannot be killed half way either, so it needs no
        cancel scope nor a handler driver (supervisors are scoped: a driven
        child exit costs one).
        """
        return False

    def __repr__(self) -> str:
        rt = self._actor_runtime
        where = rt.cell.path if rt is not None else "not started"
        return f"<{type(self).__name__} {where}>"
