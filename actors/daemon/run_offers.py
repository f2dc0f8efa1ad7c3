"""A run's commits and what follows them: its runnable slots turned into leases, its
effects performed.

The middle layer of the run actor (over `run_writes.py`, under `run.py`).

Offers ride the commit that made their slot runnable. When a transition makes
a slot runnable (the step after a `complete`, a retry) and a subscribed
session takes it now, the run makes the lease before it writes: the offer (its
journal entry, the fence, the lease record) joins the transition's own
transaction, and the lease goes to the worker after that commit. Before, the
offer was a second write of the run record, behind the first, in the next
batch: two serialisations of the record per step, and a lease pushed before
its offer was on record. Now one write per step holds both, and the worker
hears of no lease that is not on record.

Who takes the slot is asked in this turn, before the commit (`Route` of the
registry, `TakeSlot` of the session: each an `ask_now`, answered only by an
idle actor whose handler never waits, else refused at once). From then on the
session holds the slot in hand until the run hands it over (`Offered`): with
the lease once the commit is on record, with None (the slot back, its credit
with it) when the commit failed or never happened. The hand-over happens on
every way out of the commit, a kill of the run actor included (thrown in when
the commit's wait ends, docs/actors.md "deferred_kill"): the lease record
itself says whether the offer is on record. So a session never keeps a slot
the run will not hand over, and a worker never holds a lease whose offer may
be lost.
"""

from __future__ import annotations

from typing import Any, Literal

from stepd.actors import ActorDead, ActorNotFound, ActorRef, WouldBlock
from stepd.sansio.errors import Conflict, StepdError
from stepd.sansio.events import (
    AttemptOffered,
    AttemptSpec,
    CancelChildren,
    EndLeases,
    NotifyParent,
    RunEnded,
    Runnable,
    StartChildren,
    Transition,
    Withdraw,
)
from stepd.sansio.lease import LeaseRecord
from stepd.sansio.session import ANSWER

from . import ids, peers, store
from .messages import (
    CloseSession,
    EnsureHolder,
    InboxChanged,
    Offer,
    OfferAs,
    Offered,
    SlotFor,
    TakeSlot,
)
from .run_writes import RunWrites

__all__ = ["RunOffers"]


#: An offer made before the commit that holds it, handed over after that commit:
#: (the session that takes it, its slot, what the worker gets, the lease record,
#: whether it goes out in the answer to its worker's own call: `Route.answer_to`).
_Ahead = tuple[ActorRef, AttemptSpec, dict[str, Any], LeaseRecord, bool]


