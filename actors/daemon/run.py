"""The run actor: one active run's shell around its `RunMachine`.

The machine decides; this actor does the I/O in the order DESIGN.md demands:
persist the transition (one `RunWrite`, one transaction), then answer, then
perform the effects (announce runnable slots, end leases, wake children and
parents). It holds nothing that storage cannot rebuild: a killed run actor is
restarted by its supervisor and `on_start` reloads the record (STYLE.md rule
11).

A run with nothing in flight (waiting for a signal, sleeping, waiting on
children, or over) passivates: the actor stops, the durable timer index and
the inbox bring it back (DESIGN.md "Idle runs").

Run actors never wait on another actor: they tell, and they `ask_now` the
registry and a session to offer the next slot in their own turn (answered
only by an idle actor whose handler never waits, else refused at once);
lease actors and sessions ask run actors. So no cycle of waits, no deadlock.
"""

from __future__ import annotations

import logging
from typing import Any

from stepd.actors import Actor, ActorDead, ActorKilled, ActorNotFound, StartFailed, WouldBlock
from stepd.sansio.errors import Conflict, Invalid, StepdError
from stepd.sansio.events import (
    AttemptOffered,
    AttemptSpec,
    Begin,
    Cancel,
    CancelChildren,
    ChildFinished,
    EndLeases,
    InternalFailure,
    NotifyParent,
    Retry,
    RunEnded,
    Runnable,
    SignalReceived,
    StartChildren,
    Tick,
    Transition,
    Withdraw,
)
from stepd.sansio.lease import LeaseRecord, LeaseStatus, Op
from stepd.sansio.record import RunRecord
from stepd.sansio.run import RunMachine

from . import ids, peers, store
from .messages import (
    ApplyAttempt,
    AttemptNote,
    CancelRun,
    CloseSession,
    Due,
    EnsureHolder,
    History,
    IdleCheck,
    InboxChanged,
    Offer,
    Offered,
    Resync,
    RetryRun,
    SessionNote,
    Signal,
    SlotFor,
    TakeSlot,
)
from .services import Services

log = logging.getLogger("stepd.daemon")

#: A run whose actor crashes more than this many times within `CRASH_PERIOD_MS`
#: (counted durably, across daemon restarts) is failed with reason `internal`.
MAX_CRASHES = 5
CRASH_PERIOD_MS = 10 * 60 * 1000


def own_crash(reason: BaseException | None) -> BaseException | None:
    """The run actor's own failure in a restart reason, or None for a kill or a
    dependency that was restarting (neither says anything about the run)."""
    if isinstance(reason, StartFailed) and reason.__cause__ is not None:
        reason = reason.__cause__
    if reason is None or isinstance(reason, (ActorKilled, ActorDead)):
        return None
    return reason if isinstance(reason, Exception) else None


def child_writes(s: Services, effect: StartChildren, now: int) -> list[store.RunWrite]:
    """The records of the child runs a `start_workflows` step creates.

    Created unbegun (`RunRecord.begun`): each child's own actor enters its
    first step, in its own transaction. A child whose first step starts
    children of its own thus adds one level per transaction, never a
    recursion inside this one (a workflow starting itself once recursed until
    Python gave up, and the start answered 500).
    """
    writes = []
    for child in effect.children:
        machine, tr = RunMachine.start(
            run_id=child.run_id, definition=effect.definition, input=child.input, now_ms=now,
            correlation=effect.correlation,
            parent={"run_id": effect.parent_run_id, "step_id": effect.step_id},
            resolve=s.catalog.resolve, depth=effect.depth, begin=False,
            max_depth=s.config.max_child_depth,
        )
        writes.append(store.RunWrite(
            run_id=child.run_id, record=machine.record.to_dict(), journal=tr.journal,
            due_new=machine.next_deadline(), active_new=not machine.idle(), create=True,
        ))
        s.stats.runs_started += 1
    return writes


def walk_writes(writes: list[store.RunWrite]) -> list[store.RunWrite]:
    out = []
    for w in writes:
        out.append(w)
        out.extend(walk_writes(w.children))
    return out


class SignalRefused(Conflict):
    """A signal refused because its transition would breach a budget (409 budget_exceeded)."""

    reason = "budget_exceeded"

    def __init__(self, budget: str, message: str = "") -> None:
        super().__init__(message or f"the signal's transition would exceed {budget}")
        self.budget = budget


