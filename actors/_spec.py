"""Supervision as data: child specs, restart types and strategies (OTP's terms).

A `ChildSpec` says how to make a child (`start`, a zero-argument factory that
returns a *fresh* `Actor` instance for every incarnation), when to restart it,
and how long it may take to stop. A `Strategy` says which siblings restart with
a failed child.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from typing import Literal, NamedTuple, Self

from ._types import ActorLike

__all__ = ["DEFAULT_WORKER_SHUTDOWN", "ChildSpec", "Restart", "Strategy"]

#: Seconds a worker (non-supervisor) child gets to stop before it is cancelled,
#: when its spec leaves `shutdown` unset. OTP's default too.
DEFAULT_WORKER_SHUTDOWN = 5.0


class Restart(enum.Enum):
    """When a child that exited is started again.

    * `PERMANENT`: always, whatever the exit (a normal stop included).
    * `TRANSIENT`: only after an abnormal exit: a crash or a kill, not a normal
      stop (``self.stop()``).
    * `TEMPORARY`: never; the child is removed when it exits.
    """

    PERMANENT = "permanent"
    TRANSIENT = "transient"
    TEMPORARY = "temporary"


class Strategy(enum.Enum):
    """Which children restart when one child's exit calls for a restart.

    * `ONE_FOR_ONE`: only that child.
    * `ONE_FOR_ALL`: every child: the others are stopped in reverse start
      order, then all are started again in order.
    * `REST_FOR_ONE`: that child and the children started after it (stopped in
      reverse, restarted in order).
    """

    ONE_FOR_ONE = "one_for_one"
    ONE_FOR_ALL = "one_for_all"
    REST_FOR_ONE = "rest_for_one"


class _ChildSpecFields(NamedTuple):
    id: str
    start: Callable[[], ActorLike]  # an `Actor`, checked at start (_spec sits below _actor)
    restart: Restart = Restart.PERMANENT
    shutdown: float | Literal["brutal"] | None = None


_new_tuple = tuple.__new__
_PERMANENT = Restart.PERMANENT


class ChildSpec(_ChildSpecFields):
    """How a supervisor starts, restarts and stops one child.

    Immutable, as OTP's child specs are data: a named tuple, not a frozen
    dataclass, because the daemon makes one per lease attempt and a frozen
    dataclass costs ~2.5 us to build (four ``object.__setattr__`` calls and a
    ``__post_init__``) where this costs ~1 us (bench/README.md, "The actor
    runtime at issue 13's spawn target").

    Attributes:
        id: unique among its siblings; also the last segment of the child's
            path (``/runs`` + ``r_1`` gives ``/runs/r_1``), so it may not be
            empty, contain ``/``, or be ``.`` or ``..``.
        start: a zero-argument callable returning a fresh `Actor` (a
            `Supervisor` for a subtree) each time it is called.
        restart: see `Restart`.
        shutdown: how a graceful stop may last, in seconds, before the child is
            cancelled; ``"brutal"`` cancels it at once (no `on_stop`); `None`
            means `DEFAULT_WORKER_SHUTDOWN` for workers and no limit
            (``math.inf``) for supervisors, which need the time to stop their
            own children.

    Raises:
        ValueError: if `id` is not a valid path segment or `shutdown` is
            negative or NaN.
        TypeError: if `start` is not callable, or `restart` is not a `Restart`.
    """

    __slots__ = ()

    def __new__(
        cls,
        id: str,
        start: Callable[[], ActorLike],
        restart: Restart = _PERMANENT,
        shutdown: float | Literal["brutal"] | None = None,
    ) -> Self:
        # `type(x) is T` first: a spec is made per lease attempt, and these
        # checks cost no call when they pass.
        if (type(id) is not str and not isinstance(id, str)) or not id or (
            "/" in id or id in (".", "..")
        ):
            raise ValueError(
                f"ChildSpec.id must be a non-empty path segment without '/', got {id!r}"
            )
        if not callable(start):
            raise TypeError(f"ChildSpec.start must be a zero-argument callable, got {start!r}")
        if type(restart) is not Restart:
            raise TypeError(f"ChildSpec.restart must be a Restart, got {restart!r}")
        if shutdown is not None and shutdown != "brutal":
            if isinstance(shutdown, bool) or not isinstance(shutdown, (int, float)):
                raise ValueError(
                    f"ChildSpec.shutdown must be seconds, 'brutal' or None, got {shutdown!r}"
                )
            if math.isnan(shutdown) or shutdown < 0:
                raise ValueError(f"ChildSpec.shutdown must be >= 0 seconds, got {shutdown!r}")
        return _new_tuple(cls, (id, start, restart, shutdown))
