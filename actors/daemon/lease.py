"""The lease actor: one live lease, its expiry timer, and its worker's calls.

It drives a `LeaseMachine` (expiry, orphaning, revival, recovery) and answers
what it can from memory with `reject_reason`; a call that changes the run is
handed to the run actor (`ApplyAttempt`), which persists it under the durable
guard and only then lets this actor answer. When the lease ends (its own
complete/fail, recovery, or the run ending it) the actor tells its worker's
session (`LeaseEnded`: the session pushes a ``cancel`` when the end came
early) and stops; later calls are judged from the durable record
(`api.Daemon.lease_call`).

After a daemon restart the lease is re-armed with a full TTL from now
(PROTOCOL.md "Expiry and recovery"; a restart must not mass-expire healthy
workers). After a kill of its actor it keeps its expiry: `Services.lease_touched`
remembers each live lease's last call (or its offer) across incarnations, so
killing it again and again cannot keep a dead worker's lease alive forever.

Lazy expiry: a fresh lease (just offered, first incarnation) arms no timer
of its own; it leaves its expiry to the timer actor's lease sweep
(`peers.defer_expiry`), asked for once by the first lease due and then
shared by every lease due no sooner. When the sweep comes (no later than this
lease's expiry), the lease hears `Due`, checks its expiry and arms its own
timer from then on. Most leases end long before their TTL, so a step arms
no timer at all (an armed timer was ~13 calls a step). A lease started any
other way (restarted, rebuilt) arms its own timer at once, and so does one
whose sweep cannot be asked for; a heartbeat or a `started` re-arms as before.
Every start of the timer actor sweeps, so no live lease is ever left with
neither an armed timer nor a sweep due by its expiry.

A lease actor is started and stopped on every attempt, so it makes nothing
per attempt that matters only after a crash: what a successor needs is one
entry in that per-process dict (set by the calls it records anyway), and a
successor knows it is one from its `restart_reason`.
"""

from __future__ import annotations

from typing import Any

from stepd.actors import Actor
from stepd.sansio.capabilities import GATED_FIELDS, WorkerCapabilities, check_completion
from stepd.sansio.errors import (
    AlreadyApplied,
    Conflict,
    Fenced,
    Invalid,
    NotFound,
    NotStarted,
    RunTerminal,
)
from stepd.sansio.events import (
    AttemptCompleted,
    AttemptFailed,
    AttemptLost,
    AttemptOrphaned,
    AttemptReleased,
    AttemptRevived,
    AttemptStarted,
)
from stepd.sansio.lease import (
    LeaseMachine,
    LeaseRecord,
    LeaseStatus,
    Op,
    Orphaned,
    Recover,
    Revived,
    reject_reason,
)
from stepd.sansio.local_steps import parse_records

from . import peers, store
from .messages import (
    ApplyAttempt,
    AttemptNote,
    Due,
    EndLease,
    LeaseCall,
    LeaseEnded,
    ReleaseLease,
    StickyReport,
)
from .services import Services
from .sticky import claim_of, sticky_identity

# The calls and statuses as module names: a lookup on an Enum class costs ~1,400
# instructions on 3.11 (stepd/sansio/lease.py says why); ~6 a step here.
_OP_STARTED = Op.STARTED
_OP_COMPLETE = Op.COMPLETE
_OP_HEARTBEAT = Op.HEARTBEAT
_OP_FAIL = Op.FAIL
_COMPLETED = LeaseStatus.COMPLETED
_FAILED = LeaseStatus.FAILED
_OFFERED = LeaseStatus.OFFERED
_FENCED = LeaseStatus.FENCED
_RUN_TERMINAL = LeaseStatus.RUN_TERMINAL

COMPLETE_FIELDS: tuple[str, ...] = (
    "output", "state_patch", "usage", "spans", "started", "claim_next", *GATED_FIELDS)
"""Every field a complete's body may hold: `LeaseCall.body` holds each of them (None when
not sent), so `LeaseActor._call` reads them by subscript."""

CONFLICTS: dict[str, type[Conflict]] = {
    "already_applied": AlreadyApplied,
    "fenced": Fenced,
    "run_terminal": RunTerminal,
    "not_started": NotStarted,
}


