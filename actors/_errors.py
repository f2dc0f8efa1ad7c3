"""The actor runtime's errors: one closed hierarchy rooted at `ActorError`.

The hierarchy, and when each error reaches you:

* `ActorError`: the base class; catch it to catch everything below.
* `ActorDead`: you sent to, asked, killed or started under an actor that is not
  running. Every ask queued to or in flight in an incarnation fails with it when
  that incarnation stops or dies, so no caller hangs on a dead actor. Its
  `reason` (also its ``__cause__``) is the crash exception, or `None` after a
  normal stop.
* `ActorKilled`: never raised to a caller; it is the crash *reason* of an actor
  killed with `ActorSystem.kill` (seen as `ActorDead.reason` by its pending
  askers, and by the supervisor that applies its child spec; a kill skips
  `on_stop`), or of one whose handler was abandoned when the task running it
  inline was cancelled.
* `ActorNotFound`: `ActorSystem.resolve` (and friends) found nothing at a path.
  Also a `LookupError`.
* `ChildExists`: `start_child` was given an id its supervisor already has. Also
  a `ValueError`.
* `StartFailed`: an actor's `on_start` raised (or the actor was killed or
  cancelled before it finished starting). ``__cause__`` holds the original
  exception. Raised from `start_child`, and from a supervisor whose static child
  failed to start.
* `SupervisorEscalation`: a supervisor exceeded its restart intensity. It is
  the crash reason the supervisor hands to its parent; out of the root
  supervisor it leaves ``async with ActorSystem(...)`` inside an
  `ExceptionGroup`.
* `MutableMessageError`: a message was not of an immutable type. Also a
  `TypeError`.

`WouldBlock` (from `tell_nowait` on a full mailbox) is anyio's own, re-exported
so callers need not import anyio for it; ask timeouts raise the builtin
`TimeoutError`, as anyio's `fail_after` does.
"""

from __future__ import annotations

__all__ = [
    "ActorDead",
    "ActorError",
    "ActorKilled",
    "ActorNotFound",
    "ChildExists",
    "MutableMessageError",
    "StartFailed",
    "SupervisorEscalation",
]


class ActorError(Exception):
    """Base class of every error the actor runtime raises on purpose."""


class ActorDead(ActorError):
    """The actor at `path` is not running, so the message cannot be handled.

    Attributes:
        path: the actor's path.
        reason: why the incarnation ended: the crash exception, or `None` for a
            normal stop (or when no incarnation is there at all).
    """

    def __init__(self, path: str, reason: BaseException | None = None) -> None:
        self.path = path
        self.reason = reason
        if reason is None:
            text = f"actor {path} is not running"
        else:
            text = f"actor {path} is dead: {reason!r}"
        super().__init__(text)
        if reason is not None:
            self.__cause__ = reason


class ActorKilled(ActorError):
    """The crash reason of an actor killed on purpose (fault injection).

    Also the reason of an incarnation whose handler was abandoned half way
    because the task running it inline (an asker's, a starter's) was
    cancelled: its state cannot be trusted, so it ends like a killed one and
    is restarted from scratch, not counted toward the restart intensity.

    Attributes:
        path: the killed actor's path.
        detail: why, when it was not `ActorSystem.kill` (else `None`).
    """

    def __init__(self, path: str, detail: str | None = None) -> None:
        self.path = path
        self.detail = detail
        text = f"actor {path} was killed"
        super().__init__(text if detail is None else f"{text}: {detail}")


class ActorNotFound(ActorError, LookupError):
    """Nothing is registered at `path`.

    Attributes:
        path: the path that was looked up.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        super().__init__(f"no actor at {path}")


class ChildExists(ActorError, ValueError):
    """A supervisor already has a child with this id (so this path is taken).

    Attributes:
        path: the path the new child would have had.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        super().__init__(f"an actor already runs at {path}")


class StartFailed(ActorError):
    """The actor at `path` did not finish starting; ``__cause__`` says why.

    Attributes:
        path: the actor that failed to start.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        super().__init__(f"actor {path} failed to start")


class SupervisorEscalation(ActorError):
    """A supervisor saw more than `intensity` restarts within `period` seconds.

    It has stopped its children (in reverse start order) and itself; its parent
    decides what happens next. ``__cause__`` is the child failure that tipped it.

    Attributes:
        path: the supervisor that gave up.
        intensity: its maximum number of restarts within `period`.
        period: the sliding window, in seconds of its clock.
    """

    def __init__(self, path: str, intensity: int, period: float) -> None:
        self.path = path
        self.intensity = intensity
        self.period = period
        super().__init__(
            f"supervisor {path} exceeded its restart intensity "
            f"({intensity} restarts in {period:g} s) and gave up"
        )


class MutableMessageError(ActorError, TypeError):
    """A message was not of a type the runtime accepts as immutable.

    Attributes:
        message_type: the rejected type.
    """

    def __init__(self, message_type: type) -> None:
        self.message_type = message_type
        name = f"{message_type.__module__}.{message_type.__qualname__}"
        super().__init__(
            f"actor messages must be immutable; {name} is not: send a frozen dataclass, "
            "a NamedTuple or tuple, an Enum, or an immutable scalar (int, float, str, "
            "bytes, None, frozenset, ...), or call register_immutable() for your own type"
        )