_ABANDON = object()


class StaleState(RuntimeError):
    """The durable guard disagreed with this actor's memory: crash and rebuild from storage."""


class RunActor(Actor):
    kind = "run"
    reply_errors = (Conflict, Invalid)
    #: Its handlers wait only for storage commits and for actors it starts or tells
    #: (never asks): a kill lands when the wait in hand ends, the commit it waited
    #: for on record, and no cancel scope is paid around each commit (docs/actors.md).
    deferred_kill = True

    def __init__(
        self,
        services: Services,
        run_id: str,
        initial: tuple[RunMachine, Transition] | None = None,
        *,
        restarted: bool = False,
        expect_message: bool = False,
    ) -> None:
        self.s = services
        self.run_id = run_id
        self._initial = initial
        self._restarted = restarted
        # Started to take a message: passivating before it arrives would make
        # the sender start us again, forever.
        self._expect_message = expect_message
        self.machine: RunMachine
        self.indexed_due: int | None = None
        self.indexed_active = False
        self._created: list[str] = []  # runs the last write created (children, grandchildren)
        self._due = peers.DueTimer()

    # ------------------------------------------------------------------ lifecycle

    async def on_start(self) -> None:
        e = self.s
        give_up = await self._count_crash()
        if give_up is _ABANDON:
            self.stop()  # failing it failed too: no actor until something wakes it again
            return
        initial, self._initial = self._initial, None
        if initial is not None:
            self.machine, tr = initial
        else:
            # Writes an earlier incarnation left behind (deferred offers) must be
            # on record before we read the record: after a crash of this actor,
            # and as much after its supervisor restarted (a /runs or /registry
            # kill) and this run was activated afresh; else an offer made just
            # before the kill is made again, same attempt and fence, to another
            # worker (the campaign's kill races found that). Nothing pending at
            # all (the common case) needs no barrier.
            creating = e.creating
            if self.run_id in creating:
                creating[self.run_id] += 1  # its creator's machine is stale from now on
            if not e.storage.settled():
                await e.storage.write(store.barrier_txn)
            raw = e.storage.read(store.load_run_txn, self.run_id)
            if raw is None:
                raise LookupError(f"run {self.run_id} is not on record")
            record = RunRecord.from_dict(raw)
            definition = e.catalog.by_hash(record.definition_hash)
            if definition is None:
                raise LookupError(f"run {self.run_id}: definition {record.definition_hash} unknown")
            self.machine = RunMachine(record, definition, e.catalog.resolve,
                                      max_depth=e.config.max_child_depth)
            tr = Transition()
        self.indexed_due = self.machine.next_deadline()
        self.indexed_active = not self.machine.idle()
        # The status as counted in stats.status_counts (creation counted it already).
        self._status = self.machine.record.status.text
        if isinstance(give_up, str) and not self.machine.record.status.terminal:
            failed = self.machine.handle(InternalFailure(give_up), self.s.clock.time_ms())
            await self._commit(failed)
            await self._effects(failed)
        if not self.machine.record.begun and not self.machine.record.status.terminal:
            # A child its parent created: enter its first step now, in its own
            # transaction (`Begin`; the parent's held only the record).
            begun = self.machine.handle(Begin(), self.s.clock.time_ms())
            await self._commit(begun)
            await self._effects(begun)
        await self._drain_inbox()
        await self._ensure_leases()
        await self._effects(tr)
        self._announce()
        await self._open_sessions(self.machine.runnable())
        self._arm()
        if not self._expect_message:
            self.ref.tell_nowait(IdleCheck())

    async def receive(self, message: Any) -> Any:
        try:
            return await self._dispatch(message)
        finally:
            if self._passivable():
                if self.indexed_due is not None:
                    # From now on only the timer actor wakes this run. Its index
                    # entry is committed (every write of this run is), so the
                    # timer actor's next sweep sees it; telling it earlier (at
                    # the write) lost runs to a sweep between tell and commit.
                    await peers.timers_changed(self.s, self.indexed_due)
                self.stop()

    async def _count_crash(self) -> str | object | None:
        """After a crash of this run's actor: count it durably; past the bound, give up.

        Returns None (go on), the message to fail the run with, or `_ABANDON`
        when even failing it keeps crashing (then the actor stays down until
        something wakes the run again, each time costing one counted crash).
        """
        crash = own_crash(self.restart_reason)
        if crash is None:
            return None
        now = self.s.clock.time_ms()
        error = f"{type(crash).__name__}: {crash}"
        count = await self.s.storage.write(
            store.count_crash_txn, self.run_id, now, error, CRASH_PERIOD_MS, 2 * MAX_CRASHES + 1)
        if count <= MAX_CRASHES:
            return None
        if count > 2 * MAX_CRASHES:
            log.error("run %s: its actor crashed %d times in %d minutes, and failing the run "
                      "crashed too; it is left without an actor (last: %s)", self.run_id, count,
                      CRASH_PERIOD_MS // 60_000, error)
            return _ABANDON
        log.error("run %s: its actor crashed %d times in %d minutes; the run fails with "
                  "reason internal (last: %s)", self.run_id, count, CRASH_PERIOD_MS // 60_000,
                  error)
        return (f"the daemon gave up on this run: its actor crashed {count} times in "
                f"{CRASH_PERIOD_MS // 60_000} minutes (last: {error[:500]})")

    def _passivable(self) -> bool:
        """Nothing in flight, nothing queued, and no deadline already due."""
        m = self.machine
        if not m.idle() or self.has_pending() or m.live_leases():
            return False
        due = m.next_deadline()
        return due is None or due > self.s.clock.time_ms()

    async def _dispatch(self, message: Any) -> Any:
        if isinstance(message, ApplyAttempt):
            return await self._apply_attempt(message)
        if isinstance(message, Offer):
            return self._offer(message)
        if isinstance(message, Due):
            self._due.fired()
            await self._handle(Tick())
            return None
        if isinstance(message, AttemptNote):
            return await self._note(message)
        if isinstance(message, Signal):
            tr = self.machine.handle(SignalReceived(message.name, message.payload),
                                     self.s.clock.time_ms())
            # A refused signal journals its refusal; its audit entry (a 409) is
            # the caller's to write, not this transaction's.
            await self._commit(tr, audit=message.audit if tr.refused is None else None)
            await self._effects(tr)
            if tr.refused is not None:
                raise SignalRefused(tr.refused[1])
            return None
        if isinstance(message, CancelRun):
            await self._handle(Cancel(message.message), audit=message.audit)
            return None
        if isinstance(message, RetryRun):
            tr = await self._handle(Retry(), audit=message.audit)
            return {"status": self.machine.record.status.text, "step_id": tr.journal[0]["step_id"]}
        if isinstance(message, InboxChanged):
            await self._drain_inbox()
            return None
        if isinstance(message, Resync):
            await self._ensure_leases()
            self._announce()
            await self._open_sessions(self.machine.runnable())
            return None
        if isinstance(message, SessionNote):
            await self._handle(message.event)
            return None
        if isinstance(message, IdleCheck):
            return None
        if isinstance(message, History):
            return self.machine.history(message.lease_id, message.step_id, message.item_index,
                                        message.fence)
        raise TypeError(f"run actor: unexpected message {message!r}")

    # ------------------------------------------------------------------ handlers

    async def _handle(self, event: Any, **write: Any) -> Transition:
        """Apply one machine event, persist it, then perform its effects."""
        tr = self.machine.handle(event, self.s.clock.time_ms())
        await self._commit(tr, **write)
        await self._effects(tr)
        return tr

    def _offer(self, msg: Offer) -> dict[str, Any] | None:
        e = self.s
        now = self.s.clock.time_ms()
        lease_id = ids.lease_id(now)
        spec = msg.spec
        try:
            tr = self.machine.handle(
                AttemptOffered(spec.step_id, spec.item_index, lease_id, msg.worker_id,
                               msg.worker_name, msg.local_steps, msg.sticky),
                now,
            )
        except Conflict:
            return None  # the slot moved on (offered elsewhere, withdrawn, run over)
        lease = tr.lease
        assert lease is not None
        record = LeaseRecord(
            lease_id=lease_id, run_id=self.run_id, step_id=spec.step_id,
            item_index=spec.item_index, fence=lease["fence"], attempt=lease["attempt"],
            worker_id=msg.worker_id, worker_name=msg.worker_name, delivery=lease["delivery"],
            offered_at=now,
        )
        # The offer is written behind: nothing acknowledges it. If it is lost in a
        # crash the slot is still queued on record and is offered again, and the
        # worker's calls on this lease get 404. Every later write of this run is
        # ordered after it, so `started`/`complete` find the lease on record.
        self._write_behind(self._write(tr, leases=[record.to_dict()]))
        peers.start_lease(e, record)
        lease["lease_ttl_ms"] = e.config.lease_ttl_ms
        e.stats.leases_offered += 1
        return lease

    async def _apply_attempt(self, msg: ApplyAttempt) -> None:
        now = self.s.clock.time_ms()
        if msg.op is Op.STARTED:
            self._sample_schedule_to_start(msg.event, now)
        before = None
        if msg.started is not None:
            # A folded `started` (at_least_once): applied first, and written in
            # the same commit as the call it rode in (docs/leases.md).
            self._sample_schedule_to_start(msg.started, now)
            try:
                before = self.machine.handle(msg.started, now)
            except Conflict:
                before = None  # the attempt moved on: the call below hears why
        if msg.op is Op.STARTED and msg.lease.get("delivery") == "at_least_once":
            try:
                tr = self.machine.handle(msg.event, now)
            except Conflict:
                return  # told, not asked: the lease's next call gets the refusal
            # PROTOCOL.md asks only at_most_once `started` to be durable before
            # the answer. For at_least_once nothing rests on it (recovery
            # re-queues either way), so it is written behind, in order, and
            # rides the next batch with the step's `complete`: one fsync per step.
            self._write_behind(self._write(tr, leases=[msg.lease]))
            self._arm()
            return
        try:
            tr = self.machine.handle(msg.event, now)  # Conflict: nothing changed
        except Conflict:
            if before is not None:  # what did apply is written behind, as a `started` is
                self.s.storage.write_deferred(store.apply_txn, store.deferred(self._write(
                    before, leases=[dict(msg.lease, status=LeaseStatus.STARTED.text,
                                         ended_at=None, call=None)])))
                self._arm()
            if self._landed(msg):
                return  # this very call landed before an incarnation died under it
            raise
        if before is not None:
            tr.journal[:0] = before.journal
            tr.effects[:0] = before.effects
        try:
            await self._commit(tr, guard=store.LeaseGuard(msg.lease_id, msg.op), leases=[msg.lease])
        except Conflict as exc:
            # Memory said yes, the durable record says no: memory is wrong. Crash;
            # the asker gets ActorDead and asks the rebuilt incarnation again.
            raise StaleState(f"run {self.run_id}: the durable guard said {exc.reason}") from exc
        await self._effects(tr)

    def _sample_schedule_to_start(self, event: Any, now: int) -> None:
        frame = self.machine.record.frame
        if frame is not None:
            slot = frame.slot(event.item_index)
            if slot is not None and slot.queued_at is not None:
                stats = self.s.stats
                stats.sample(stats.schedule_to_start, (now - slot.queued_at) / 1000.0)

    def _landed(self, msg: ApplyAttempt) -> bool:
        """The call `msg` carries is on record already: this very call landed.

        An ask is retried when the actor it reached died before answering (a
        kill, a crash): the first delivery may have committed. The lease record
        names the call that ended it (`LeaseCall.token`), so a retry meeting its
        own outcome answers success, not a 409 (a landed complete once came back
        run_terminal when its run actor was killed during the call), while a
        second call meeting an earlier one's outcome still hears the 409.
        """
        final = msg.lease.get("status")
        token = msg.lease.get("call")
        if msg.op is Op.STARTED or final not in ("completed", "failed") or not token:
            return False
        raw = self.s.storage.get(store.LEASES, msg.lease_id)
        return isinstance(raw, dict) and raw.get("status") == final and raw.get("call") == token

    async def _note(self, msg: AttemptNote) -> None:
        try:
            tr = self.machine.handle(msg.event, self.s.clock.time_ms())
        except Conflict:
            return  # the attempt moved on meanwhile: nothing to record
        leases = [msg.lease] if msg.lease is not None else []
        await self._commit(tr, leases=leases)
        await self._effects(tr)
        return

    async def _drain_inbox(self) -> None:
        e = self.s
        entries = e.storage.read(store.inbox_txn, self.run_id)
        for key, msg in entries:
            kind = msg.get("type")
            if kind == "child_finished":
                event: Any = ChildFinished(msg["child_run_id"], msg["status"], msg.get("result"),
                                           msg.get("error"))
            elif kind == "cancel":
                event = Cancel(msg.get("message") or "cancelled by the parent run")
            else:
                continue
            try:
                tr = self.machine.handle(event, self.s.clock.time_ms())
            except Conflict:
                tr = Transition()  # already terminal: just consume the message
            await self._commit(tr, inbox_done=[key])
            await self._effects(tr)

    # ------------------------------------------------------------------ persistence

    def _write(self, tr: Transition, **extra: Any) -> store.RunWrite:
        m = self.machine
        due = m.next_deadline()
        active = not m.idle()
        w = store.RunWrite(
            run_id=self.run_id,
            record=m.record.to_dict(),
            journal=tr.journal,
            due_old=self.indexed_due,
            due_new=due,
            active_old=self.indexed_active,
            active_new=active,
            status_old=self._status,
            **extra,
        )
        for effect in tr.effects:
            if isinstance(effect, EndLeases):
                status = (LeaseStatus.FENCED if effect.reason == "fenced" else LeaseStatus.RUN_TERMINAL).text
                now = self.s.clock.time_ms()
                w.lease_status.extend((lid, status, now) for lid in effect.lease_ids)
            elif isinstance(effect, StartChildren):
                children = child_writes(self.s, effect, self.s.clock.time_ms())
                w.children.extend(children)
                for cw in walk_writes(children):
                    self.s.stats.status_moved(None, cw.record["status"])
                    # Grandchildren too (a child whose first step starts its own):
                    # every run created here needs an actor once this commits.
                    self._created.append(cw.run_id)
            elif isinstance(effect, NotifyParent):
                r = m.record
                w.inbox.append((effect.parent_run_id, self.run_id, {
                    "type": "child_finished", "child_run_id": self.run_id,
                    "status": r.status.text, "result": r.result, "error": r.error,
                }))
            elif isinstance(effect, CancelChildren):
                for child in effect.run_ids:
                    w.inbox.append((child, self.run_id, {"type": "cancel",
                                                         "message": f"parent run {self.run_id} ended"}))
        self.indexed_due = due
        self.indexed_active = active
        status = m.record.status.text
        if status != self._status:
            self.s.stats.status_moved(self._status, status)
            self._status = status
        return w

    async def _commit(self, tr: Transition, **extra: Any) -> None:
        if not tr.journal and not extra.get("leases") and not extra.get("inbox_done"):
            # Nothing happened (a tick with nothing due, a refused signal). Still
            # arm: the timer that brought a Tick here has fired, and an actor kept
            # alive by its mailbox must not be left without one.
            self._arm()
            return
        w = self._write(tr, **extra)
        await self.s.storage.write(store.apply_txn, w)
        if self.s.trace is not None:
            self.s.trace.committed(w)  # after the commit: export describes what is on record
        self._arm_at(self.indexed_due)  # what _write found: the machine did not move since

    def _write_behind(self, w: store.RunWrite) -> None:
        """Queue a write nobody awaits (an offer, an at_least_once `started`).

        The trace sink hears of it now: it only notes the attempt's start, and
        exports nothing until a later write of this run ends the attempt,
        which is committed after this one (the storage keeps submission order).
        """
        self.s.storage.write_deferred(store.apply_txn, store.deferred(w))
        if self.s.trace is not None:
            self.s.trace.committed(w)

    # ------------------------------------------------------------------ effects

    async def _effects(self, tr: Transition) -> None:
        e = self.s
        for effect in tr.effects:
            if isinstance(effect, Runnable):
                specs = effect.attempts
                if not any(type(other) is Withdraw for other in tr.effects):
                    specs = tuple(spec for spec in specs if not self._offer_now(spec))
                peers.announce(e, specs)
                await self._open_sessions(effect.attempts)
            elif isinstance(effect, Withdraw):
                peers.withdraw(e, effect.run_id, effect.slots)
            elif isinstance(effect, EndLeases):
                for lease_id in effect.lease_ids:
                    peers.end_lease(e, lease_id, effect.reason)
            elif isinstance(effect, StartChildren):
                created, self._created = self._created, []
                for child_id in created:
                    await peers.wake_run(e, child_id, None)
            elif isinstance(effect, CancelChildren):
                for child_id in effect.run_ids:
                    await peers.wake_run(e, child_id, InboxChanged())
            elif isinstance(effect, NotifyParent):
                await peers.wake_run(e, effect.parent_run_id, InboxChanged())
            elif isinstance(effect, RunEnded):
                stats = e.stats
                stats.runs_ended += 1
                stats.sample(stats.run_to_complete,
                             (self.s.clock.time_ms() - self.machine.record.created_at) / 1000)
                e.watch.ended(self.run_id)
                await self._close_sessions()

    def _offer_now(self, spec: AttemptSpec) -> bool:
        """Offer a runnable slot in this turn, if a session takes it now; False: announce it.

        The registry stays the one router (`Route`: which subscribed session,
        counted as handed to it); the session takes the slot as from the
        registry's `SlotFor` (`TakeSlot`, credit and all) and answers as whom;
        the offer is this run's own (`_offer`, as for the session's `Offer`);
        the session pushes the lease (`Offered`). Each is an `ask_now`: handled
        right here only if that actor is idle, by its own handler, none of
        which waits; so this turn never waits on them, and no ask cycle can
        form (the session does not ask this busy run, it is asked). Anything
        not idle takes the queued path: the registry's pick goes as the
        `SlotFor` it would have sent, the lease as a queued `Offered`.
        """
        if spec.session is not None:
            return False  # a worker session's step: its holder, through the registry's queue
        e = self.s
        routed = peers.route_now(e, spec)
        if routed is None:
            return False
        worker_id, claim = routed
        path = f"/sessions/{worker_id}"
        try:
            ref = e.system.resolve(path)
            try:
                who = ref.ask_now(TakeSlot(spec, claim))
            except WouldBlock:
                ref.tell_nowait(SlotFor(spec, claim))  # the registry's own hand-over
                return True
        except (ActorDead, ActorNotFound, WouldBlock):
            return False  # the registry queues it; that session's next incarnation subscribes
        if who is None:
            return True  # the session could not take it and gave it back (`ReturnSpecs`)
        lease = self._offer(Offer(spec, who.worker_id, who.worker_name, who.local_steps,
                                  who.sticky))
        peers.tell_ref_now(ref, Offered(spec, lease))
        return True

    def _announce(self) -> None:
        specs = self.machine.runnable()
        if specs:
            peers.announce(self.s, tuple(specs))

    async def _open_sessions(self, specs: Any) -> None:
        """Slots of a worker session with no holder wait in the registry: make sure the
        session's actor exists and is looking for one (AFFINITY.md "Worker sessions")."""
        for session_id in {sp.session for sp in specs if sp.session is not None and sp.pinned is None}:
            await self._tell_session(session_id, EnsureHolder())

    async def _close_sessions(self) -> None:
        """The run is over: its sessions end and free their workers' slots."""
        for entry in self.machine.record.sessions.values():
            if entry["status"] in ("pending", "held"):
                await self._tell_session(entry["id"], CloseSession())

    async def _tell_session(self, session_id: str, message: Any) -> None:
        try:
            ref = await peers.ensure_work_session(self.s, session_id)
        except (ActorDead, StepdError):
            return  # /sessions is restarting: recovery starts every open session again
        peers.tell_ref(ref, message)

    async def _ensure_leases(self) -> None:
        """Every live lease of this run has its actor (after a restart: with a full TTL)."""
        live = self.machine.live_leases()
        if not live:
            return
        e = self.s
        records = e.storage.read(store.live_leases_txn, [lid for lid, _ in live])
        if len(records) < len(live):
            # An offer is written behind. Its actor was started with it, but if
            # the leases supervisor restarted since, nobody else starts one: wait
            # for the writes before this, so the record can be found.
            await e.storage.write(store.barrier_txn)
            records = e.storage.read(store.live_leases_txn, [lid for lid, _ in live])
        on_record = {r["lease_id"]: r for r in records}
        for lease_id, slot in live:
            raw = on_record.get(lease_id)
            if raw is None:
                continue  # ended meanwhile, or its offer was lost in a crash (queued on record)
            if not peers.lease_alive(e, lease_id):
                peers.start_lease(e, LeaseRecord.from_dict(raw), fresh=False)

    def _arm(self) -> None:
        self._arm_at(self.machine.next_deadline())

    def _arm_at(self, due: int | None) -> None:
        """Arm (or cancel) the timer of the machine's next deadline, `due`."""
        self._due.arm(self.s, self, due)

