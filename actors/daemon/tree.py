"""The daemon's supervision tree, by data (STYLE.md rule 9)::

    root (rest_for_one; more than 10 crash restarts in 60 s and the daemon gives up)
    +-- sessions    one_for_one: one actor per registered worker   /sessions/<worker_id>
                    and one per worker session of a run          /sessions/ws_<run_id>.<name>
    +-- registry    routes runnable slots to sessions
    +-- runs        one_for_one: one actor per active run          /runs/<run_id>
    +-- leases      one_for_one: one actor per live lease          /leases/<lease_id>
    +-- timers      wakes passivated runs at their deadline
    +-- schedules   one_for_one: one actor per schedule            /schedules/<schedule_id>
    +-- recovery    on (re)start: activates runs with work in flight, resubscribes sessions,
                    starts every schedule's actor
    +-- retention   deletes finished runs past --retention, a slice per message

`rest_for_one`: a restart of one child restarts every child after it, ending
with recovery, which rebuilds the live actors from storage. Sessions come
first, so a registry, runs or leases restart does not drop workers'
connections (recovery has them subscribe again); killing /sessions itself
closes every connection and rebuilds everything after it.

Kills (fault injection) are restarted but counted by no supervisor, so the
intensities measure crashes alone: one poison run is bounded by its own
durable count (`run.MAX_CRASHES`); over 100 crashes of run, lease or session
actors in 10 s is systemic (the storage failing, a bug every run hits) and
escalates.

This module also gives `Services` the child specs of runs, leases and
sessions, so `peers` can start them without importing their modules.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from stepd.actors import ChildSpec, Restart, Strategy, Supervisor

from .lease import LeaseActor
from .recovery import RecoveryActor
from .registry import RegistryActor, WorkerInfo
from .retention import RetentionActor
from .run import RunActor
from .schedule import ScheduleActor
from .services import Services
from .session import SessionActor, SessionMemo
from .timers import TimerActor
from .work_session import WorkSessionActor

# The lease's restart policy as module names: a lookup on an Enum class costs ~1,400
# instructions on 3.11 (stepd/sansio/lease.py says why); one a step here.
_TRANSIENT = Restart.TRANSIENT

__all__ = ["CHILD_INTENSITY", "ROOT_INTENSITY", "build_tree"]

#: Crashes (not kills) of run, lease or session actors in 10 s before their supervisor escalates.
CHILD_INTENSITY = 100
#: Restarts of the tree's top (registry, supervisors, timers, recovery) in 60 s
#: before the daemon gives up.
ROOT_INTENSITY = 10


def build_tree(s: Services, load_workers: Callable[[], list[WorkerInfo]]) -> Supervisor:
    """The root supervisor, its children as data; wires `s`'s child specs."""

    def run_spec(run_id: str, initial: Any, expect_message: bool) -> ChildSpec:
        holder = [initial]
        incarnations = [0]

        def start() -> RunActor:
            incarnations[0] += 1
            restarted = incarnations[0] > 1
            init, holder[0] = holder[0], None  # a restart loads from storage
            return RunActor(s, run_id, init, restarted=restarted,
                            expect_message=expect_message and not restarted)

        return ChildSpec(run_id, start, restart=_TRANSIENT)

    def lease_spec(record: Any, fresh: bool) -> ChildSpec:
        # Nothing per lease beyond the spec: what its incarnations hand on is
        # `s.lease_touched` (lease.py), across rebuilds from new specs too.
        return ChildSpec(record.lease_id, lambda: LeaseActor(s, record, fresh=fresh),
                         restart=_TRANSIENT)

    def session_spec(worker_id: str) -> ChildSpec:
        memo = SessionMemo()
        return ChildSpec(worker_id, lambda: SessionActor(s, worker_id, memo),
                         restart=_TRANSIENT)

    def work_session_spec(session_id: str) -> ChildSpec:
        return ChildSpec(session_id, lambda: WorkSessionActor(s, session_id),
                         restart=_TRANSIENT)

    def schedule_spec(schedule_id: str) -> ChildSpec:
        return ChildSpec(schedule_id, lambda: ScheduleActor(s, schedule_id),
                         restart=_TRANSIENT)

    s.run_spec = run_spec
    s.work_session_spec = work_session_spec
    s.schedule_spec = schedule_spec
    s.lease_spec = lease_spec
    s.session_spec = session_spec

    def dynamic() -> Supervisor:
        return Supervisor(intensity=CHILD_INTENSITY, period=10.0)

    return Supervisor(
        [
            ChildSpec("sessions", dynamic),
            ChildSpec("registry", lambda: RegistryActor(s, load_workers)),
            ChildSpec("runs", dynamic),
            ChildSpec("leases", dynamic),
            ChildSpec("timers", lambda: TimerActor(s)),
            ChildSpec("schedules", dynamic),
            ChildSpec("recovery", lambda: RecoveryActor(s)),
            ChildSpec("retention", lambda: RetentionActor(s)),
        ],
        strategy=Strategy.REST_FOR_ONE,
        # More than 10 rebuilds of the tree in a minute and it will not get
        # better by itself: the root gives up, the daemon exits non-zero and
        # says why (a service manager restarts it).
        intensity=ROOT_INTENSITY,
        period=60.0,
    )