class RunOffers(RunWrites):
    """A run actor's commits, offers and effects (see the module docstring)."""

    # ------------------------------------------------------------------ commits

    async def _commit(self, tr: Transition, *, ending: tuple[str, str] | None = None,
                      answer: bool = False, **extra: Any) -> bool | tuple[bool, dict[str, Any]]:
        """Persist `tr` (with `extra`'s parts of the write), its offers made ahead in it.

        `ending`: (lease id, worker id) of a lease this write ends by its own call
        (a complete or fail). When that worker's session takes an offer here,
        the end rides the offer (`Offered.ended`) and True says so: its lease
        actor then tells the session nothing (one message per step fewer).
        `answer`: that call asked for its worker's next lease in its answer
        (``claim_next``); the lease, if one went that way, is returned beside that
        flag.
        """
        if not tr.journal and not extra.get("leases") and not extra.get("inbox_done"):
            # Nothing happened (a tick with nothing due, a refused signal). Still
            # arm: the timer that brought a Tick here has fired, and an actor kept
            # alive by its mailbox must not be left without one.
            self._arm()
            return False
        ahead = self._offer_ahead(tr, ending[1] if answer and ending is not None else None)
        if ahead:
            # A copy (the caller's list stays its own), without `list` and `get` calls.
            leases = extra["leases"] = [*extra["leases"]] if "leases" in extra else []
            for offer in ahead:
                leases.append(offer[3].to_dict())
        w = self._write(tr, **extra)
        try:
            done = await self.s.storage.write(store.apply_txn, self._take_behind(w))
            if type(done) is store.Refused:  # a merged write's own part (`store.merge`)
                raise done.exc
        except BaseException:
            if ahead:
                self._hand_over(ahead, on_record=self._on_record(ahead[0]))
            raise
        if self.s.trace is not None:
            self.s.trace.committed(w)  # after the commit: export describes what is on record
        self._arm_at(self.indexed_due)  # what _write found: the machine did not move since
        if ahead:
            return self._hand_over(ahead, on_record=True, ending=ending)
        return False

    def _offer_ahead(self, tr: Transition, answer_to: str | None = None) -> list[_Ahead]:
        """Offer `tr`'s runnable slots that a session takes now, into `tr` itself
        (its journal; the lease records go with the write); the rest stay in its
        `Runnable` effect, for the registry's queue. `answer_to`: `Route.answer_to`,
        for the first slot only (the one slot the completed lease frees)."""
        effects = tr.effects
        ahead: list[_Ahead] = []
        more: list[Any] = []  # the offers' own effects (none today), after tr's
        for i, effect in enumerate(effects):
            if type(effect) is Runnable:
                for other in effects:  # `_withdraws`, written out (a step each)
                    if type(other) is Withdraw:
                        return ahead  # the step moved on in the same transition
                # This turn's time: the event that made the slot runnable was handled
                # at it, in this turn (`RunMachine.handle` sets `updated_at`), and the
                # session takes it as its own (`TakeSlot`): no clock read.
                now = self.machine.record.updated_at
                left = []
                moved = False
                for spec in effect.attempts:
                    taken = self._take(spec, now, answer_to)
                    if taken is None:
                        left.append(spec)
                        continue
                    moved = True
                    if taken is not True:
                        ref, who, answered = taken
                        if answered:
                            answer_to = None
                        made = self._made_offer(spec, who, now)
                        if made is None:
                            peers.tell_ref_now(ref, Offered(spec, None, now))
                            continue
                        offer_tr, record, lease = made
                        tr.journal += offer_tr.journal  # `+=`: no `extend` call
                        if offer_tr.effects:
                            more += offer_tr.effects
                        ahead.append((ref, spec, lease, record, answered))
                if moved:  # some went to a session: the rest stay runnable
                    effects[i] = Runnable(tuple(left))
        if more:
            effects += more
        return ahead

    def _on_record(self, first: _Ahead) -> bool:
        """After a commit that raised (failed, refused, or a kill thrown in when it
        ended): are its offers on record? They are all or none: one transaction."""
        try:
            raw = self.s.storage.get(store.LEASES, first[3].lease_id)
        except Exception:  # noqa: BLE001 - a closed storage: nothing more is on record
            return False
        return isinstance(raw, dict)

    def _hand_over(self, ahead: list[_Ahead], *, on_record: bool,
                   ending: tuple[str, str] | None = None) -> bool | tuple[bool, dict[str, Any]]:
        """The sessions get the leases offered ahead (their actors started first), or,
        when the offers are not on record, the slots back. True: the first offer to
        `ending`'s worker carried that lease's end (see `_commit`); with the lease
        that goes out in that worker's answer, when there is one."""
        e = self.s
        told = False
        answered = None
        for session, spec, lease, record, to_answer in ahead:
            if on_record:
                peers.start_lease(e, record)
                ended = None
                if ending is not None and not told and record.worker_id == ending[1]:
                    ended = ending[0]
                sent = peers.tell_ref_now(session, Offered(spec, lease, record.offered_at, ended))
                told = told or (ended is not None and sent)
                if to_answer:
                    answered = lease
            else:
                peers.tell_ref_now(session, Offered(spec, None, record.offered_at))
        return told if answered is None else (told, answered)

    # ------------------------------------------------------------------ offers

    def _take(self, spec: AttemptSpec, now: int, answer_to: str | None = None
              ) -> tuple[ActorRef, OfferAs, bool] | Literal[True] | None:
        """Which session takes `spec` now (this turn's `now`), and as whom (`Route`, then
        `TakeSlot`).

        Returns the session, its worker, and whether the lease goes out in the
        answer to `answer_to`'s own call (`Route.answer_to`); True when the slot
        went elsewhere (queued to a busy session as the registry's own `SlotFor`,
        or given back by the session); None when nobody takes it now (announce it).
        """
        if spec.session is not None:
            return None  # a worker session's step: its holder, through the registry's queue
        e = self.s
        routed = peers.route_now(e, spec, answer_to)
        if routed is None:
            return None
        worker_id, claim = routed
        try:
            ref = e.system.resolve(f"/sessions/{worker_id}")
            try:
                who: OfferAs | None = ref.ask_now(TakeSlot(spec, claim, now))
            except WouldBlock:
                if claim == ANSWER:
                    # Only this turn can put it in the call's answer: announce it
                    # instead (the registry counted nothing for it).
                    return None
                ref.tell_nowait(SlotFor(spec, claim))  # the registry's own hand-over
                return True
        except (ActorDead, ActorNotFound, WouldBlock):
            return None  # the registry queues it; that session's next incarnation subscribes
        if who is None:
            return True  # the session could not take it and gave it back (`ReturnSpecs`)
        return ref, who, claim == ANSWER

    def _made_offer(self, spec: AttemptSpec, who: Offer | OfferAs, now: int
                    ) -> tuple[Transition, LeaseRecord, dict[str, Any]] | None:
        """The machine offers `spec` to `who` at `now`: its transition, the lease record
        and what the worker gets; None when the slot moved on (offered elsewhere,
        withdrawn, the run over)."""
        e = self.s
        lease_id = ids.lease_id(now)
        try:
            tr = self.machine.handle(
                AttemptOffered(spec.step_id, spec.item_index, lease_id, who.worker_id,
                               who.worker_name, who.local_steps, who.sticky),
                now,
            )
        except Conflict:
            return None
        lease = tr.lease
        assert lease is not None
        record = LeaseRecord(
            lease_id=lease_id, run_id=self.run_id, step_id=spec.step_id,
            item_index=spec.item_index, fence=lease["fence"], attempt=lease["attempt"],
            worker_id=who.worker_id, worker_name=who.worker_name, delivery=lease["delivery"],
            offered_at=now,
        )
        lease["lease_ttl_ms"] = e.config.lease_ttl_ms
        e.stats.leases_offered += 1
        return tr, record, lease

    def _offer(self, msg: Offer) -> dict[str, Any] | None:
        """A session asks for a lease for a slot the registry queued to it (`Offer`)."""
        made = self._made_offer(msg.spec, msg, self.s.clock.time_ms())
        if made is None:
            return None  # the slot moved on (offered elsewhere, withdrawn, run over)
        tr, record, lease = made
        # The offer is written behind: nothing acknowledges it. If it is lost in a
        # crash the slot is still queued on record and is offered again, and the
        # worker's calls on this lease get 404. Every later write of this run is
        # ordered after it, so `started`/`complete` find the lease on record.
        self._write_behind(self._write(tr, leases=[record.to_dict()]))
        peers.start_lease(self.s, record)
        return lease

    def _offer_now(self, spec: AttemptSpec) -> bool:
        """Offer a slot of a transition committed already (a new run's first step) in
        this turn, if a session takes it now, written behind; False: announce it."""
        now = self.s.clock.time_ms()
        taken = self._take(spec, now)
        if taken is None:
            return False
        if taken is True:
            return True
        ref, who, _ = taken  # not answered: no call of its worker made this slot runnable
        made = self._made_offer(spec, who, now)
        lease = None
        if made is not None:
            tr, record, lease = made
            self._write_behind(self._write(tr, leases=[record.to_dict()]))
            peers.start_lease(self.s, record)
        peers.tell_ref_now(ref, Offered(spec, lease, now))
        return True

    def _announce(self) -> None:
        specs = self.machine.runnable()
        if specs:
            peers.announce(self.s, tuple(specs))

    # ------------------------------------------------------------------ effects

    async def _effects(self, tr: Transition, *, offer: bool = False) -> None:
        """Perform `tr`'s effects, after its commit. `offer`: its runnable slots were
        not offered ahead (a transition committed by someone else: try now)."""
        e = self.s
        for effect in tr.effects:
            if type(effect) is Runnable:
                specs = effect.attempts
                if offer and not _withdraws(tr.effects):
                    specs = tuple(spec for spec in specs if not self._offer_now(spec))
                if specs:  # none left when the step's offer rode the commit
                    peers.announce(e, specs)
                    await self._open_sessions(specs)
            elif type(effect) is Withdraw:
                peers.withdraw(e, effect.run_id, effect.slots)
            elif type(effect) is EndLeases:
                for lease_id in effect.lease_ids:
                    peers.end_lease(e, lease_id, effect.reason)
            elif type(effect) is StartChildren:
                created, self._created = self._created, []
                for child_id in created:
                    await peers.wake_run(e, child_id, None)
            elif type(effect) is CancelChildren:
                for child_id in effect.run_ids:
                    await peers.wake_run(e, child_id, InboxChanged())
            elif type(effect) is NotifyParent:
                await peers.wake_run(e, effect.parent_run_id, InboxChanged())
            elif type(effect) is RunEnded:
                stats = e.stats
                stats.runs_ended += 1
                stats.sample(stats.run_to_complete,
                             (e.clock.time_ms() - self.machine.record.created_at) / 1000)
                e.watch.ended(self.run_id)
                await self._close_sessions()

    async def _open_sessions(self, specs: Any) -> None:
        """Slots of a worker session with no holder wait in the registry: make sure the
        session's actor exists and is looking for one (AFFINITY.md "Worker sessions")."""
        for spec in specs:
            if spec.session is not None:
                break
        else:
            return
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


def _withdraws(effects: list[Any]) -> bool:
    """A `Withdraw` among `effects`: the step moved on, offer none of its slots."""
    for effect in effects:
        if type(effect) is Withdraw:
            return True
    return False
