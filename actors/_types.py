"""Protocols the lower runtime modules type against (a leaf: it imports no runtime module).

The runtime's modules form a layered graph, with no import cycle even among
type-only imports (tests/test_import_graph.py keeps it so)::

    _types, _clock, _errors, _mailbox, ...   leaves
    _spec, _timers, _drive                   data and mechanisms
    _ref                                     cells and refs
    _actor                                   the class users subclass
    _runtime                                 an incarnation (Actor + Cell)
    _turn, _scheduler                        the dispatchers
    _supervisor, _system                     the tree and its owner

A lower module that must name a higher module's class names a `Protocol`
instead: here when it needs nothing of the runtime's own types, else next
to its user (`_timers.TimerOwner`, `_ref.Incarnation`, `_actor.SystemView`,
`_actor.ActorRuntime`, `_runtime.RuntimeSystem`). Protocols are type-only:
nothing about them runs per message.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from typing import Any, ClassVar, Final, Protocol, TypeVar

import anyio

__all__ = [
    "NO_ITEMS",
    "NO_TIMERS",
    "ActorLike",
    "Dispatcher",
    "Driven",
    "SchedulerLike",
    "ScopedActor",
]

#: The mailbox and system queue of an incarnation that has had no item yet,
#: shared by all of them: whoever queues the first item gives the incarnation
#: its own deque (``if queue is NO_ITEMS``). Never append to it.
NO_ITEMS: Final[deque[Any]] = deque()
#: The timers of an incarnation that never armed one, shared likewise
#: (`TimerService.arm` gives it its own dict). Never store into it.
NO_TIMERS: Final[dict[Hashable, Any]] = {}

_R_contra = TypeVar("_R_contra", contravariant=True)


class ActorLike(Protocol):
    """What a `ChildSpec.start` factory returns: an `Actor` (its supervisor checks)."""

    async def on_start(self) -> None: ...

    async def receive(self, message: Any) -> Any: ...

    async def on_stop(self, reason: BaseException | None) -> None: ...


class Dispatcher(Protocol):
    """What the handler driver (`_drive`) tells the `Scheduler` of the dispatcher it runs on."""

    def blocked(self) -> None: ...

    def unblocked(self) -> None: ...


class SchedulerLike(Dispatcher, Protocol[_R_contra]):
    """The `Scheduler` as the incarnations it runs (of type `_R_contra`) see it."""

    def schedule(self, rt: _R_contra, /) -> None: ...


class ScopedActor(Protocol):
    """An actor class's flag that its handlers run in a scope entered up front."""

    _actor_scoped: ClassVar[bool]


class Driven(Protocol):
    """What `_drive` needs of the incarnation whose handler it runs (a `Runtime`)."""

    scoped: bool
    deferred: bool
    scope: anyio.CancelScope | None

    @property
    def cancelled(self) -> bool: ...

    @property
    def actor(self) -> ScopedActor: ...
