"""The worker session actor: one registered worker's connection to the daemon, a shell over
`stepd.sansio.session.SessionMachine`.

One per registered worker (``/sessions/<worker_id>``, under the sessions
supervisor), whether it connects by WebSocket (or the in-process adapter)
or claims over HTTP. It owns what used to be spread between the engine's
push sessions, the registry's waiters and the WebSocket connection: the push
connection's credit, the HTTP claims waiting, the slots it was handed and is
turning into leases (`Offer`, asked of the slot's run), the leases its worker
holds (so a lease ended early reaches the worker as a ``cancel``), and the
worker's liveness: idle past ``worker_expiry_ms`` (no connection, no claim, no
lease) it forgets the worker and stops.

What it knows is not durable: a killed or crashed session cannot rebuild a
connection, so its next incarnation closes the connection it had (the worker
reconnects and registers again, keeping its leases: a lease belongs to the
worker) and ends the claims that waited (empty: the worker claims again).
The `SessionMemo` its child spec holds carries just that across incarnations;
`Services.push_conns` carries the connection across child specs too (a restart
of the sessions supervisor makes new ones), so every start closes the push
connection attached before it.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from stepd.actors import Actor, WouldBlock
from stepd.sansio.capabilities import WorkerCapabilities
from stepd.sansio.errors import Unavailable
from stepd.sansio.session import (
    Answer,
    ClaimReady,
    Expire,
    Offer,
    PushCancel,
    PushLease,
    Release,
    Return,
    SessionMachine,
    Subscribe,
    Unsubscribe,
)
from stepd.sansio.sticky import StickyWorker

from . import peers, store
from .messages import (
    AbandonClaim,
    Attach,
    ClaimSlots,
    Detach,
    Due,
    ForgetWorkers,
    Grant,
    LeaseEnded,
    OfferAs,
    Offered,
    ReleaseLease,
    Reregistered,
    Resubscribe,
    ResyncAll,
    ReturnSpecs,
    SessionInfo,
    SlotFor,
    StickyReport,
    TakeSlot,
    Touch,
)
from .messages import (
    Offer as OfferMsg,
)
from .messages import Subscribe as SubscribeMsg
from .messages import Unsubscribe as UnsubscribeMsg
from .services import Services
from .sticky import worker_of

__all__ = ["Outbox", "SessionActor", "SessionMemo"]

log = logging.getLogger("stepd.daemon")


class Outbox(Protocol):
    """Where a session delivers to its push connection (the transport implements it)."""

    def lease(self, lease: dict[str, Any]) -> bool:
        """Queue a lease for the worker; False when the connection is going away."""

    def cancel(self, lease_id: str, reason: str) -> None:
        """Tell the worker to stop a body (best effort: the heartbeat's 409 says it too)."""

    def close(self, reason: str) -> None:
        """The session gave the connection up: close it (the worker reconnects)."""


class SessionMemo:
    """What a session's incarnations hand on (its child spec holds it): the connection it
    had and the claims waiting, so a successor can close and end them."""

    __slots__ = ("claims", "outbox")

    def __init__(self) -> None:
        self.outbox: Outbox | None = None
        self.claims: dict[int, Callable[[list[dict[str, Any]]], None]] = {}


class SessionActor(Actor):
    kind = "session"

    def __init__(self, services: Services, worker_id: str, memo: SessionMemo) -> None:
        self.s = services
        self.worker_id = worker_id
        self.memo = memo
        self.name = ""
        self.local_steps = False
        self.sticky: StickyWorker | None = None
        #: The worker's sticky cache counts as its last complete reported them
        #: (cumulative on the worker: nothing to keep across restarts).
        self.sticky_counts: dict[str, int] | None = None
        self.machine: SessionMachine
        self._due = peers.DueTimer()

    def _read_registration(self) -> None:
        raw = self.s.storage.get(store.WORKERS, self.worker_id)
        if not isinstance(raw, dict):
            raise LookupError(f"worker {self.worker_id} is not registered")  # noqa: TRY004 - peers reads it as "not on record"
        self.name = str(raw.get("name") or "")
        self.local_steps = WorkerCapabilities.from_record(raw).supports("local_steps")
        self.sticky = worker_of(self.worker_id, raw)

    async def on_start(self) -> None:
        self._read_registration()
        self.machine = SessionMachine(self.worker_id, self.s.config.worker_expiry_ms,
                                      last_active=self.s.clock.time_ms())
        memo = self.memo
        # A push connection attached before this start cannot go on: its Attach and
        # credit may have died with an earlier incarnation (its mailbox) or with the
        # whole sessions supervisor (a new child spec, a new memo), and an idle
        # worker grants no credit again by itself. Closed, the worker reconnects,
        # registers and grants its credit afresh; its leases stay its own.
        stale = [memo.outbox]
        conn = self.s.push_conns.pop(self.worker_id, None)
        if conn is not None and conn.outbox is not memo.outbox:
            stale.append(conn.outbox)
        memo.outbox = None
        for outbox in stale:
            if outbox is not None:
                outbox.close("the worker's session restarted: reconnect")
        claims, memo.claims = memo.claims, {}
        for reply in claims.values():
            reply([])
        if self.restart_reason is not None:
            # The slots the registry handed the dead incarnation (in its hand, or
            # still in its mailbox) went with it; their runs still count them as
            # queued. Have every active run announce its queued slots again (the
            # registry ignores those it holds already).
            peers.tell(self.s, "/recovery", ResyncAll())
        self._arm()

    # ------------------------------------------------------------------ messages

    async def receive(self, message: Any) -> Any:
        # One handler per message type (a dict, not an isinstance chain: the
        # step's messages are handled on every step).
        try:
            handler = _HANDLERS[type(message)]
        except KeyError:
            raise TypeError(f"session: unexpected message {message!r}") from None
        return await handler(self, message)

    async def _take_slot(self, message: TakeSlot) -> OfferAs | None:
        # The slot's run asks, in its own turn (`ask_now`): it makes the lease
        # itself, so the `Offer` is answered as whom, not performed.
        actions = self.machine.slot(message.spec, message.claim, message.now)
        if actions and type(actions[0]) is Offer and not actions[1:]:  # one Offer: no `len`
            # No re-arm: a slot in hand only ever removes the idle expiry, and
            # the `Offered` that follows arms what is due.
            return OfferAs(self.worker_id, self.name, self.local_steps, self.sticky)
        await self._perform(actions)
        self._arm()
        return None

    async def _offered(self, message: Offered) -> None:
        now = message.now
        if message.ended is not None:  # the worker's last lease, ended by its own call
            ended = self.machine.lease_ended(message.ended, None, now)
            if ended:  # nothing, but for a cancel (never on this path): no call
                await self._perform(ended)
        await self._perform(self.machine.offered(message.spec, message.lease, now))
        self._arm()

    async def _slot_for(self, message: SlotFor) -> None:
        await self._perform(self.machine.slot(message.spec, message.claim,
                                              self.s.clock.time_ms()))
        self._arm()

    async def _lease_ended(self, message: LeaseEnded) -> None:
        await self._perform(self.machine.lease_ended(message.lease_id, message.reason,
                                                     self.s.clock.time_ms()))
        self._arm()

    async def _grant(self, message: Grant) -> None:
        m = self.machine
        now = self.s.clock.time_ms()
        if m.attached is None and message.outbox is not None:
            # Its Attach died in a killed incarnation's mailbox (the memo then
            # had no outbox to close): attach it now, or its credit is lost.
            self.memo.outbox = message.outbox
            await self._perform(m.attach(message.conn, now))
        if message.conn == m.attached:
            await self._perform(m.grant(message.n, now))
        self._arm()

    async def _attach(self, message: Attach) -> None:
        actions = self.machine.attach(message.conn, self.s.clock.time_ms())
        self.memo.outbox = message.outbox
        await self._perform(actions)
        self._arm()

    async def _detach(self, message: Detach) -> None:
        if message.conn == self.machine.attached:
            self.memo.outbox = None
        await self._perform(self.machine.detach(message.conn, self.s.clock.time_ms()))
        self._arm()

    async def _claim_slots(self, message: ClaimSlots) -> None:
        self.memo.claims[message.claim] = message.reply
        await self._perform(self.machine.claim(message.claim, message.max, message.run_id,
                                               message.deadline, self.s.clock.time_ms()))
        self._arm()

    async def _abandon_claim(self, message: AbandonClaim) -> None:
        self.memo.claims.pop(message.claim, None)
        await self._perform(self.machine.abandon(message.claim, self.s.clock.time_ms()))
        self._arm()

    async def _claim_ready(self, message: ClaimReady) -> None:
        await self._perform(self.machine.answer(message.claim))
        self._arm()

    async def _touch(self, message: Touch) -> None:
        self.machine.touch(self.s.clock.time_ms())
        self._arm()

    async def _due_fired(self, message: Due) -> None:
        self._due.fired()
        if self.machine.claims and self.has_pending():
            # Fired timers are served before the mailbox, but a claim's deadline must
            # not answer it ahead of the slots already queued for it: a `wait_ms` 0
            # claim's deadline is now, and the registry's `SlotFor`s of its queued
            # work wait in the mailbox. Tick after them (once: `_Tick` runs it).
            try:
                self.ref.tell_nowait(_TICK)
                return
            except WouldBlock:
                pass  # a full mailbox: tick now
        await self._tick(_TICK)

    async def _tick(self, message: _Tick) -> None:
        await self._perform(self.machine.tick(self.s.clock.time_ms()))
        self._arm()

    async def _reregistered(self, message: Reregistered) -> None:
        self._read_registration()
        self._arm()

    async def _resubscribe(self, message: Resubscribe) -> None:
        await self._perform(self.machine.resubscribe())
        self._arm()

    async def _info(self, message: SessionInfo) -> dict[str, Any]:
        m = self.machine
        return {"connected": m.attached is not None or bool(m.claims),
                "held": [m.held[k] for k in sorted(m.held)], "last_active": m.last_active,
                "sticky": self.sticky_counts}

    async def _sticky_report(self, message: StickyReport) -> None:
        self.sticky_counts = dict(message.counts)
        self._arm()

    # ------------------------------------------------------------------ actions

    async def _perform(self, actions: list[Any]) -> None:
        s = self.s
        for action in actions:  # by exact type: actions are final dataclasses
            if type(action) is Offer:
                await self._offer(action)
            elif type(action) is PushLease:
                outbox = self.memo.outbox
                if outbox is None or not outbox.lease(action.lease):
                    # Offered into a connection that is going away: hand the slot
                    # back now rather than after the lease TTL.
                    self.machine.lease_ended(action.lease["lease_id"], None, self.s.clock.time_ms())
                    peers.tell(s, f"/leases/{action.lease['lease_id']}", ReleaseLease())
            elif type(action) is Subscribe:
                peers.tell(s, "/registry", SubscribeMsg(self.worker_id, action.n, action.claim,
                                                       action.run_id))
            elif type(action) is Unsubscribe:
                peers.tell(s, "/registry", UnsubscribeMsg(self.worker_id, action.claim))
            elif type(action) is ClaimReady:
                if self.has_pending():
                    # More slots may be queued for this claim: answer after them,
                    # so one claim takes a batch.
                    self.ref.tell_nowait(action)
                else:
                    await self._perform(self.machine.answer(action.claim))
            elif type(action) is Answer:
                reply = self.memo.claims.pop(action.claim, None)
                if reply is not None:
                    reply(list(action.leases))
            elif type(action) is PushCancel:
                outbox = self.memo.outbox
                if outbox is not None:
                    outbox.cancel(action.lease_id, action.reason)
            elif type(action) is Release:
                peers.tell(s, f"/leases/{action.lease_id}", ReleaseLease())
            elif type(action) is Return:
                peers.tell(s, "/registry", ReturnSpecs(action.specs))
            elif type(action) is Expire:
                await self._expire()

    async def _offer(self, action: Offer) -> None:
        spec = action.spec
        try:
            lease = await peers.ask_run(self.s, spec.run_id,
                                        OfferMsg(spec, self.worker_id, self.name,
                                                 self.local_steps, self.sticky), quiet=True)
        except Unavailable:
            # Its run did not come up (a /runs kill under load): the run
            # re-announces the slot when it is back; this session goes on.
            lease = None
        await self._perform(self.machine.offered(spec, lease, self.s.clock.time_ms()))

    async def _expire(self) -> None:
        """Forget the worker: its registration goes, journals keep its id (one that
        comes back registers anew: the SDK does on the 404 its old id gets)."""
        worker_id = self.worker_id
        seen = self.s.storage.get(store.WORKERS, worker_id)
        registered_at = seen.get("registered_at") if isinstance(seen, dict) else None

        def forget_txn(t: Any) -> bool:
            raw = t.get(store.WORKERS, worker_id)
            # One that registered again meanwhile has a new `registered_at`: kept.
            if isinstance(raw, dict) and raw.get("registered_at") == registered_at:
                t.delete(store.WORKERS, worker_id)
                return True
            return False

        if await self.s.storage.write(forget_txn):
            peers.tell(self.s, "/registry", ForgetWorkers((worker_id,)))
            log.info("forgot idle worker %s (no connection, claim or lease for %d ms)",
                     worker_id, self.s.config.worker_expiry_ms)
            self.stop()
        else:
            self.machine.touch(self.s.clock.time_ms())

    def _arm(self) -> None:
        self._due.arm(self.s, self, self.machine.next_deadline())


@dataclass(frozen=True, slots=True)
class _Tick:
    """A session's deadline, handled after the messages that were queued when it fired."""


_TICK = _Tick()

_HANDLERS: dict[type, Callable[[SessionActor, Any], Awaitable[Any]]] = {
    _Tick: SessionActor._tick,
    TakeSlot: SessionActor._take_slot,
    Offered: SessionActor._offered,
    SlotFor: SessionActor._slot_for,
    LeaseEnded: SessionActor._lease_ended,
    Grant: SessionActor._grant,
    Attach: SessionActor._attach,
    Detach: SessionActor._detach,
    ClaimSlots: SessionActor._claim_slots,
    AbandonClaim: SessionActor._abandon_claim,
    ClaimReady: SessionActor._claim_ready,
    Touch: SessionActor._touch,
    Due: SessionActor._due_fired,
    Reregistered: SessionActor._reregistered,
    Resubscribe: SessionActor._resubscribe,
    SessionInfo: SessionActor._info,
    StickyReport: SessionActor._sticky_report,
}
