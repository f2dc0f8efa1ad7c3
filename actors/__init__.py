"""The actor runtime: mailboxes, actors, supervisors, timers and clocks.

Generic on purpose (STYLE.md rule 5): nothing here knows about HTTP,
WebSockets, LMDB or workflows; the daemon's own actors are built on this
public API only. It runs on asyncio and trio alike (anyio only).

The model in one paragraph: an `Actor` handles one immutable message at a time
from a bounded mailbox; callers hold an `ActorRef` to its path and `tell` or
`ask`. A `Supervisor` starts children from `ChildSpec` data, restarts them per
`Restart` type and `Strategy`, and escalates to its parent past its restart
intensity (`add_restart`). Actors own no task: the system's scheduler runs
them on a pool of dispatcher tasks, and an ask to an idle actor runs its
handler in the asker's task. Timers are owned by actors and read a `Clock`
(`SystemClock`, or `ManualClock` in tests). An `ActorSystem` runs the tree,
resolves paths, kills actors for fault injection, and reports `tree()` and
`statistics()`. See docs/actors.md.
"""

from __future__ import annotations

from anyio import WouldBlock

from ._actor import Actor
from ._clock import Clock, ManualClock, SystemClock
from ._errors import (
    ActorDead,
    ActorError,
    ActorKilled,
    ActorNotFound,
    ChildExists,
    MutableMessageError,
    StartFailed,
    SupervisorEscalation,
)
from ._intensity import add_restart
from ._mailbox import Mailbox
from ._messages import check_message, is_immutable_type, register_immutable
from ._ref import ActorRef
from ._spec import DEFAULT_WORKER_SHUTDOWN, ChildSpec, Restart, Strategy
from ._stats import ActorStatistics, ActorTree
from ._supervisor import Supervisor, SupervisorRef
from ._system import ActorSystem
from ._waiter import Waiter, current_time

__all__ = [
    "DEFAULT_WORKER_SHUTDOWN",
    "Actor",
    "ActorDead",
    "ActorError",
    "ActorKilled",
    "ActorNotFound",
    "ActorRef",
    "ActorStatistics",
    "ActorSystem",
    "ActorTree",
    "ChildExists",
    "ChildSpec",
    "Clock",
    "Mailbox",
    "ManualClock",
    "MutableMessageError",
    "Restart",
    "StartFailed",
    "Strategy",
    "Supervisor",
    "SupervisorEscalation",
    "SupervisorRef",
    "SystemClock",
    "Waiter",
    "WouldBlock",
    "add_restart",
    "check_message",
    "current_time",
    "is_immutable_type",
    "register_immutable",
]
