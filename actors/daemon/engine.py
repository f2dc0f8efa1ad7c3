"""The engine: storage, catalog and the supervision tree, and the daemon's own API.

`Engine.open(path)` opens the LMDB environment, loads the definition catalog
and starts the actor tree::

    root (rest_for_one)
    +-- registry        routes runnable slots to workers
    +-- runs            one_for_one, one actor per active run (dynamic)
    +-- leases          one_for_one, one actor per live lease (dynamic)
    +-- timers          wakes passivated runs when their deadline comes
    +-- recovery        on (re)start: activates every run with work in flight

Storage is opened before the tree and closed after it: it is the ground the
actors stand on, not one of them (its writer thread is the "storage writer").
`rest_for_one` means a restart of the registry or a supervisor also restarts
everything after it, ending with recovery, which rebuilds the live actors
from storage: killing any actor loses nothing acknowledged.

The public methods are the protocol's operations with Python types (start a
run, claim, a worker call on a lease, signal, cancel, status...). The
transports (HTTP, WebSocket, in-process) are thin adapters over them.
"""

from __future__ import annotations

import itertools
import logging
import sys
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio

from stepd.actors import (
    ActorDead,
    ActorNotFound,
    ActorSystem,
    ChildExists,
    ChildSpec,
    Clock,
    Mailbox,
    Restart,
    StartFailed,
    Strategy,
    Supervisor,
    SystemClock,
)
from stepd.sansio.definition import Definition, parse_definition
from stepd.sansio.errors import (
    Fenced,
    Invalid,
    NotFound,
    Unavailable,
    Unprocessable,
)
from stepd.sansio.events import AttemptSpec, StartChildren, Transition
from stepd.sansio.lease import LeaseRecord, Op
from stepd.sansio.pricing import PriceBook, step_usage
from stepd.sansio.record import RunRecord
from stepd.sansio.run import DEFAULT_MAX_CHILD_DEPTH, RunMachine
from stepd.storage import Storage

from . import ids, listing, store
from .catalog import Catalog, Registered, register_txn
from .lease import CONFLICTS, LeaseActor
from .messages import (
    Announce,
    CancelRun,
    CancelWait,
    Claim,
    EndLease,
    ForgetWorkers,
    LeaseCall,
    Offer,
    RegisterWorker,
    RegistryStats,
    ReleaseLease,
    ReturnSpecs,
    Signal,
    WithdrawSlots,
)
from .recovery import RecoveryActor
from .registry import RegistryActor, Stats, Waiter, WorkerInfo
from .run import RunActor, walk_writes
from .timers import TimerActor, TimerIndexChanged

log = logging.getLogger("stepd.daemon")

PROTOCOL_VERSION = "1.20"

#: Crashes (not kills) of run or lease actors in 10 s before their supervisor escalates.
RUNS_INTENSITY = 100
#: Restarts of the tree's top (registry, supervisors, timers, recovery) in 60 s
#: before the daemon gives up.
ROOT_INTENSITY = 10

#: How many times a call retries an actor that died under it (it is being
#: restarted by its supervisor, or a passivating run stopped at that moment).
RETRIES = 50


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """The numbers the protocol runs on (PROTOCOL.md "Defaults")."""

    lease_ttl_ms: int = 30_000
    heartbeat_ms: int = 10_000
    recovery_window_ms: int = 5_000
    max_request_ms: int = 30_000
    max_child_depth: int = DEFAULT_MAX_CHILD_DEPTH
    #: A worker with no connection, no claim and no live lease for this long is
    #: forgotten (0: never). Journals keep its id.
    worker_expiry_ms: int = 600_000
    sync: bool = True  # False only for benchmark comparison: unsafe
    map_size: int = 64 << 20
    max_map_size: int = 64 << 30
    prices: PriceBook = PriceBook()

    @property
    def claim_hold_ms(self) -> int:
        """A claim waits at most `min(wait_ms, hold)`: 4/5 of `max_request_ms`."""
        return self.max_request_ms * 4 // 5

    def check(self) -> None:
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
        depth = self.max_child_depth
        if isinstance(depth, bool) or not isinstance(depth, int) or not 0 <= depth <= 64:
            raise Invalid("must be an integer from 0 to 64", field="max_child_depth")