class LeaseActor(Actor):
    kind = "lease"
    reply_errors = (Conflict, Invalid, NotFound)
    #: Its handlers wait only for its run (an answer, an activation): a kill lands
    #: when that ends, and no cancel scope is paid on each attempt (docs/actors.md).
    deferred_kill = True
    #: `on_start` reads its record without waiting: a new lease's actor is
    #: running when the run's offer returns, with no dispatcher turn.
    sync_start = True

    def __init__(self, services: Services, record: LeaseRecord, *, fresh: bool = True) -> None:
        self.s = services
        self._initial = record
        self._fresh = fresh  # just offered: the TTL runs from the offer
        self.machine: LeaseMachine

    async def on_start(self) -> None:
        e = self.s
        record = self._initial
        lease_id = record.lease_id
        if self.restart_reason is not None:  # killed or crashed: the record may have moved
            raw = e.storage.get(store.LEASES, lease_id)
            if isinstance(raw, dict):
                record = LeaseRecord.from_dict(raw)
        # One whose actor was killed, or rebuilt after its supervisor restarted,
        # in this process keeps its expiry: counted from the last call seen (or
        # the offer), so killing it again and again cannot keep a dead worker's
        # lease alive forever. A lease just offered expires a TTL after the offer
        # (its actor may start a little later). One rebuilt after a daemon
        # restart gets a full TTL from now (nothing in memory says when its
        # worker last called).
        touched = e.lease_touched
        since = touched.get(lease_id)
        if since is None:
            since = record.offered_at if self._fresh else e.clock.time_ms()
            touched[lease_id] = since
        self.machine = LeaseMachine(
            record, ttl_ms=e.config.lease_ttl_ms, window_ms=e.config.recovery_window_ms,
            now=since,
        )
        if not record.status.live:
            touched.pop(lease_id, None)
            self.stop()
            return
        if self._fresh and self.restart_reason is None:
            expires = self.machine.expires_at
            if peers.defer_expiry(e, expires):  # lazy expiry: see the module docstring
                return
        self._arm()

    def _end(self, reason: str | None, *, told: bool = False) -> None:
        """The lease is over: its session hears it (a cancel if `reason`), then stop.

        `told`: the run told the session already, with this worker's next lease
        (`Offered.ended`, in the commit that ended this one).
        """
        rec = self.machine.record
        self.s.lease_touched.pop(rec.lease_id, None)
        if not told:
            # Handled right here when the session is idle (its handler never waits):
            # a lease ends on every step, and a dispatcher turn for this cost more.
            peers.tell_now(self.s, f"/sessions/{rec.worker_id}",
                           LeaseEnded(rec.lease_id, reason))
        self.stop()

    async def receive(self, message: Any) -> Any:
        if type(message) is LeaseCall:  # the one message of every attempt, first
            return await self._call(message)
        if isinstance(message, Due):
            await self._tick()
            return None
        if isinstance(message, ReleaseLease):
            rec = self.machine.record
            if rec.status is _OFFERED:
                now = self.s.clock.time_ms()
                self.machine.end(_FENCED, now)
                await peers.wake_run(self.s, rec.run_id, AttemptNote(
                    rec.lease_id, AttemptReleased(rec.step_id, rec.item_index, rec.fence),
                    rec.to_dict()))
                self._end(None)
            return None
        if isinstance(message, EndLease):
            if self.machine.status.live:
                status = _FENCED if message.reason == "fenced" else _RUN_TERMINAL
                self.machine.end(status, self.s.clock.time_ms())
                self._end(message.reason)
            else:
                self.s.lease_touched.pop(self.machine.record.lease_id, None)
                self.stop()
            return None
        raise TypeError(f"lease actor: unexpected message {message!r}")

    async def _call(self, call: LeaseCall) -> dict[str, Any]:
        m = self.machine
        rec = m.record
        op = call.op
        if call.caller is not None and call.caller != rec.worker_id:
            # Another worker's connection: as if the lease did not exist, so a
            # hostile worker can neither end it nor learn that it exists.
            raise NotFound(f"lease {rec.lease_id!r} not found")
        reason = reject_reason(rec, op, run_terminal=False, current_fence=None)
        if reason is not None:
            raise CONFLICTS[reason](f"lease {rec.lease_id}: {reason}")
        claim = None
        body = call.body
        complete = op is _OP_COMPLETE
        if complete:
            # A complete's body holds every field (`COMPLETE_FIELDS`): read by
            # subscript, and `gated` written out (a complete on every step).
            for name in GATED_FIELDS:
                if body[name] is not None:
                    claim = self._gate(rec, body)  # before anything is applied
                    break
        elif body is None:
            body = {}
        now = self.s.clock.time_ms()
        self.s.lease_touched[rec.lease_id] = now
        revived = False
        for action in m.touch(op, now):  # usually none: no generator per call
            if type(action) is Revived:
                revived = True
        if revived:
            await peers.wake_run(self.s, rec.run_id, AttemptNote(
                rec.lease_id, AttemptRevived(rec.step_id, rec.item_index, rec.fence)))
        if op is _OP_HEARTBEAT:
            self._arm()
            return {"lease_ttl_ms": m.ttl_ms}
        started = None
        if ((body["started"] if complete else body.get("started")) is True and not rec.started
                and rec.delivery == "at_least_once" and (complete or op is _OP_FAIL)):
            # The worker folded `started` into this call (its body ended inside
            # the heartbeat gap): apply it first, in the same handler and commit.
            m.touch(_OP_STARTED, now)
            started = AttemptStarted(rec.step_id, rec.item_index, rec.fence)
        if op is _OP_STARTED:
            event: Any = AttemptStarted(rec.step_id, rec.item_index, rec.fence)
            final = None
        elif complete:
            local = body["local_steps"]
            event = AttemptCompleted(rec.step_id, rec.item_index, rec.fence, body["output"],
                                     body["state_patch"], body["usage"], body["spans"],
                                     parse_records(local) if local else None, claim)
            final = _COMPLETED
        else:
            event = AttemptFailed(rec.step_id, rec.item_index, rec.fence, body["error_class"],
                                  body.get("message", ""))
            final = _FAILED
        stored = rec.to_dict()
        if final is not None:
            stored["status"] = final.text
            stored["ended_at"] = now
            stored["call"] = call.token
        elif rec.delivery == "at_least_once":
            # Nothing durable is acknowledged by an at_least_once `started`
            # (PROTOCOL.md asks that only of at_most_once): tell the run and
            # answer now. The run's mailbox keeps it ahead of this lease's
            # `complete`; if the run refuses it, that `complete` hears why.
            await peers.wake_run(self.s, rec.run_id,
                                 ApplyAttempt(rec.lease_id, op, stored, event))
            self._arm()
            return {}
        try:
            told = await peers.ask_run(self.s, rec.run_id, ApplyAttempt(
                rec.lease_id, op, stored, event, started,
                complete and body["claim_next"] is True))
        except (Fenced, RunTerminal) as exc:
            m.end(_FENCED if isinstance(exc, Fenced) else _RUN_TERMINAL, now)
            self._end(None)  # the worker hears it in this answer
            raise
        if final is not None:
            m.end(final, now)
            stats = body["sticky_stats"] if complete else None
            if stats is not None:
                peers.tell(self.s, f"/sessions/{rec.worker_id}", StickyReport(stats))
            if type(told) is tuple:  # the worker's next lease, for this call's answer
                told, lease = told
                self._end(None, told=told)
                return {"leases": [lease]}
            self._end(None, told=told is True)
        else:
            self._arm()
        return {}

    def _gate(self, rec: LeaseRecord, body: dict[str, Any]) -> Any:
        """A complete with a capability-specific field: checked against its worker's
        registration (`check_completion`); the sticky claim it makes, if any."""
        raw = self.s.storage.get(store.WORKERS, rec.worker_id)
        worker = WorkerCapabilities.from_record(raw if isinstance(raw, dict)
                                                else {"worker_id": rec.worker_id})
        cursor = body["sticky_cursor"]
        check_completion(worker, body, sticky_identity=None if cursor is None else
                         sticky_identity(self.s.storage, rec.run_id, worker.build_id))
        return None if cursor is None else claim_of(raw, cursor)

    async def _tick(self) -> None:
        m = self.machine
        rec = m.record
        for action in m.tick(self.s.clock.time_ms()):
            if isinstance(action, Orphaned):
                await peers.wake_run(self.s, rec.run_id, AttemptNote(
                    rec.lease_id, AttemptOrphaned(rec.step_id, rec.item_index, rec.fence)))
            elif isinstance(action, Recover):
                stored = rec.to_dict()
                await peers.wake_run(self.s, rec.run_id, AttemptNote(
                    rec.lease_id, AttemptLost(rec.step_id, rec.item_index, rec.fence, action.started),
                    stored))
                self._end("fenced")
                return
        self._arm()

    def _arm(self) -> None:
        peers.arm_due(self.s, self, self.machine.next_deadline())
