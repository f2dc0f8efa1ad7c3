"""The daemon API, worker side: register, attach a push connection, claim, lease calls,
the workers list (see `api`)."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import anyio

from stepd.actors import (
    ActorDead,
    ActorNotFound,
    Waiter,
)
from stepd.sansio.definition import Definition, parse_definition
from stepd.sansio.errors import Invalid, NotFound, Unavailable
from stepd.sansio.lease import Op
from stepd.sansio.pricing import PriceBook, step_usage
from stepd.storage import Storage

from . import ids, peers, store, work_store
from ._api_base import ApiBase
from .catalog import register_txn
from .lease import COMPLETE_FIELDS, CONFLICTS
from .messages import (
    AbandonClaim,
    Attach,
    ClaimSlots,
    Detach,
    Grant,
    History,
    LeaseCall,
    RegisterWorker,
    ReleaseLease,
    Reregistered,
    SessionInfo,
)
from .registry import WorkerInfo
from .session import Outbox
from .sticky import settings_of
from .workers import PROTOCOL_VERSION, check_capabilities, negotiate

# The calls as module names: a lookup on an Enum class costs ~1,400
# instructions on 3.11 (stepd/sansio/lease.py says why); one a step here.
_OP_COMPLETE = Op.COMPLETE
_OP_FAIL = Op.FAIL

__all__ = ["Connection", "WorkerOps"]

_CALL_TOKENS = itertools.count(1)

_COMPLETE_FIELDS: dict[str, Any] = dict.fromkeys(COMPLETE_FIELDS)
"""A complete's body as the lease actor gets it: every field present, None when not sent
(`LeaseCall.body`), so it reads them by subscript (a complete a step, ~10 `get` calls)."""
_CLAIMS = itertools.count(1)
_CONNECTIONS = itertools.count(1)


class Connection:
    """A push connection attached to its worker's session (`Daemon.attach`).

    The transport grants credit through it and detaches it when the
    connection ends; the session delivers leases and cancels to the outbox.
    """

    __slots__ = ("_daemon", "conn", "outbox", "worker_id")

    def __init__(self, daemon: WorkerOps, worker_id: str, conn: int, outbox: Outbox) -> None:
        self._daemon = daemon
        self.worker_id = worker_id
        self.conn = conn
        self.outbox = outbox

    def grant(self, n: int) -> None:
        """Grant `n` more leases (the WebSocket ``credit`` frame).

        Raises:
            Invalid: `n` is not an integer from 1 to 10000.
        """
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 10_000:
            raise Invalid("must be an integer from 1 to 10000", field="n")
        # Handled right here when the session is idle (its Grant handler never
        # waits; the registry's Subscribe runs inline too): the credit is the
        # session's before the worker's next call, whose commit offers the
        # next step to it (`RunOffers`), rather than still in its mailbox.
        # Refused (the session's mailbox is full, or it is gone or restarting),
        # the credit would be dropped and leave the worker waiting for leases it
        # is owed: an idle worker grants nothing more by itself. Closed, it
        # reconnects, registers and grants its credit afresh (what a session
        # restart does); its leases stay its own.
        s = self._daemon.services
        if s.serving and not peers.tell_now(s, f"/sessions/{self.worker_id}",
                                            Grant(self.conn, n, self.outbox)):
            self.outbox.close("the worker's session could not take the credit: reconnect")

    def detach(self) -> None:
        """The connection ended: its undelivered slots and credit go back."""
        s = self._daemon.services
        if s.push_conns.get(self.worker_id) is self:
            del s.push_conns[self.worker_id]
        peers.tell(s, f"/sessions/{self.worker_id}", Detach(self.conn))



class WorkerOps(ApiBase):
    """`Daemon`'s worker operations."""

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
            NotFound: `worker_id` names no registered worker.
        """
        if not isinstance(definitions, list):
            raise Invalid("must be a list", field="definitions")
        parsed: list[Definition] = []
        for i, raw in enumerate(definitions):
            try:
                parsed.append(parse_definition(raw))
            except Invalid as exc:
                raise exc.with_location(field=f"definitions[{i}]") from None
        negotiated = negotiate(protocol_version, PROTOCOL_VERSION)
        check_capabilities(negotiated, capabilities or [], manifest)
        now = self.clock.time_ms()
        if worker_id is None:
            worker_id = ids.worker_id(now)
        elif not isinstance(worker_id, str) or not worker_id.startswith("w_") or len(worker_id) > 64:
            raise Invalid("must be a worker id returned by an earlier register", field="worker_id")
        elif self.storage.get(store.WORKERS, worker_id) is None:
            raise NotFound(f"worker {worker_id!r} is not registered: register without worker_id")
        name = name or f"worker-{worker_id[-6:].lower()}"
        keys = sorted({(d.name, d.version, step.body) for d in parsed for step in d.steps
                       if hasattr(step, "body")}, key=str)
        info: dict[str, Any] = {
            "worker_id": worker_id, "name": name, "build_id": build_id,
            "protocol_version": negotiated, "concurrency": concurrency,
            "keys": [list(k) for k in keys], "registered_at": now,
            "capabilities": capabilities or [],
            # Read by routing: worker sessions match its resources (AFFINITY.md).
            # The capability gate (stepd.sansio.capabilities) reads it back at each
            # completion that carries capability-specific data.
            "manifest": manifest,
        }
        sticky = settings_of(negotiated, capabilities or [], manifest)
        if sticky is not None:
            info["sticky"] = sticky

        def txn(t: Any) -> list[Any]:
            added = register_txn(t, parsed, now)
            t.put(store.WORKERS, worker_id, info)
            return added

        for reg in await self.storage.write(txn):
            self.catalog.add(reg)
        # A registry that is restarting reloads this worker from the table.
        peers.tell(self.services, "/registry", RegisterWorker(worker_id, name, frozenset(keys)))
        try:
            session = await peers.ensure_session(self.services, worker_id)
            await session.tell(Reregistered())  # a session already up rereads it
        except ActorDead:
            pass  # /sessions is restarting: recovery starts a session for every worker
        return {
            "worker_id": worker_id,
            "lease_ttl_ms": self.config.lease_ttl_ms,
            "heartbeat_ms": self.config.heartbeat_ms,
            "protocol_version": negotiated,
            "max_request_ms": self.config.max_request_ms,
            # complete/fail may carry `"started": true` (docs/leases.md "A folded started").
            "fold_started": True,
            # a complete may ask for the next lease in its answer (docs/leases.md
            # "The next lease in the answer").
            "claim_next": True,
            "definitions": [
                {"name": d.name, "version": d.version, "definition_hash": d.definition_hash}
                for d in parsed
            ],
        }

    async def attach(self, worker_id: str, outbox: Outbox) -> Connection:
        """A push connection registered as `worker_id`: its session delivers to `outbox`.

        Raises:
            NotFound: an unknown worker id.
            Unavailable: the sessions supervisor is restarting.
        """
        conn = Connection(self, worker_id, next(_CONNECTIONS), outbox)
        conns = self.services.push_conns

        def record() -> None:
            # After the session's start, before its Attach: a later start (a kill's
            # restart, or the sessions supervisor's) closes it (`Services.push_conns`).
            conns[worker_id] = conn

        await self._tell_session(worker_id, Attach(conn.conn, outbox), before=record)
        return conn

    async def claim(self, worker_id: str, *, max: int = 1, wait_ms: int = 0,
                    run_id: str | None = None) -> list[dict[str, Any]]:
        """PROTOCOL.md `claim`: up to `max` leases, waiting at most min(wait_ms, hold).

        Raises:
            NotFound: an unknown worker id (or run id).
            Invalid: `max` or `wait_ms` out of range.
        """
        if isinstance(max, bool) or not isinstance(max, int) or not 1 <= max <= 1000:
            raise Invalid("must be an integer from 1 to 1000", field="max")
        if isinstance(wait_ms, bool) or not isinstance(wait_ms, int) or wait_ms < 0:
            raise Invalid("must be an integer >= 0", field="wait_ms")
        if run_id is not None and self.storage.get(store.RUNS, run_id) is None:
            raise NotFound(f"run {run_id!r} not found")
        if self.storage.get(store.WORKERS, worker_id) is None:
            # Its session may still be alive for a moment after it forgot the worker.
            raise NotFound(f"worker {worker_id!r} is not registered")
        if not self.services.serving:
            # Draining for shutdown: nothing to hand out. Wait as a long-poll would (and at
            # least yield), so a client that claims in a loop does not spin the loop.
            await anyio.sleep(min(wait_ms, self.config.claim_hold_ms) / 1000)
            return []
        claim = next(_CLAIMS)
        got: list[list[dict[str, Any]]] = []
        done = Waiter()
        closed = False

        def reply(leases: list[dict[str, Any]]) -> None:
            if closed:
                # Answered after the claimant gave up: nobody will see these leases,
                # so they go back to the queue now rather than after their TTL.
                for lease in leases:
                    self.release(lease["lease_id"])
                return
            got.append(leases)
            done.set()

        hold_ms = min(wait_ms, self.config.claim_hold_ms)
        deadline = self.clock.time_ms() + hold_ms
        # A long-poll is handled right here when the session is idle (its ClaimSlots
        # handler never waits): queued, it made the session busy when the worker's
        # next `complete` arrived, and that complete's next lease (`claim_next`) went
        # to this claim instead of its answer, and so on, step after step. A claim
        # that does not wait (`wait_ms` 0) stays queued: handled inline, its deadline
        # (now) would answer it before the registry's hand-over of queued slots,
        # which its Subscribe starts, reached the session.
        await self._tell_session(worker_id, ClaimSlots(claim, max, run_id, deadline, reply),
                                 inline=hold_ms > 0)
        # The session answers the claim at its deadline; this bound is for a session
        # that died meanwhile (`Waiter.wait_at_most`: no cancel scope on asyncio, and
        # a first step over HTTP reaches its worker through a claim).
        try:
            await done.wait_at_most(hold_ms / 1000 + 0.05)
        except BaseException:
            closed = True  # cut short (cancelled): whatever it got goes back
            for leases in got:
                for lease in leases:
                    self.release(lease["lease_id"])
            peers.tell(self.services, f"/sessions/{worker_id}", AbandonClaim(claim))
            raise
        closed = True
        if not got:  # timed out: its leases, if any come later, are released by `reply`
            peers.tell(self.services, f"/sessions/{worker_id}", AbandonClaim(claim))
        return got[0] if got else []

    async def _tell_session(self, worker_id: str, message: Any,
                            before: Callable[[], None] | None = None,
                            inline: bool = False) -> None:
        """Tell the worker's session, starting it if need be; a session killed between
        finding it and telling it is started again (a few times, then Unavailable).
        `before` runs once the session is running, right before the tell. `inline`:
        handled in this call when the session is idle (`peers.tell_ref_now`: the
        message's handler must never wait)."""
        for attempt in range(3):
            try:
                session = await peers.ensure_session(self.services, worker_id)
                if before is not None:
                    before()
                if not (inline and peers.tell_ref_now(session, message)):
                    await session.tell(message)  # waits for room; ActorDead: retried
                return
            except ActorDead as exc:
                if attempt == 2:
                    raise Unavailable("the worker sessions are restarting; retry") from exc
                # Let its supervisor see the exit (the dead child still holds the name).
                await anyio.sleep(0.001 * (attempt + 1))

    async def lease_call(self, lease_id: str, op: Op, body: dict[str, Any] | None = None, *,
                         caller: str | None = None) -> dict[str, Any]:
        """A worker call on a lease: started, heartbeat, complete or fail.

        `caller` is the worker registered on the connection the call came in
        on, when the transport knows it: a lease another worker holds is then
        answered as unknown (404), never applied, and its existence not revealed.

        Returns the answer body. Raises one of the four Conflicts (409),
        NotFound (404, unknown lease) or Invalid (400).
        """
        if op is _OP_COMPLETE:
            body = {**_COMPLETE_FIELDS, **(body or {})}
            usage, spans = body["usage"], body["spans"]
            if usage is not None or spans:
                body["usage"], body["spans"] = step_usage(usage, spans, self.config.prices)
            else:  # nothing to price (most steps): what step_usage answers, without it
                body["usage"] = body["spans"] = None
            local = body["local_steps"]
            if local is not None and isinstance(local, list):
                # Each local body's usage and spans are priced as a complete's are
                # (docs/affinity.md "Local steps"), before anything is applied.
                body["local_steps"] = [_priced_local(r, i, self.config.prices)
                                       for i, r in enumerate(body["local_steps"])]
        token = next(_CALL_TOKENS)
        sent = False  # an incarnation took the call, then died before answering
        system = self.system
        for attempt in range(peers.RETRIES):
            ref = system.find(f"/leases/{lease_id}")
            if ref is not None and ref.alive:
                try:
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

    async def history(self, lease_id: str, *, caller: str | None = None) -> dict[str, Any]:
        """GET /v1/api/steps/{lease}/history: the run's full durable history and its cursor,
        for the worker holding this live lease (docs/affinity.md "Sticky execution").

        Raises:
            NotFound: an unknown lease (or one another worker holds, when `caller` is known).
            Fenced, RunTerminal, AlreadyApplied: the lease is no longer live (409).
        """
        pair = self.storage.read(store.lease_and_run_txn, lease_id)
        if pair is None:
            # The offer is written behind: a lease handed out a moment ago may not be
            # on record yet (as `lease_call`).
            await self.storage.write(store.barrier_txn)
            pair = self.storage.read(store.lease_and_run_txn, lease_id)
        if pair is None or (caller is not None and pair[0].get("worker_id") != caller):
            raise NotFound(f"lease {lease_id!r} not found")
        lease = pair[0]
        if lease.get("status") not in ("offered", "started"):
            reason = "already_applied" if lease.get("status") in ("completed", "failed") \
                else "fenced"
            raise CONFLICTS[reason](f"lease {lease_id}: {reason}")
        answer = await peers.ask_run(self.services, lease["run_id"], History(
            lease_id, lease["step_id"], lease.get("item_index"), lease["fence"]))
        return dict(answer)

    def release(self, lease_id: str) -> None:
        """Give back a lease that never reached its worker (a dead connection, a lost
        claim answer): if it has not started, its slot is queued again at once, same
        attempt, instead of waiting out the TTL. A started lease is left alone."""
        peers.tell(self.services, f"/leases/{lease_id}", ReleaseLease())

    async def workers(self) -> list[dict[str, Any]]:
        """GET /v1/api/workers: registered workers (connected first) and the leases they hold."""
        out = []
        for _, raw in self.storage.scan(store.WORKERS):
            if not isinstance(raw, dict):
                continue
            wid = raw["worker_id"]
            info: dict[str, Any] = {"connected": False, "held": [], "last_active": None}
            ref = self.system.find(f"/sessions/{wid}")
            if ref is not None and ref.alive:
                try:
                    info = await ref.ask(SessionInfo())
                except (ActorDead, ActorNotFound):
                    pass
            leases = []
            for held in info["held"]:
                # The offer is written behind: a lease handed out a moment ago may not
                # be on record yet, and is still offered then.
                rec = self.storage.get(store.LEASES, held["lease_id"])
                status = rec.get("status") if isinstance(rec, dict) else "offered"
                if status in ("offered", "started"):
                    leases.append({**held, "status": status})
            out.append({
                "worker_id": wid, "name": raw["name"], "build_id": raw.get("build_id"),
                "protocol_version": raw.get("protocol_version"),
                "concurrency": raw.get("concurrency"),
                "capabilities": raw.get("capabilities") or [],
                "manifest": raw.get("manifest"),
                "registered_at": raw.get("registered_at"),
                "connected": bool(info["connected"]),
                "last_heartbeat_at": info["last_active"],
                "leases": leases,
                "sticky": _sticky_view(raw.get("sticky"), info.get("sticky")),
                "sessions": _sessions_view(self.storage.read(work_store.held_txn, wid),
                                           self.clock.time_ms()),
            })
        out.sort(key=lambda w: (not w["connected"], -(w["last_heartbeat_at"] or 0)))
        return out

    def definitions(self) -> list[dict[str, Any]]:
        """GET /v1/api/definitions: every registered definition, by name, oldest version first."""
        held: dict[tuple[str, str | None], list[str]] = {}
        for info in _load_workers(self.storage):
            for name_version in {(k[0], k[1]) for k in info.keys}:
                held.setdefault(name_version, []).append(info.worker_id)
        return [{"name": name, "version": reg.definition.version,
                 "definition_hash": reg.definition.definition_hash,
                 "registered_at": reg.registered_at, "definition": reg.definition.to_json(),
                 "worker_ids": sorted(held.get((name, reg.definition.version), ()))}
                for name in self.catalog.names() for reg in self.catalog.versions(name)]


def _priced_local(record: Any, i: int, book: PriceBook) -> Any:
    """A local step's record with its usage and spans priced (left alone if it is not an
    object: the run machine's parser names that field)."""
    if not isinstance(record, dict) or (record.get("usage") is None and not record.get("spans")):
        return record
    usage, spans = step_usage(record.get("usage"), record.get("spans"), book,
                              where=f"local_steps[{i}].")
    return {**record, "usage": usage, "spans": spans}


def _sessions_view(records: list[dict[str, Any]], now: int) -> list[dict[str, Any]]:
    """The worker sessions a worker holds (docs/affinity.md "Worker sessions"): each one's
    id, run, name, generation, since when (epoch ms), its holder lease's end and the
    absolute TTL's."""
    return [{"session_id": r["session_id"], "run_id": r["run_id"], "name": r["name"],
             "status": r["status"], "generation": r["generation"],
             "since": r.get("held_since"), "lease_until": r["lease_until"],
             "expires_at": r["expires_at"],
             "ttl_remaining_ms": max(0, int(r["expires_at"]) - now)} for r in records]


def _sticky_view(settings: Any, counts: Any) -> dict[str, Any] | None:
    """A worker's sticky settings and cache counts (docs/affinity.md); None: not sticky."""
    if not isinstance(settings, dict):
        return None
    zero = {"hit": 0, "miss": 0, "eviction": 0, "forced_cold_replay": 0}
    return {**settings, **(counts if isinstance(counts, dict) else zero)}


def _own_outcome(lease_raw: dict[str, Any], op: Op, token: int) -> bool:
    """This very call (`token`) ended the lease as `op` ends it; not an earlier one."""
    final = {_OP_COMPLETE: "completed", _OP_FAIL: "failed"}.get(op)
    return (final is not None and lease_raw.get("status") == final
            and lease_raw.get("call") == token)


def _load_workers(storage: Storage) -> list[WorkerInfo]:
    out = []
    for _, raw in storage.scan(store.WORKERS):
        if isinstance(raw, dict):
            keys = frozenset((k[0], k[1], k[2]) for k in raw["keys"])
            out.append(WorkerInfo(raw["worker_id"], raw["name"], keys))
    return out