class Engine:
    """The daemon's core. Create it with `Engine.open`."""

    def __init__(self, storage: Storage, catalog: Catalog, config: EngineConfig, clock: Clock) -> None:
        self.storage = storage
        self.catalog = catalog
        self.config = config
        self.clock = clock
        self.system: ActorSystem
        self._result_waiters: dict[str, anyio.Event] = {}
        self._cancel_listeners: dict[str, Callable[[str, str], None]] = {}
        self._sessions: set[PushSession] = set()
        #: Leases with a live actor, by id (their actors keep this current).
        self.live_leases: dict[str, LeaseRecord] = {}
        #: When each worker last called on a lease (epoch ms).
        self.worker_seen: dict[str, int] = {}
        #: When each worker last did anything (registered, claimed, connected,
        #: called on a lease): what `expire_workers` judges idleness by.
        self.worker_active: dict[str, int] = {}
        #: HTTP claims in flight, by worker (a long-polling worker is connected).
        self._claiming: dict[str, int] = {}
        #: When each live lease last had a call: a killed lease actor's
        #: successor keeps counting its expiry from there.
        self.lease_touched: dict[str, int] = {}
        #: The earliest index entry committed since the timer actor last looked
        #: (`take_timer_hint`), and whether a poke to look is in its mailbox.
        self._timer_hint: int | None = None
        self._timer_poked = False
        #: Runs by status, kept current by every transition (for /metrics).
        self.status_counts: dict[str, int] = {}
        self.closing = False
        self.counters: dict[str, int] = {"runs_started": 0, "runs_ended": 0, "leases_offered": 0}
        self.run_to_complete: list[float] = []
        self.schedule_to_start: list[float] = []

    # ------------------------------------------------------------------ lifecycle

    @classmethod
    @asynccontextmanager
    async def open(
        cls, path: str, *, config: EngineConfig | None = None, clock: Clock | None = None
    ) -> AsyncIterator[Engine]:
        """Open the data directory and start the actor tree; stop both on exit.

        Raises:
            Invalid: a config value is out of range.
            storage errors: the directory cannot be opened (in use, newer schema).
        """
        config = config or EngineConfig()
        config.check()
        clock = clock or SystemClock()
        async with Storage.open(
            path, sync=config.sync, extra_tables=store.EXTRA_TABLES,
            map_size=config.map_size, max_map_size=config.max_map_size,
        ) as storage:
            catalog = Catalog()
            storage.read(catalog.load_txn)
            engine = cls(storage, catalog, config, clock)
            await _index_old_runs(storage)
            engine.status_counts = storage.read(listing.count_by_status_txn)
            now = clock.time_ms()  # every known worker gets a full expiry window after a restart
            engine.worker_active = {k.decode(): now for k, _ in storage.scan(store.WORKERS)}
            root = Supervisor(
                [
                    ChildSpec("registry", lambda: RegistryActor(engine._load_workers)),
                    # Kills (fault injection) are not counted by any supervisor,
                    # so these limits measure crashes alone. One poison run is
                    # bounded by its own durable count (run.MAX_CRASHES); over
                    # 100 crashes of run (or lease) actors in 10 s is systemic
                    # (the storage failing, a bug every run hits): the supervisor
                    # escalates and the root rebuilds the tree from storage.
                    ChildSpec("runs", lambda: Supervisor(intensity=RUNS_INTENSITY, period=10.0)),
                    ChildSpec("leases", lambda: Supervisor(intensity=RUNS_INTENSITY, period=10.0)),
                    ChildSpec("timers", lambda: TimerActor(engine)),
                    ChildSpec("recovery", lambda: RecoveryActor(engine)),
                ],
                strategy=Strategy.REST_FOR_ONE,
                # More than 10 rebuilds of the tree in a minute and it will not
                # get better by itself: the root gives up, the daemon exits
                # non-zero and says why (a service manager restarts it).
                intensity=ROOT_INTENSITY,
                period=60.0,
            )
            system = ActorSystem(clock=clock, root=root)
            engine.system = system
            async with system:
                try:
                    yield engine
                finally:
                    engine.closing = True

    # ------------------------------------------------------------------ workers

    async def register_worker(
        self,
        *,
        definitions: list[Any],
        name: str | None = None,
        worker_id: str | None = None,
        build_id: str | None = None,
        protocol_version: str = "1.0",
        concurrency: int = 1,
        capabilities: list[str] | None = None,
        manifest: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """PROTOCOL.md `register`: store the worker's definitions, return its id and numbers.

        Raises:
            Invalid: a definition fails validation (naming the definition and
                field), or a field of the registration is malformed.
        """
        if not isinstance(definitions, list):
            raise Invalid("must be a list", field="definitions")
        parsed: list[Definition] = []
        for i, raw in enumerate(definitions):
            try:
                parsed.append(parse_definition(raw))
            except Invalid as exc:
                where = f"definitions[{i}]"
                raise exc.with_location(field=where) from None
        negotiated = negotiate(protocol_version)
        check_capabilities(negotiated, capabilities or [], manifest)
        now = self.clock.time_ms()
        if worker_id is None:
            worker_id = ids.worker_id(now)
        elif not isinstance(worker_id, str) or not worker_id.startswith("w_") or len(worker_id) > 64:
            raise Invalid("must be a worker id returned by an earlier register", field="worker_id")
        name = name or f"worker-{worker_id[-6:].lower()}"
        keys = sorted({(d.name, d.version, step.body) for d in parsed for step in d.steps
                       if hasattr(step, "body")}, key=str)
        info = {
            "worker_id": worker_id, "name": name, "build_id": build_id,
            "protocol_version": negotiated, "concurrency": concurrency,
            "keys": [list(k) for k in keys], "registered_at": now,
            "capabilities": capabilities or [],
        }

        def txn(t: Any) -> list[Registered]:
            added = register_txn(t, parsed, now)
            t.put(store.WORKERS, worker_id, info)
            return added

        added = await self.storage.write(txn)
        for reg in added:
            self.catalog.add(reg)
        self.touch_worker(worker_id)
        # A registry that is restarting reloads this worker from the table.
        self._tell_registry(RegisterWorker(worker_id, name, frozenset(keys)))
        return {
            "worker_id": worker_id,
            "lease_ttl_ms": self.config.lease_ttl_ms,
            "heartbeat_ms": self.config.heartbeat_ms,
            "protocol_version": negotiated,
            "max_request_ms": self.config.max_request_ms,
            "definitions": [
                {"name": d.name, "version": d.version, "definition_hash": d.definition_hash}
                for d in parsed
            ],
        }

    def definitions(self) -> list[dict[str, Any]]:
        """GET /v1/api/definitions: every registered definition, by name, oldest version first.

        Reads the catalog, and the workers table (through `_load_workers`) for
        the ids of the workers holding each (name, version).
        """
        held: dict[tuple[str, str | None], list[str]] = {}
        for info in self._load_workers():
            for name_version in {(k[0], k[1]) for k in info.keys}:
                held.setdefault(name_version, []).append(info.worker_id)
        return [{"name": name, "version": reg.definition.version,
                 "definition_hash": reg.definition.definition_hash,
                 "registered_at": reg.registered_at, "definition": reg.definition.to_json(),
                 "worker_ids": sorted(held.get((name, reg.definition.version), ()))}
                for name in self.catalog.names() for reg in self.catalog.versions(name)]

    def _load_workers(self) -> list[WorkerInfo]:
        out = []
        for _, raw in self.storage.scan(store.WORKERS):
            if isinstance(raw, dict):
                keys = frozenset((k[0], k[1], k[2]) for k in raw["keys"])
                out.append(WorkerInfo(raw["worker_id"], raw["name"], keys))
        return out

    def workers(self) -> list[dict[str, Any]]:
        """GET /v1/api/workers: registered workers and the leases they hold."""
        held: dict[str, list[dict[str, Any]]] = {}
        for lease_id, rec in list(self.live_leases.items()):
            if not self.lease_actor_alive(lease_id):
                del self.live_leases[lease_id]  # killed with its supervisor: no on_stop ran
                continue
            if rec.status.live:
                held.setdefault(rec.worker_id, []).append(
                    {"lease_id": rec.lease_id, "run_id": rec.run_id, "step_id": rec.step_id,
                     "item_index": rec.item_index, "status": rec.status.value,
                     "attempt": rec.attempt, "fence": rec.fence})
        out = []
        for _, raw in self.storage.scan(store.WORKERS):
            if isinstance(raw, dict):
                out.append({
                    "worker_id": raw["worker_id"], "name": raw["name"], "build_id": raw.get("build_id"),
                    "protocol_version": raw.get("protocol_version"),
                    "concurrency": raw.get("concurrency"),
                    "registered_at": raw.get("registered_at"),
                    "connected": raw["worker_id"] in self._cancel_listeners,
                    "last_heartbeat_at": self.worker_seen.get(raw["worker_id"]),
                    "leases": held.get(raw["worker_id"], []),
                })
        return out

    # ------------------------------------------------------------------ runs

    async def start_run(
        self,
        workflow: str,
        input: Any = None,
        *,
        version: str | None = None,
        correlation: Any = None,
        idempotency_key: str | None = None,
        deadline_ms: int | None = None,
        in_txn: store.InTxn | None = None,
    ) -> tuple[str, bool]:
        """Start a run, or return the run an idempotency key already started.

        `in_txn(txn, run_id, created)`, when given, is written in the start's own
        transaction (the transport's audit entry: it exists if and only if the
        start does). It is not called when the key's run is found without a
        write (the caller writes its entry itself then) or on a refusal.

        Returns:
            (run id, created): created is False when `idempotency_key` was used before.

        Raises:
            Invalid: a field is malformed (naming it).
            Unprocessable: no registered workflow of that name (and version).
        """
        if not isinstance(workflow, str) or not workflow:
            raise Invalid("must be a non-empty string", field="workflow")
        if version is not None and not isinstance(version, str):
            raise Invalid("must be a string", field="version")
        if idempotency_key is not None and (
            not isinstance(idempotency_key, str) or not idempotency_key
            or len(idempotency_key.encode()) > 400
        ):
            raise Invalid("must be a non-empty string of at most 400 bytes", field="idempotency_key")
        if self.closing:
            raise Unavailable("the daemon is shutting down")
        if idempotency_key is not None:
            taken = self.storage.get(store.DISPATCH_KEYS, idempotency_key)
            if isinstance(taken, dict):
                return str(taken["run_id"]), False
        definition = self.catalog.resolve(workflow, version)
        if definition is None:
            what = f"workflow {workflow!r}" + (f" version {version!r}" if version else "")
            raise Unprocessable(f"{what} is not registered")
        now = self.clock.time_ms()
        run_id = ids.run_id(now)
        machine, tr = RunMachine.start(
            run_id=run_id, definition=definition, input=input, now_ms=now,
            correlation=correlation, idempotency_key=idempotency_key, deadline_ms=deadline_ms,
            resolve=self.catalog.resolve, max_depth=self.config.max_child_depth,
        )
        w = store.RunWrite(
            run_id=run_id, record=machine.record.to_dict(), journal=tr.journal,
            due_new=machine.next_deadline(), active_new=not machine.idle(), create=True,
            dispatch_key=idempotency_key,
            children=[cw for e in tr.effects if isinstance(e, StartChildren)
                      for cw in self.child_writes(e, now)],
            also=in_txn,
        )
        existing = await self.storage.write(store.apply_txn, w)
        if existing is not None:
            return existing, False
        self.counters["runs_started"] += 1
        for created in walk_writes([w]):
            self.status_moved(None, created.record["status"])
        if w.due_new is not None:
            self.timer_index_changed(w.due_new)
        try:
            await self._activate(run_id, (machine, tr))
        except ActorDead:
            # Committed, but a supervisor it needs is restarting: start it from
            # the record instead once that is back.
            await self.wake_run(run_id, None)
        for child in created_ids(w.children):
            await self.wake_run(child, None)
        return run_id, True

    def child_writes(self, effect: StartChildren, now: int) -> list[store.RunWrite]:
        """The records of the child runs a `start_workflows` step creates.

        Created unbegun (`RunRecord.begun`): each child's own actor enters its
        first step, in its own transaction. A child whose first step starts
        children of its own thus adds one level per transaction, never a
        recursion inside this one (a workflow starting itself once recursed
        until Python gave up, and the start answered 500).
        """
        writes = []
        for child in effect.children:
            machine, tr = RunMachine.start(
                run_id=child.run_id, definition=effect.definition, input=child.input, now_ms=now,
                correlation=effect.correlation,
                parent={"run_id": effect.parent_run_id, "step_id": effect.step_id},
                resolve=self.catalog.resolve, depth=effect.depth, begin=False,
                max_depth=self.config.max_child_depth,
            )
            writes.append(store.RunWrite(
                run_id=child.run_id, record=machine.record.to_dict(), journal=tr.journal,
                due_new=machine.next_deadline(), active_new=not machine.idle(), create=True,
            ))
            self.counters["runs_started"] += 1
        return writes

    def _record(self, run_id: str) -> dict[str, Any]:
        raw = self.storage.read(store.load_run_txn, run_id)
        if raw is None:
            raise NotFound(f"run {run_id!r} not found")
        return raw

    def _machine(self, raw: dict[str, Any]) -> RunMachine:
        record = RunRecord.from_dict(raw)
        definition = self.catalog.by_hash(record.definition_hash)
        if definition is None:
            raise NotFound(f"definition {record.definition_hash} of run {record.run_id} not found")
        return RunMachine(record, definition, self.catalog.resolve,
                          max_depth=self.config.max_child_depth)

    def status(self, run_id: str) -> dict[str, Any]:
        """The run status (WORKFLOWS.md "Run status"), as last committed.

        Raises:
            NotFound: no such run.
        """
        return self._machine(self._record(run_id)).status_view()

    def journal(self, run_id: str, *, after_seq: int = 0, limit: int | None = None) -> list[dict[str, Any]]:
        self._record(run_id)
        return [dict(v) for _, v in self.storage.journal(run_id, after_seq=after_seq, limit=limit)]  # type: ignore[call-overload]

    def export(self, run_id: str) -> dict[str, Any]:
        """Definition, version, hash, idempotency key, budget, state, journal and spans."""
        raw = self._record(run_id)
        m = self._machine(raw)
        journal = self.journal(run_id)
        view = m.status_view()
        spans = [
            {"step_id": e.get("step_id"), "item_index": e.get("item_index"),
             "lease_id": e.get("lease_id"), **span}
            for e in journal if e["type"] == "step_completed" for span in e.get("spans") or ()
        ]
        return {
            "run_id": run_id,
            "workflow": view["workflow"],
            "definition": m.definition.to_json(),
            "definition_version": view["definition_version"],
            "definition_hash": view["definition_hash"],
            "idempotency_key": view["idempotency_key"],
            "budget": view["budget"],
            "usage": view["usage"],
            "status": view,
            "state": view["state"],
            "journal": journal,
            "spans": spans,
        }

    def list_runs(self, query: listing.Query | None = None, /,
                  **filters: Any) -> tuple[list[dict[str, Any]], str | None]:
        """A page of run summaries (newest first by default) and the next page's cursor.

        Costs O(limit): an index leads to the runs, and only their small
        summaries are decoded (`listing`). Pass a `listing.Query`, or its fields
        as keywords (``workflow=``, ``status=``, ``limit=``...).

        Raises:
            Invalid: the limit is out of range, or the cursor is not one of this query's.
        """
        if query is None:
            query = listing.Query(**filters)
        limit = query.limit
        if not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= 1000:
            raise Invalid("must be an integer from 1 to 1000", field="limit")
        page, cursor = self.storage.read(listing.list_txn, query)
        return [{
            "run_id": s["run_id"], "workflow": s["workflow"], "status": s["status"],
            "definition_version": s["version"], "definition_hash": s["hash"],
            "idempotency_key": s["idempotency_key"], "created_at": s["created_at"],
            "updated_at": s["updated_at"], "parent_run_id": s["parent_run_id"],
        } for s in page], cursor

    async def result(self, run_id: str, *, wait_ms: int = 0) -> dict[str, Any]:
        """Wait until the run is terminal (at most `wait_ms`), then return its status."""
        view = self.status(run_id)
        if view["status"] in ("completed", "failed", "cancelled", "timed_out") or wait_ms <= 0:
            return view
        event = self._result_waiters.get(run_id)
        if event is None:
            event = self._result_waiters[run_id] = anyio.Event()
        with anyio.move_on_after(min(wait_ms, self.config.max_request_ms) / 1000):
            await event.wait()
        return self.status(run_id)

    async def signal(self, run_id: str, name: str, payload: Any = None, *,
                     in_txn: store.InTxn | None = None) -> None:
        """Send a signal. Raises SignalRefused (409 budget_exceeded), RunTerminal, NotFound, Invalid.

        `in_txn(txn, run_id, False)` is written in the signal's transaction (see
        `start_run`); a refused signal writes nothing, so it is not called.
        """
        if not isinstance(name, str) or not name:
            raise Invalid("must be a non-empty string", field="name")
        self._record(run_id)
        await self.ask_run(run_id, Signal(name, payload, in_txn))

    async def cancel(self, run_id: str, message: str = "cancelled", *,
                     in_txn: store.InTxn | None = None) -> None:
        """Cancel a run. Raises RunTerminal (already over), NotFound.

        `in_txn(txn, run_id, False)` is written in the cancel's transaction.
        """
        self._record(run_id)
        await self.ask_run(run_id, CancelRun(message, in_txn))

    # ------------------------------------------------------------------ worker calls

    async def claim(
        self, worker_id: str, *, max: int = 1, wait_ms: int = 0, run_id: str | None = None
    ) -> list[dict[str, Any]]:
        """PROTOCOL.md `claim`: up to `max` leases, waiting at most min(wait_ms, hold).

        Raises:
            NotFound: an unknown worker id.
            Invalid: `max` or `wait_ms` out of range.
        """
        if isinstance(max, bool) or not isinstance(max, int) or not 1 <= max <= 1000:
            raise Invalid("must be an integer from 1 to 1000", field="max")
        if isinstance(wait_ms, bool) or not isinstance(wait_ms, int) or wait_ms < 0:
            raise Invalid("must be an integer >= 0", field="wait_ms")
        info = self.storage.get(store.WORKERS, worker_id)
        if not isinstance(info, dict):
            raise NotFound(f"worker {worker_id!r} is not registered")
        if self.closing:
            return []
        self._claiming[worker_id] = self._claiming.get(worker_id, 0) + 1
        self.touch_worker(worker_id)
        try:
            return await self._claim(worker_id, info, max, wait_ms, run_id)
        finally:
            left = self._claiming[worker_id] - 1
            if left:
                self._claiming[worker_id] = left
            else:
                del self._claiming[worker_id]
            self.touch_worker(worker_id)

    async def _claim(self, worker_id: str, info: dict[str, Any], max: int, wait_ms: int,
                     run_id: str | None) -> list[dict[str, Any]]:
        hold_s = min(wait_ms, self.config.claim_hold_ms) / 1000
        deadline = anyio.current_time() + hold_s
        while True:
            remaining = deadline - anyio.current_time()
            waiter = Waiter(worker_id, max, run_id) if remaining > 0 else None
            specs: list[AttemptSpec] = []
            try:
                try:
                    got = await self._registry().ask(Claim(worker_id, max, run_id, waiter))
                except ActorDead:
                    # The registry is restarting (it reloads workers; runs re-announce).
                    if waiter is not None:
                        waiter.cancelled = True
                    if anyio.current_time() >= deadline:
                        return []
                    await anyio.sleep(0.005)
                    continue
                if isinstance(got, Waiter):
                    with anyio.move_on_after(remaining):
                        await got.event.wait()
                    got.cancelled = True  # the registry fills it no more
                    specs = list(got.specs)
                    if not specs:
                        self._tell_registry(CancelWait(got))
                else:
                    specs = list(got)
            finally:
                if waiter is not None and not waiter.cancelled:
                    # Left before taking the answer (cancelled, or the registry
                    # died): slots it was given go back to the queue.
                    waiter.cancelled = True
                    if waiter.specs:
                        self.announce(tuple(waiter.specs), front=True)
                    else:
                        self._tell_registry(CancelWait(waiter))
            leases = await self._offer_all(specs, info)
            if leases or anyio.current_time() >= deadline:
                return leases

    async def _offer_all(self, specs: list[AttemptSpec], info: dict[str, Any]) -> list[dict[str, Any]]:
        leases: list[dict[str, Any]] = []
        done = 0
        try:
            for spec in specs:
                try:
                    lease = await self.ask_run(
                        spec.run_id, Offer(spec, info["worker_id"], info["name"]), quiet=True
                    )
                except Unavailable:
                    lease = None  # the run re-announces its slot when its actor is back
                done += 1
                if lease is not None:
                    leases.append(lease)
        finally:
            if done < len(specs):
                # The claimant went away before these were offered: queue them again.
                self.announce(tuple(specs[done:]), front=True)
        return leases

    async def lease_call(self, lease_id: str, op: Op, body: dict[str, Any] | None = None, *,
                         caller: str | None = None) -> dict[str, Any]:
        """A worker call on a lease: started, heartbeat, complete or fail.

        `caller` is the worker registered on the connection the call came in
        on, when the transport knows it: a lease another worker holds is then
        answered as unknown (404), never applied, and its existence not revealed.

        Returns the answer body. Raises one of the four Conflicts (409),
        NotFound (404, unknown lease) or Invalid (400).
        """
        if op is Op.COMPLETE:
            body = dict(body or {})
            usage, spans = step_usage(body.get("usage"), body.get("spans"), self.config.prices)
            body["usage"], body["spans"] = usage, spans
        token = next(_CALL_TOKENS)
        sent = False  # an incarnation took the call, then died before answering
        for attempt in range(RETRIES):
            try:
                ref = self.system.resolve(f"/leases/{lease_id}")
                if ref.alive:
                    sent = True
                    return dict(await ref.ask(LeaseCall(op, body, caller, token)))
            except (ActorNotFound, ActorDead):
                pass
            # No live actor: judge from the durable record.
            pair = self.storage.read(store.lease_and_run_txn, lease_id)
            if pair is None:
                if attempt == 0:
                    # An offer is written behind: a lease handed out a moment ago
                    # whose actor is restarting may not be on record yet. Wait for
                    # the writes before this call, then look again, rather than
                    # send its worker a 404 that makes it drop the lease.
                    await self.storage.write(store.barrier_txn)
                    continue
                raise NotFound(f"lease {lease_id!r} not found")
            if caller is not None and pair[0].get("worker_id") != caller:
                raise NotFound(f"lease {lease_id!r} not found")
            reason = store.durable_reason(pair[0], pair[1], op)
            if reason is not None:
                if sent and _own_outcome(pair[0], op, token):
                    return {}  # our first delivery landed; its answer died with the actor
                raise CONFLICTS[reason](f"lease {lease_id}: {reason}")
            # Live on record but no actor: it is being restarted, or its end is
            # being written. Either way the answer is moments away.
            await anyio.sleep(0.001 * (attempt + 1))
        raise Unavailable(f"lease {lease_id} is being recovered; retry")

    def push_session(self, worker_id: str) -> PushSession:
        """A push channel for one connected worker (the WebSocket transport).

        Raises:
            NotFound: an unknown worker id.
        """
        info = self.storage.get(store.WORKERS, worker_id)
        if not isinstance(info, dict):
            raise NotFound(f"worker {worker_id!r} is not registered")
        session = PushSession(self, worker_id, info["name"])
        self._sessions.add(session)
        self.touch_worker(worker_id)
        return session

    def touch_worker(self, worker_id: str) -> None:
        """The worker did something: its expiry window starts again."""
        self.worker_active[worker_id] = self.clock.time_ms()

    def connected_workers(self) -> set[str]:
        """Workers with a push session (WebSocket, in process) or a claim in flight."""
        out = set(self._claiming) | set(self._cancel_listeners)
        out.update(s.worker_id for s in self._sessions if not s.closed)
        return out

    async def expire_workers(self) -> list[str]:
        """Forget the workers idle past `worker_expiry_ms`: no connection, no claim in
        flight, no live lease. Their journal entries keep their ids; one that comes
        back registers anew (the SDK does, on the 404 its old id gets).

        Returns:
            The ids forgotten.
        """
        ttl = self.config.worker_expiry_ms
        if ttl <= 0:
            return []
        cutoff = self.clock.time_ms() - ttl
        busy = self.connected_workers()
        busy.update(rec.worker_id for rec in list(self.live_leases.values()) if rec.status.live)
        idle = [wid for wid, at in self.worker_active.items() if at < cutoff and wid not in busy]
        if not idle:
            return []
        # Each as seen now: one that registers again before the delete commits has
        # a new `registered_at`, and is kept.
        seen = {wid: (raw.get("registered_at") if isinstance(raw, dict) else None)
                for wid in idle for raw in (self.storage.get(store.WORKERS, wid),)}

        def forget_txn(t: Any) -> list[str]:
            out = []
            for wid, registered_at in seen.items():
                raw = t.get(store.WORKERS, wid)
                if isinstance(raw, dict) and raw.get("registered_at") == registered_at:
                    t.delete(store.WORKERS, wid)
                    out.append(wid)
            return out

        gone = await self.storage.write(forget_txn)
        for wid in idle:
            if self.worker_active.get(wid, cutoff) < cutoff:  # not back meanwhile
                self.worker_active.pop(wid, None)
                self.worker_seen.pop(wid, None)
        self._tell_registry(ForgetWorkers(tuple(idle)))
        if gone:
            log.info("forgot %d idle worker(s) (no connection, claim or lease for %d ms): %s",
                     len(gone), ttl, ", ".join(gone[:10]) + (" ..." if len(gone) > 10 else ""))
        return gone

    def resubscribe_sessions(self) -> None:
        """After a registry restart: park every push session's remaining credit again."""
        for session in list(self._sessions):
            session.resubscribe()

    def release(self, lease_id: str) -> None:
        """Give back a lease that never reached its worker (a dead connection, a lost
        claim answer): if it has not started, its slot is queued again at once, same
        attempt, instead of waiting out the TTL. A started lease is left alone."""
        try:
            self.system.resolve(f"/leases/{lease_id}").tell_nowait(ReleaseLease())
        except (ActorDead, ActorNotFound, anyio.WouldBlock):
            pass  # gone already, or busy: the TTL still recovers it

    def on_cancel(self, worker_id: str, listener: Callable[[str, str], None] | None) -> None:
        """Register how to tell a worker that one of its leases ended (WebSocket `cancel`)."""
        if listener is None:
            self._cancel_listeners.pop(worker_id, None)
        else:
            self._cancel_listeners[worker_id] = listener

    # ------------------------------------------------------------------ actors

    def actors(self) -> dict[str, Any]:
        return self.system.tree().to_dict()

    async def kill(self, path: str) -> list[str]:
        """Kill one actor (fault injection); its supervisor restarts it from storage.

        Returns:
            The paths its supervisor restarts because of this kill, the killed
            actor first: under the root's `rest_for_one`, killing ``/registry``
            restarts every later sibling with it.

        Raises:
            NotFound: no actor at that path (the message says why when it can:
                a passivated run has no actor until something wakes it).
            Invalid: the path is the root.
        """
        if not isinstance(path, str) or not path.startswith("/"):
            raise Invalid("must be an actor path such as /runs/r_...", field="path")
        restarted = self._restarted_with(path)
        try:
            await self.system.kill(path)
        except ActorNotFound as exc:
            raise NotFound(self._no_actor(path)) from exc
        except ActorDead as exc:
            raise NotFound(f"no actor is running at {path!r} (it is being restarted)") from exc
        except ValueError as exc:
            raise Invalid(str(exc), field="path") from exc
        return restarted

    def _restarted_with(self, path: str) -> list[str]:
        """What the kill of `path` restarts, by its supervisor's strategy (static siblings)."""
        parent, _, name = path.rpartition("/")
        try:
            sup = self.system.supervisor(parent or "/")._supervisor()
        except (ActorNotFound, ActorDead, TypeError):
            return [path]
        ids = [cid for cid, _ in sup.which_children()]
        if name not in ids or sup.strategy is Strategy.ONE_FOR_ONE:
            return [path]
        prefix = parent if parent else ""
        group = ids if sup.strategy is Strategy.ONE_FOR_ALL else ids[ids.index(name):]
        return [path] + [f"{prefix}/{cid}" for cid in group if cid != name]

    def _no_actor(self, path: str) -> str:
        """Why nothing answers at `path`, in words an operator can act on."""
        kind, _, ident = path.strip("/").partition("/")
        if kind == "runs" and ident and "/" not in ident:
            raw = self.storage.get(store.RUNS, ident)
            if isinstance(raw, dict):
                status = raw.get("status")
                if status in ("completed", "failed", "cancelled", "timed_out"):
                    return f"no actor at {path!r}: run {ident} is {status}; it has no actor"
                return (f"no actor at {path!r}: run {ident} is {status} and passivated (asleep, "
                        "no actor in memory); its timer, a signal or a child starts it again, "
                        "and then it can be killed")
            return f"no actor at {path!r}: there is no run {ident!r}"
        if kind == "leases" and ident and "/" not in ident:
            raw = self.storage.get(store.LEASES, ident)
            if isinstance(raw, dict):
                return (f"no actor at {path!r}: lease {ident} is {raw.get('status')}; only a live "
                        "lease has an actor")
            return f"no actor at {path!r}: there is no lease {ident!r}"
        return f"no actor at {path!r}"

    async def registry_stats(self) -> Stats:
        try:
            return await self._registry().ask(RegistryStats())  # type: ignore[no-any-return]
        except ActorDead as exc:
            raise Unavailable("the registry is restarting") from exc

    # ------------------------------------------------------------------ plumbing for actors

    def new_lease_id(self) -> str:
        return ids.lease_id(self.clock.time_ms())

    def _registry(self) -> Any:
        return self.system.resolve("/registry")

    def announce(self, specs: tuple[AttemptSpec, ...], *, front: bool = False) -> None:
        if not specs:
            return
        message: Any = ReturnSpecs(specs) if front else Announce(specs)
        try:
            self._registry().tell_nowait(message)
        except (ActorDead, ActorNotFound, anyio.WouldBlock):
            pass  # the registry is restarting: recovery re-announces every queued slot

    def _tell_registry(self, message: Any) -> None:
        try:
            self._registry().tell_nowait(message)
        except (ActorDead, ActorNotFound, anyio.WouldBlock):
            pass  # a restarted registry starts with no parked claims

    def withdraw(self, run_id: str, slots: tuple[tuple[str, int | None], ...] | None) -> None:
        try:
            self._registry().tell_nowait(WithdrawSlots(run_id, slots))
        except (ActorDead, ActorNotFound, anyio.WouldBlock):
            pass  # a withdrawn slot that is offered anyway fails its offer

    def end_lease(self, lease_id: str, reason: str) -> None:
        try:
            self.system.resolve(f"/leases/{lease_id}").tell_nowait(EndLease(reason))
        except (ActorDead, ActorNotFound, anyio.WouldBlock):
            pass  # its record says so already; a restarted lease actor reads it

    def lease_actor_alive(self, lease_id: str) -> bool:
        try:
            return bool(self.system.resolve(f"/leases/{lease_id}").alive)
        except ActorNotFound:
            return False

    async def start_lease_actor(self, record: LeaseRecord, workflow: str, *, fresh: bool = True) -> None:
        """Start the actor of a lease: `fresh` for a new offer, else rebuilt from storage."""
        first = [True]

        def start() -> LeaseActor:
            restarted = not first[0]
            first[0] = False
            return LeaseActor(self, record, restarted=restarted, fresh=fresh)

        try:
            # A new lease's actor is handed its record: its on_start loads
            # nothing, so nobody waits for the startup handshake.
            self.system.supervisor("/leases").start_child_nowait(
                ChildSpec(record.lease_id, start, restart=Restart.TRANSIENT)
            )
        except ChildExists:
            pass
        except (ActorDead, ActorNotFound):
            # /leases is restarting (a /leases or /registry kill): recovery runs
            # after it comes back and resyncs every active run, which starts the
            # actors of their live leases. Crashing the run here instead made it
            # fail its restarts in a tight loop until /runs escalated.
            pass

    def push_cancel(self, record: LeaseRecord, reason: str) -> None:
        listener = self._cancel_listeners.get(record.worker_id)
        if listener is not None:
            listener(record.lease_id, reason)

    def metrics_offered(self, spec: AttemptSpec, now: int) -> None:
        self.counters["leases_offered"] += 1

    def status_moved(self, old: str | None, new: str) -> None:
        counts = self.status_counts
        if old is not None:
            counts[old] = counts.get(old, 1) - 1
        counts[new] = counts.get(new, 0) + 1

    def sample_schedule_to_start(self, seconds: float) -> None:
        self.schedule_to_start.append(seconds)
        if len(self.schedule_to_start) > 10_000:
            del self.schedule_to_start[:5_000]

    def run_ended(self, run_id: str, status: str, created_at: int) -> None:
        self.counters["runs_ended"] += 1
        self.run_to_complete.append((self.clock.time_ms() - created_at) / 1000)
        if len(self.run_to_complete) > 10_000:
            del self.run_to_complete[:5_000]
        event = self._result_waiters.pop(run_id, None)
        if event is not None:
            event.set()

    def timer_index_changed(self, due_ms: int) -> None:
        """Let the timer actor know a run's index entry at `due_ms` is on record.

        Only once it is committed: a sweep between this call and the commit
        would not see the entry and would sleep past it (CI lost a run's
        100 ms sleep that way). The due time goes into a hint, not into a
        message, so nothing is lost when the mailbox is full or the actor is
        restarting: at most one poke is queued, and the actor takes the hint
        on every message it handles (and rescans the table when it starts).
        """
        hint = self._timer_hint
        if hint is None or due_ms < hint:
            self._timer_hint = due_ms
        if self._timer_poked:
            return
        try:
            self.system.resolve("/timers").tell_nowait(TimerIndexChanged())
            self._timer_poked = True
        except (ActorDead, ActorNotFound, anyio.WouldBlock):
            pass  # full: it is busy and takes the hint soon; dead: it rescans

    def take_timer_hint(self) -> int | None:
        """The timer actor's side of `timer_index_changed`."""
        hint, self._timer_hint = self._timer_hint, None
        self._timer_poked = False
        return hint

    async def _activate(
        self,
        run_id: str,
        initial: tuple[RunMachine, Transition] | None,
        *,
        expect_message: bool = False,
    ) -> Any:
        """Start the run's actor if it is not running; return its ref."""
        path = f"/runs/{run_id}"
        ref = self.system.find(path)
        if ref is not None and ref.alive:
            return ref
        holder = [initial]
        first = [True]

        def start() -> RunActor:
            restarted = not first[0]
            first[0] = False
            init, holder[0] = holder[0], None
            return RunActor(self, run_id, init, restarted=restarted,
                            expect_message=expect_message and not restarted)

        try:
            return await self.system.supervisor("/runs").start_child(
                ChildSpec(run_id, start, restart=Restart.TRANSIENT)
            )
        except ChildExists:
            return self.system.resolve(path)
        except StartFailed as exc:
            if isinstance(exc.__cause__, LookupError):
                raise NotFound(f"run {run_id!r} not found") from exc
            if isinstance(exc.__cause__, ActorDead):
                # It needed a sibling that is restarting (the leases supervisor,
                # for its live leases): the callers' retry loops wait for it.
                raise ActorDead(path, exc.__cause__) from exc
            raise

    def active_runs(self) -> int:
        """How many run actors are alive (passivated runs have none)."""
        try:
            return self.system.supervisor("/runs").count_children()
        except (ActorNotFound, ActorDead):
            return 0

    def supervisors_alive(self) -> bool:
        try:
            return bool(self.system.resolve("/runs").alive and self.system.resolve("/leases").alive)
        except ActorNotFound:
            return False

    async def wake_run(self, run_id: str, message: Any, *, retries: int = RETRIES) -> None:
        """Make sure the run has an actor; then tell it `message` (if any)."""
        for attempt in range(retries):
            try:
                ref = await self._activate(run_id, None, expect_message=message is not None)
                if message is None:
                    return
                # No event loop turn when there is room (`tell` takes one on
                # every call): the callers are lease actors and other runs,
                # never the run itself, so no actor loop can spin on this.
                try:
                    ref.tell_nowait(message)
                except anyio.WouldBlock:
                    await ref.tell(message)
                return
            except ActorDead:  # the run actor, or the runs supervisor, is restarting
                await anyio.sleep(0.001 * attempt)
        raise Unavailable(f"run {run_id} did not come up to take {type(message).__name__}")

    tell_run = wake_run

    async def ask_run(self, run_id: str, message: Any, *, quiet: bool = False) -> Any:
        """Ask the run's actor (starting it if passivated), retrying across restarts."""
        for attempt in range(RETRIES):
            try:
                ref = await self._activate(run_id, None, expect_message=True)
                return await ref.ask(message)
            except ActorDead:  # the run actor, or the runs supervisor, is restarting
                await anyio.sleep(0.001 * attempt)
            except Fenced:
                if quiet:
                    return None
                raise
        raise Unavailable(f"run {run_id} did not come up to take {type(message).__name__}")


class PushSession:
    """Leases pushed to one worker connection as fast as work appears, within its credit.

    The worker grants credit (`add_credit`); the registry hands this session one
    runnable slot per credit the moment it appears; `leases()` turns each slot
    into a lease through its run actor and yields it. A slot whose offer fails
    (the run moved on) gives its credit back. `close()` returns unoffered slots
    to the queue.
    """

    def __init__(self, engine: Engine, worker_id: str, name: str) -> None:
        self.engine = engine
        self.worker_id = worker_id
        self.name = name
        # Slots the registry hands over, for `leases()`: a Mailbox, not an
        # anyio memory stream (whose every receive costs an event loop turn,
        # once per step). Unbounded in effect: the credit bounds it.
        self._slots: Mailbox[AttemptSpec] = Mailbox(sys.maxsize)
        self.waiter = Waiter(worker_id, 0, None, deliver=self._deliver)
        self.closed = False

    def _deliver(self, spec: AttemptSpec) -> None:
        self._slots.send_nowait(spec)

    async def add_credit(self, n: int) -> None:
        """Grant `n` more leases (the WebSocket `credit` frame).

        Raises:
            Invalid: `n` is not an integer from 1 to 10000.
        """
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 10_000:
            raise Invalid("must be an integer from 1 to 10000", field="n")
        if self.closed or self.engine.closing:
            return
        self.waiter.credit += n
        # A restarting registry gets every session's credit back from recovery.
        self.engine._tell_registry(Claim(self.worker_id, n, None, self.waiter))

    def resubscribe(self) -> None:
        if not self.closed and self.waiter.credit > 0:
            self.engine._tell_registry(Claim(self.worker_id, self.waiter.credit, None, self.waiter))

    async def leases(self) -> AsyncGenerator[dict[str, Any], None]:
        """Yield leases as they are offered to this worker, until `close()`."""
        slots = self._slots
        while True:
            try:
                spec = await slots.receive()  # no loop turn when a slot is there
            except anyio.EndOfStream:
                return
            try:
                lease = await self.engine.ask_run(
                    spec.run_id, Offer(spec, self.worker_id, self.name), quiet=True)
            except Unavailable:
                # Its run did not come up (a /runs kill under load): the run
                # re-announces the slot when it is back; this connection goes on.
                lease = None
            if lease is None:
                self.waiter.credit += 1  # stale slot: the credit is still the worker's
                self.resubscribe()
                continue
            yield lease

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.waiter.cancelled = True
        self.waiter.credit = 0
        self.engine._tell_registry(CancelWait(self.waiter))
        self.engine._sessions.discard(self)
        self.engine.touch_worker(self.worker_id)
        leftover: list[AttemptSpec] = []
        while True:
            try:
                leftover.append(self._slots.receive_nowait())
            except (anyio.WouldBlock, anyio.EndOfStream):
                break
        self._slots.close()  # leases() ends
        if leftover:
            self.engine.announce(tuple(leftover), front=True)


async def _index_old_runs(storage: Storage) -> None:
    """Give the runs of a data directory from before the listing's indexes their
    entries, a slice per transaction (once: afterwards every run has its summary)."""
    if storage.read(lambda t: t.count(store.RUNS) == t.count(store.RUN_SUMMARIES)):
        return
    after: bytes | None = None
    while True:
        after = await storage.write(listing.rebuild_txn, after, 1000)
        if after is None:
            return


_CALL_TOKENS = itertools.count(1)


def _own_outcome(lease_raw: dict[str, Any], op: Op, token: int) -> bool:
    """This very call (`token`) ended the lease as `op` ends it; not an earlier one."""
    final = {Op.COMPLETE: "completed", Op.FAIL: "failed"}.get(op)
    return (final is not None and lease_raw.get("status") == final
            and lease_raw.get("call") == token)


def created_ids(writes: list[store.RunWrite]) -> list[str]:
    out = []
    for w in writes:
        out.append(w.run_id)
        out.extend(created_ids(w.children))
    return out


def negotiate(version: Any) -> str:
    """The lower of the worker's protocol version and ours (AFFINITY.md).

    Raises:
        Invalid: not a "MAJOR.MINOR" string.
    """
    if not isinstance(version, str):
        raise Invalid('must be a "MAJOR.MINOR" string', field="protocol_version")
    try:
        major, minor = (int(p) for p in version.split("."))
    except ValueError:
        raise Invalid('must be a "MAJOR.MINOR" string', field="protocol_version") from None
    ours = tuple(int(p) for p in PROTOCOL_VERSION.split("."))
    if major < 1:
        raise Invalid("must be at least 1.0", field="protocol_version")
    mine = (major, minor)
    low = min(mine, ours)
    return f"{low[0]}.{low[1]}"


CAPABILITIES = ("local_steps", "sessions", "sticky")


def check_capabilities(negotiated: str, capabilities: Any, manifest: Any) -> None:
    """AFFINITY.md "Version negotiation and the capability manifest".

    Raises:
        Invalid: naming the field.
    """
    if not isinstance(capabilities, list) or not all(isinstance(c, str) for c in capabilities):
        raise Invalid("must be a list of strings", field="capabilities")
    major, minor = (int(p) for p in negotiated.split("."))
    if (major, minor) < (1, 18):
        if capabilities or manifest:
            raise Invalid("capability declarations need protocol version 1.18 or later",
                          field="capabilities" if capabilities else "manifest")
        return
    if manifest is None:
        if capabilities:
            raise Invalid("a capability needs a manifest marking it supported", field="manifest")
        return
    if not isinstance(manifest, dict):
        raise Invalid("must be an object", field="manifest")
    for cap in CAPABILITIES:
        entry = manifest.get(cap)
        if not isinstance(entry, dict) or entry.get("status") not in ("supported", "rejected"):
            raise Invalid('must declare {"status": "supported" | "rejected"}', field=f"manifest.{cap}")
    unknown = set(manifest) - set(CAPABILITIES)
    if unknown:
        raise Invalid(f"unknown capability {sorted(unknown)[0]!r}", field="manifest")
    for cap in capabilities:
        if cap not in CAPABILITIES:
            raise Invalid(f"unknown capability {cap!r}", field="capabilities")
        if manifest[cap]["status"] != "supported":
            raise Invalid(f"{cap!r} is not marked supported in the manifest", field="capabilities")

