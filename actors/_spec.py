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
from dataclasses import dataclass
from typing import Literal

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


@dataclass(frozen=True, slots=True)
class ChildSpec:
    """How a supervisor starts, restarts and stops one child.

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

    id: str
    start: Callable[[], ActorLike]  # an `Actor`, checked at start (_spec sits below _actor)
    restart: Restart = Restart.PERMANENT
    shutdown: float | Literal["brutal"] | None = None

    def __post_init__(self) -> None:
        # `type(x) is T` first: a spec is made per lease attempt, and these
        # checks cost no call when they pass.
        child_id = self.id
        if (type(child_id) is not str and not isinstance(child_id, str)) or not child_id or (
            "/" in child_id or child_id in (".", "..")
        ):
            raise ValueError(
                f"ChildSpec.id must be a non-empty path segment without '/', got {self.id!r}"
            )
        if not callable(self.start):
            raise TypeError(f"ChildSpec.start must be a zero-argument callable, got {self.start!r}")
        if type(self.restart) is not Restart:
            raise TypeError(f"ChildSpec.restart must be a Restart, got {self.restart!r}")
        shutdown = self.shutdown
        if shutdown is not None and shutdown != "brutal":
            if isinstance(shutdown, bool) or not isinstance(shutdown, (int, float)):
                raise ValueError(
                    f"ChildSpec.shutdown must be seconds, 'brutal' or None, got {shutdown!r}"
                )
            if math.isnan(shutdown) or shutdown < 0:
                raise ValueError(f"ChildSpec.shutdown must be >= 0 seconds, got {shutdown!r}")
