"""What every daemon actor stands on: storage, catalog, config, clock, the actor system, and two sinks.

The daemon's actors used to reach all of this through one hub object (the
engine), which also served the transport's operations and owned dicts the
actors wrote directly. Now the ground is this small record, handed down at
construction, and it holds no behaviour of its own beyond two leaf sinks that
import nothing of the actors:

* `DaemonStats`: counters and samples for ``/metrics`` (runs started and
  ended, leases offered, runs by status, run-to-complete and
  schedule-to-start times). Actors add to it; nobody reads it back to decide.
* `RunWatch`: where ``result`` long-polls wait for a run to end. A run actor
  reports the end; the waiters wake.

Sibling actors are reached by path through `system` (`peers`), never through
the API above them: nothing here calls back up.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

from stepd.actors import ActorSystem, ChildSpec, Clock, Waiter
from stepd.sansio.errors import Invalid
from stepd.sansio.pricing import PriceBook
from stepd.sansio.run import DEFAULT_MAX_CHILD_DEPTH
from stepd.storage import Storage

if TYPE_CHECKING:
    from .catalog import Catalog

__all__ = ["DaemonConfig", "DaemonStats", "RunWatch", "Services", "TraceSink"]


@dataclass(frozen=True, slots=True)
class DaemonConfig:
    """The numbers the protocol runs on (PROTOCOL.md "Defaults"), and the daemon's bounds."""

    lease_ttl_ms: int = 30_000
    heartbeat_ms: int = 10_000
    recovery_window_ms: int = 5_000
    max_request_ms: int = 30_000
    max_child_depth: int = DEFAULT_MAX_CHILD_DEPTH
    #: A worker with no connection, no claim and no live lease for this long is
    #: forgotten (0: never). Journals keep its id.
    worker_expiry_ms: int = 600_000
    sync: bool = True  # False only for benchmark comparison and the power-loss control: unsafe
    #: Let a storage batch run on the event loop while the writer thread idles and
    #: commits are quick (docs/storage.md "On the loop while the writer is idle").
    commit_on_loop: bool = True
    #: Make a commit durable with one synced append to the storage's write-ahead log
    #: (docs/storage.md "The write-ahead log"); False: LMDB syncs its own commits.
    write_ahead_log: bool = True
    map_size: int = 64 << 20
    max_map_size: int = 64 << 30
    prices: PriceBook = PriceBook()  # noqa: RUF009 - frozen: one shared default is safe
    #: Finished runs are deleted this long after they ended (0: kept forever; docs/storage.md
    #: "Retention"); their idempotency keys after `idempotency_retention_ms` (0: the same).
    retention_ms: int = 0
    idempotency_retention_ms: int = 0

    @property
    def claim_hold_ms(self) -> int:
        """A claim waits at most `min(wait_ms, hold)`: 4/5 of `max_request_ms`."""
        return self.max_request_ms * 4 // 5

    def check(self) -> None:
        """Raises: Invalid, naming the setting out of range."""
        for name in ("lease_ttl_ms", "heartbeat_ms", "max_request_ms"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise Invalid("must be a positive integer (milliseconds)", field=name)
        if not isinstance(self.recovery_window_ms, int) or self.recovery_window_ms < 0:
            raise Invalid("must be an integer >= 0 (milliseconds)", field="recovery_window_ms")
        if self.heartbeat_ms >= self.lease_ttl_ms:
            raise Invalid("must be less than lease_ttl_ms", field="heartbeat_ms")
        expiry = self.worker_expiry_ms
        if isinstance(expiry, bool) or not isinstance(expiry, int) or expiry < 0:
            raise Invalid("must be an integer >= 0 (milliseconds; 0: never)",
                          field="worker_expiry_ms")
        for name in ("retention_ms", "idempotency_retention_ms"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise Invalid("must be an integer >= 0 (milliseconds; 0: off)", field=name)
        depth = self.max_child_depth
        if isinstance(depth, bool) or not isinstance(depth, int) or not 0 <= depth <= 64:
            raise Invalid("must be an integer from 0 to 64", field="max_child_depth")


@dataclass(slots=True)
class DaemonStats:
    """Counters and samples for ``/metrics``: written by actors, read by the metrics page."""

    runs_started: int = 0
    runs_ended: int = 0
    leases_offered: int = 0
    #: Deferred run writes (an offer, a `started`) taken back before any batch took
    #: them and written in their run's next write instead (`RunWrites._take_behind`).
    writes_merged: int = 0
    #: Finished runs deleted by retention or `prune_runs`.
    runs_pruned: int = 0
    #: Runs by status, kept current by every transition.
    status_counts: dict[str, int] = field(default_factory=dict)
    run_to_complete: list[float] = field(default_factory=list)
    schedule_to_start: list[float] = field(default_factory=list)

    def status_moved(self, old: str | None, new: str) -> None:
        counts = self.status_counts
        if old is not None:
            counts[old] = counts.get(old, 1) - 1
        counts[new] = counts.get(new, 0) + 1

    def sample(self, samples: list[float], seconds: float) -> None:
        samples.append(seconds)
        if len(samples) > 10_000:
            del samples[:5_000]


class RunWatch:
    """Where ``result`` long-polls wait for runs to end (a run actor reports each end)."""

    __slots__ = ("_waiting",)

    def __init__(self) -> None:
        self._waiting: dict[str, list[Waiter]] = {}

    def waiter(self, run_id: str) -> Waiter:
        """A one-shot wake-up for the end of `run_id`; `forget` it if you stop waiting."""
        w = Waiter()
        self._waiting.setdefault(run_id, []).append(w)
        return w

    def forget(self, run_id: str, w: Waiter) -> None:
        waiters = self._waiting.get(run_id)
        if waiters is not None:
            try:
                waiters.remove(w)
            except ValueError:
                pass
            if not waiters:
                del self._waiting[run_id]

    def ended(self, run_id: str) -> None:
        for w in self._waiting.pop(run_id, ()):
            w.set()


class TraceSink(Protocol):
    """Where run writes go to be exported as spans (`stepd.otel`); None when export is off.

    `committed` is called on the event loop with each `store.RunWrite` once it
    is committed (or, for a write nobody awaits, once it is queued: see
    `RunActor._write_behind`). It must return at once: it hands the write to
    a queue of its own and never blocks or raises (docs/otel.md).
    """

    def committed(self, write: Any) -> None: ...

    def statistics(self) -> Any:
        """A frozen record of counts (``/metrics``: ``stepd_otel_export``)."""


def _unset(*args: Any) -> NoReturn:
    raise RuntimeError("the daemon's tree is not built yet")


@dataclass(slots=True)
class Services:
    """The ground the daemon's actors stand on (see the module docstring)."""

    storage: Storage
    catalog: Catalog
    config: DaemonConfig
    clock: Clock
    #: Set right after the tree is built (the tree's actors reach it only once they run).
    system: ActorSystem = None  # type: ignore[assignment]
    stats: DaemonStats = field(default_factory=DaemonStats)
    watch: RunWatch = field(default_factory=RunWatch)
    #: The span exporter's hand-off (`TraceSink`), or None: export off, no work per step.
    trace: TraceSink | None = None
    #: False once the daemon began shutting down: no new leases are handed out.
    serving: bool = True
    #: Runs being created (`Daemon.start_run`, between its write and its actor's
    #: start) -> how many incarnations loaded them from storage meanwhile. The
    #: machine the start holds is the run's truth only while that is 0: recovery
    #: may activate a just-committed run, let it offer, and lose it to a kill,
    #: and a start that then handed its stale machine to a new incarnation would
    #: write over what that one journaled (the campaign's /runs kills found it).
    creating: dict[str, int] = field(default_factory=dict)
    #: Lease id -> the time (ms) of its last call, or of its offer before any, for
    #: as long as the lease lives in this process: what a lease actor's successor
    #: counts its expiry from (lease.py). Held here, not in a child spec, because
    #: a /leases or /registry restart rebuilds every lease actor from a new spec:
    #: with a memo per spec, each rebuild granted a dead worker's lease a full TTL
    #: from now, and kills a TTL apart kept it alive forever (examples/chaos.py
    #: found 7 leases of a SIGKILLed worker never orphaned in 50 s). A plain int
    #: per lease, not an object: lease actors start and stop on every attempt.
    lease_touched: dict[str, int] = field(default_factory=dict)
    #: When the timer actor sweeps the live leases next (ms), None when no sweep is
    #: asked for: a fresh lease whose expiry is no sooner leaves its own timer
    #: unarmed (lease.py "lazy expiry"; `peers.defer_expiry`).
    lease_sweep_at: int | None = None
    #: Worker id -> its push connection (`_api_workers.Connection`), recorded by
    #: `Daemon.attach` once the session is running and before its `Attach` is
    #: told, dropped by that connection's `detach`. A session's start closes the
    #: one recorded before it (session.py): its `Attach` and credit may have died
    #: in a killed incarnation's mailbox, or with the whole sessions supervisor,
    #: and an idle worker sends no credit again by itself (examples/chaos.py
    #: left runs queued for good that way).
    push_conns: dict[str, Any] = field(default_factory=dict)
    #: Worker sessions whose actor started in this process. A session's first start
    #: here after a daemon restart grants its holder a full `lease_ms` (its worker
    #: could not renew while the daemon was down), as recovery grants leases a full
    #: TTL; the restart after a kill keeps the lease end on record.
    work_sessions_seen: set[str] = field(default_factory=set)
    #: Refs to the tree's fixed actors (`/registry`, `/leases`...), resolved once:
    #: a ref reaches whichever incarnation is current at its path (docs/actors.md),
    #: and these paths are resolved several times per step (`peers.fixed`).
    fixed_refs: dict[str, Any] = field(default_factory=dict)
    #: The child specs of a run actor (run id, its freshly started machine or
    #: None, whether a message is on its way) and of a lease actor (record,
    #: fresh offer): set where the tree is built, so `peers` starts actors
    #: without importing their modules.
    run_spec: Callable[[str, Any, bool], ChildSpec] = _unset
    lease_spec: Callable[[Any, bool], ChildSpec] = _unset
    session_spec: Callable[[str], ChildSpec] = _unset
    #: The child spec of a worker session's ("affinity session") actor, by session id.
    work_session_spec: Callable[[str], ChildSpec] = _unset
    #: The child spec of a schedule actor (schedule id), set with the others.
    schedule_spec: Callable[[str], ChildSpec] = _unset
