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

The actor is three layers, each its own module: `run_writes.RunWrites` (what
a transition writes), `run_offers.RunOffers` (commits, the offers that ride
them, effects) and `RunActor` here (messages, lifecycle, attempts' calls).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from stepd.actors import ActorDead, ActorKilled, StartFailed
from stepd.sansio.errors import Conflict, Invalid
from stepd.sansio.events import (
    Begin,
    Cancel,
    ChildFinished,
    InternalFailure,
    Retry,
    Runnable,
    SignalReceived,
    Tick,
    Transition,
)
from stepd.sansio.lease import LeaseStatus, Op
from stepd.sansio.record import RunRecord
from stepd.sansio.run import RunMachine

from . import peers, store
from .messages import (
    ApplyAttempt,
    AttemptNote,
    CancelRun,
    Due,
    History,
    IdleCheck,
    InboxChanged,
    Offer,
    Resync,
    RetryRun,
    SessionNote,
    Signal,
)
from .run_offers import RunOffers
from .run_writes import child_writes, walk_writes
from .services import Services

# The calls as module names: a lookup on an Enum class costs ~1,400
# instructions on 3.11 (stepd/sansio/lease.py says why); ~3 a step here.
_OP_STARTED = Op.STARTED
_OP_COMPLETE = Op.COMPLETE
_OP_FAIL = Op.FAIL

__all__ = ["MAX_CRASHES", "RunActor", "SignalRefused", "child_writes", "own_crash",
           "walk_writes"]

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


class SignalRefused(Conflict):
    """A signal refused because its transition would breach a budget (409 budget_exceeded)."""

    reason = "budget_exceeded"

    def __init__(self, budget: str, message: str = "") -> None:
        super().__init__(message or f"the signal's transition would exceed {budget}")
        self.budget = budget


_ABANDON = object()


class StaleState(RuntimeError):
    """The durable guard disagreed with this actor's memory: crash and rebuild from storage."""


class RunActor(RunOffers):
    """One active run: its messages, its lifecycle (load, crash count, passivation) and
    its attempts' calls; the commits, offers and effects are `RunOffers`', the
    writes `RunWrites`'."""

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
        super().__init__(services, run_id)
        self._initial = initial
        self._restarted = restarted
        # Started to take a message: passivating before it arrives would make
        # the sender start us again, forever.
        self._expect_message = expect_message

    # ------------------------------------------------------------------ lifecycle

    async def on_start(self) -> None:
        e = self.s
        # A first start (no restart reason: every run's) has no crash to count.
        give_up = None if self.restart_reason is None else await self._count_crash()
        if give_up is _ABANDON:
            self.stop()  # failing it failed too: no actor until something wakes it again
            return
        initial, self._initial = self._initial, None
        if initial is not None:
            # Its creator's machine, handed over: the run was written a moment ago and
            # nothing can be in its inbox. Only its parent (a child run is never
            # created here: `child_writes` writes it into its parent's transaction)
            # and its children (woken only after this start) write there, and each
            # such write tells `InboxChanged`, which drains it. No read for it.
            self.machine, tr = initial
            fresh = True
        else:
            fresh = False
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
        done: list[Transition] = [tr]  # whose effects this start performed
        if isinstance(give_up, str) and not self.machine.record.status.terminal:
            failed = self.machine.handle(InternalFailure(give_up), self.s.clock.time_ms())
            await self._commit(failed)
            await self._effects(failed)
            done.append(failed)
        if not self.machine.record.begun and not self.machine.record.status.terminal:
            # A child its parent created: enter its first step now, in its own
            # transaction (`Begin`; the parent's held only the record).
            begun = self.machine.handle(Begin(), self.s.clock.time_ms())
            await self._commit(begun)
            await self._effects(begun)
            done.append(begun)
        if not fresh:
            await self._drain_inbox()
        await self._ensure_leases()
        await self._effects(tr, offer=True)  # committed by its creator: offer it now
        runnable = self.machine.runnable()
        if runnable:
            # Slots those effects offered or announced already are not announced
            # again: the registry would hand each a second time (to an HTTP claim
            # waiting, say), and the run refuse the second offer (~110 calls a run
            # over HTTP). A restarted run performed none: it announces them all.
            covered = {spec for t in done for effect in t.effects
                       if type(effect) is Runnable for spec in effect.attempts}
            if covered:
                runnable = [spec for spec in runnable if spec not in covered]
        if runnable:  # `_announce`, with the slots looked up once for both
            peers.announce(e, tuple(runnable))
            await self._open_sessions(runnable)
        self._arm()
        if not self._expect_message and self._passivable():
            # Passivate after the start, in a turn of its own (`receive`'s check).
            # A run that is not passivable now (a step offered, a lease live, a
            # deadline due) becomes so only through a message (the attempt's
            # calls, its timer's `Due`), whose turn checks again: no IdleCheck
            # then (a whole turn per run).
            self.ref.tell_nowait(IdleCheck())

    async def receive(self, message: Any) -> Any:
        try:
            # One handler per message type (a dict, not an isinstance chain).
            try:
                handler = _HANDLERS[type(message)]
            except KeyError:
                raise TypeError(f"run actor: unexpected message {message!r}") from None
            return await handler(self, message)
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

    async def _due_fired(self, message: Due) -> None:
        self._due.fired()
        await self._handle(Tick())

    async def _signal(self, message: Signal) -> None:
        tr = self.machine.handle(SignalReceived(message.name, message.payload),
                                 self.s.clock.time_ms())
        # A refused signal journals its refusal; its audit entry (a 409) is
        # the caller's to write, not this transaction's.
        await self._commit(tr, audit=message.audit if tr.refused is None else None)
        await self._effects(tr)
        if tr.refused is not None:
            raise SignalRefused(tr.refused[1])

    async def _cancel(self, message: CancelRun) -> None:
        await self._handle(Cancel(message.message), audit=message.audit)

    async def _retry(self, message: RetryRun) -> dict[str, Any]:
        tr = await self._handle(Retry(), audit=message.audit)
        return {"status": self.machine.record.status.text, "step_id": tr.journal[0]["step_id"]}

    async def _inbox_changed(self, message: InboxChanged) -> None:
        await self._drain_inbox()

    async def _resync(self, message: Resync) -> None:
        await self._ensure_leases()
        self._announce()
        await self._open_sessions(self.machine.runnable())

    async def _session_note(self, message: SessionNote) -> None:
        await self._handle(message.event)

    async def _idle_check(self, message: IdleCheck) -> None:
        return None  # only `receive`'s passivation check, after it

    async def _history(self, message: History) -> dict[str, Any]:
        return self.machine.history(message.lease_id, message.step_id, message.item_index,
                                    message.fence)

    async def _offer_asked(self, message: Offer) -> dict[str, Any] | None:
        return self._offer(message)

    # ------------------------------------------------------------------ handlers

    async def _handle(self, event: Any, **write: Any) -> Transition:
        """Apply one machine event, persist it, then perform its effects."""
        tr = self.machine.handle(event, self.s.clock.time_ms())
        await self._commit(tr, **write)
        await self._effects(tr)
        return tr

    async def _apply_attempt(self, msg: ApplyAttempt) -> bool | tuple[bool, dict[str, Any]] | None:
        """Apply a worker's call on a lease; True when the lease's end (its complete or
        fail) was told to its session here, with the next lease (`Offered.ended`);
        with the lease for the call's answer beside it when it asked (``claim_next``)."""
        now = self.s.clock.time_ms()
        if msg.op is _OP_STARTED:
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
        if msg.op is _OP_STARTED and msg.lease.get("delivery") == "at_least_once":
            try:
                tr = self.machine.handle(msg.event, now)
            except Conflict:
                return None  # told, not asked: the lease's next call gets the refusal
            # PROTOCOL.md asks only at_most_once `started` to be durable before
            # the answer. For at_least_once nothing rests on it (recovery
            # re-queues either way), so it is written behind, in order, and
            # rides the next batch with the step's `complete`: one fsync per step.
            self._write_behind(self._write(tr, leases=[msg.lease]))
            self._arm()
            return None
        try:
            tr = self.machine.handle(msg.event, now)  # Conflict: nothing changed
        except Conflict:
            if before is not None:  # what did apply is written behind, as a `started` is
                self._write_behind(self._write(
                    before, leases=[dict(msg.lease, status=LeaseStatus.STARTED.text,
                                         ended_at=None, call=None)]), trace=False)
                self._arm()
            if self._landed(msg):
                return None  # this very call landed before an incarnation died under it
            raise
        if before is not None:
            tr.journal[:0] = before.journal
            tr.effects[:0] = before.effects
        ending = None
        if msg.op is _OP_COMPLETE or msg.op is _OP_FAIL:
            ending = (msg.lease_id, msg.lease["worker_id"])
        try:
            told = await self._commit(tr, ending=ending, answer=msg.claim_next,
                                      guard=store.LeaseGuard(msg.lease_id, msg.op),
                                      leases=[msg.lease])
        except Conflict as exc:
            # Memory said yes, the durable record says no: memory is wrong. Crash;
            # the asker gets ActorDead and asks the rebuilt incarnation again.
            raise StaleState(f"run {self.run_id}: the durable guard said {exc.reason}") from exc
        await self._effects(tr)
        return told or None

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
        if msg.op is _OP_STARTED or final not in ("completed", "failed") or not token:
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


_HANDLERS: dict[type, Callable[[RunActor, Any], Awaitable[Any]]] = {
    ApplyAttempt: RunActor._apply_attempt,
    Offer: RunActor._offer_asked,
    Due: RunActor._due_fired,
    AttemptNote: RunActor._note,
    Signal: RunActor._signal,
    CancelRun: RunActor._cancel,
    RetryRun: RunActor._retry,
    InboxChanged: RunActor._inbox_changed,
    Resync: RunActor._resync,
    SessionNote: RunActor._session_note,
    IdleCheck: RunActor._idle_check,
    History: RunActor._history,
}
