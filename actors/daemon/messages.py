"""Messages between the daemon's actors: frozen, slotted dataclasses (STYLE.md rule 12).

Who sends what (asks that wait only go run-ward, so no cycle of asks can deadlock):

* API -> lease actor: `LeaseCall` (ask)
* lease actor -> run actor: `ApplyAttempt` (ask), `AttemptNote` (tell)
* session actor -> run actor: `Offer` (ask)
* API -> run actor: `Signal`, `CancelRun`, `RetryRun` (asks); recovery -> run: `Resync`, `InboxChanged`
* run actor -> lease actor: `EndLease`; -> registry: `Announce`, `WithdrawSlots`
* lease actor -> session actor: `LeaseEnded`
* API / connections -> session actor: `Attach`, `Detach`, `Grant`, `ClaimSlots`,
  `AbandonClaim`, `Touch`, `Resubscribe`, `Forget`
* registry -> session actor: `SlotFor`
* run actor -> registry: `Route`; -> session actor: `TakeSlot`, `Offered` (all `ask_now`,
  in the run's own turn: the next step's slot offered with no dispatcher turn)
* session actor -> registry: `Subscribe`, `Unsubscribe`, `ReturnSpecs`
* API -> registry: `RegisterWorker`, `ForgetWorkers`, `RegistryStats`
* run actor -> timer actor: `TimerIndexChanged`; lease actor -> timer actor: `LeasesDueBy`;
  timer actor -> lease actors: `Due` (its lease sweep)
* timers: each actor's own `Due`
* work session -> run actor: `SessionNote` (ask); -> worker session: `SessionInfo` (ask)
* run actor -> work session: `EnsureHolder`, `CloseSession`; API -> work session:
  `RenewSession`, `ReleaseSession` (asks)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from stepd.sansio.events import AttemptSpec
from stepd.sansio.frozen import frozen
from stepd.sansio.lease import Op
from stepd.sansio.sticky import StickyWorker


@frozen
class Due:
    """An actor's own timer fired."""


@frozen
class IdleCheck:
    """Sent by a run actor to itself after start: passivate if nothing is queued."""


# --------------------------------------------------------------------------- leases


@frozen
class LeaseCall:
    op: Op
    # The call's parsed body: progress, error; a complete's holds every field of
    # `lease.COMPLETE_FIELDS` (None when not sent), read by subscript.
    body: Any = None
    # The worker registered on the connection the call came in on, when the
    # transport knows it (WebSocket, in process); None over plain HTTP.
    caller: str | None = None
    # Names this call (unique in the process): written into the lease record
    # with the outcome it lands, so a retry after its actor died can tell its
    # own landed outcome (answered 200) from an earlier call's (409).
    token: int = 0


@frozen
class ReleaseLease:
    """The lease never reached its worker: if it is still only offered, requeue its slot now."""


@frozen
class EndLease:
    """The run ended this lease (fenced by a later attempt, or the run is over)."""

    reason: str  # "fenced" | "run_terminal"


# --------------------------------------------------------------------------- runs


@frozen
class Offer:
    """Turn a queued slot into a lease for this worker (None: the slot moved on)."""

    spec: AttemptSpec
    worker_id: str
    worker_name: str
    local_steps: bool = False  # the worker declared local_steps: its lease carries the plan
    sticky: StickyWorker | None = None  # the worker declared sticky execution


@frozen
class ApplyAttempt:
    """A lease call that changes the run: persist it under the durable guard, then answer.

    `lease` is the updated lease record to store in the same transaction.
    `started` is set when an at_least_once worker folded its `started` into this
    `complete` or `fail` (docs/leases.md "A folded started"): the run applies
    that event first, written behind, so both ride one commit.
    """

    lease_id: str
    op: Op
    lease: Any  # dict: the updated lease record
    event: Any
    started: Any = None  # AttemptStarted, or None
    claim_next: bool = False  # a complete asking for its worker's next lease in its answer


@frozen
class AttemptNote:
    """A lease event the run records without anyone waiting (orphaned, revived, lost)."""

    lease_id: str
    event: Any
    lease: Any = None  # dict: the lease record to store with it (recovered: fenced)


@frozen
class Signal:
    name: str
    payload: Any = None
    audit: Any = None  # an AuditEntry written in the signal's transaction


@frozen
class CancelRun:
    message: str = "cancelled"
    audit: Any = None  # an AuditEntry written in the cancel's transaction


@frozen
class RetryRun:
    """Resume a failed run at its failed step (answered with its status and that step)."""

    audit: Any = None  # an AuditEntry written in the retry's transaction


@frozen
class Resync:
    """Re-announce queued slots and make sure every live lease has its actor."""


@frozen
class ResyncAll:
    """To recovery: send every active run a `Resync` (a restarted session lost the
    slots the registry had handed it, in its hand or still in its mailbox)."""


@frozen
class InboxChanged:
    """Messages wait in the run's durable inbox (a child finished, a parent cancelled)."""


# --------------------------------------------------------------------------- registry


@frozen
class Announce:
    """These slots are runnable: hand each to exactly one worker session."""

    specs: tuple[AttemptSpec, ...]


@frozen
class WithdrawSlots:
    run_id: str
    slots: tuple[tuple[str, int | None], ...] | None = None  # None: every slot of the run


@frozen
class ReturnSpecs:
    """Slots taken back (a session could not take them): queue them again, ahead."""

    specs: tuple[AttemptSpec, ...]


@frozen
class RegisterWorker:
    worker_id: str
    name: str
    keys: frozenset[tuple[str, str | None, str]]  # (workflow, version, body)


@frozen
class ForgetWorkers:
    """Workers expired for idleness: route nothing to them."""

    worker_ids: tuple[str, ...]


@frozen
class Route:
    """Asked of the registry by a run in its own turn (`ask_now`): which session takes
    this slot now, ``(worker_id, claim)``, counted as handed to it; None: announce it.

    `answer_to`: the worker whose own call (a ``complete`` with ``claim_next``) made
    the slot runnable; if it serves the slot, it takes it in that call's answer
    (claim `ANSWER`), ahead of every subscription, in the slot its lease frees.
    """

    spec: AttemptSpec
    answer_to: str | None = None


@frozen
class Subscribe:
    """A worker session takes `n` more slots: its push credit (claim None) or one claim."""

    worker_id: str
    n: int
    claim: int | None = None
    run_id: str | None = None  # only this run's slots


@frozen
class Unsubscribe:
    """Withdraw a session's push credit (claim None), one claim, or everything (`all`)."""

    worker_id: str
    claim: int | None = None
    all: bool = False


@frozen
class RegistryStats:
    """Ask for the registry's counts (for /metrics)."""


# --------------------------------------------------------------------------- sessions


@frozen
class Attach:
    """A push connection registered as this worker: deliver its leases and cancels to `outbox`."""

    conn: int
    outbox: Any  # session.Outbox


@frozen
class Detach:
    conn: int


@frozen
class Grant:
    """The attached connection grants `n` more leases (credit). It carries the outbox
    too: if its `Attach` died in the mailbox of a killed incarnation, the session
    attaches it now instead of ignoring its credit forever."""

    conn: int
    n: int
    outbox: Any = None  # session.Outbox


@frozen
class ClaimSlots:
    """An HTTP claim: up to `max` leases by `deadline` (ms), answered through `reply`."""

    claim: int
    max: int
    run_id: str | None
    deadline: int
    reply: Callable[[list[dict[str, Any]]], None]


@frozen
class AbandonClaim:
    claim: int


@frozen
class SlotFor:
    """The registry hands this session a runnable slot, for a claim or its push credit."""

    spec: AttemptSpec
    claim: int | None


@frozen
class TakeSlot:
    """`SlotFor`, asked by the slot's run in its own turn (`ask_now`): the session takes
    the slot and answers as whom the run is to offer it (`OfferAs`), or None (it gave
    the slot back); the run then offers it and hands over the lease (`Offered`).

    `now`: the run's clock reading in this turn, the session's too (the same
    instant: the session reads no clock of its own).
    """

    spec: AttemptSpec
    claim: int | None
    now: int


@frozen
class OfferAs:
    """Who a session's worker is, for the lease a run offers it (see `Offer`)."""

    worker_id: str
    worker_name: str
    local_steps: bool
    sticky: StickyWorker | None


@frozen
class Offered:
    """The run's answer to a `TakeSlot`: the lease, or None (the slot moved on).

    `ended`: a lease of the same worker that the same commit ended by the
    worker's own complete or fail, told here instead of by its lease actor
    (`LeaseEnded` without a reason): the step's next lease and its last one's
    end reach the session in one message.

    `now`: when the run made (or gave up) the offer, which the session takes as
    the time of its worker's activity rather than reading the clock again (the
    hand-over follows the offer by the commit between them, and the session
    only ever moves its idle clock forward with it).
    """

    spec: AttemptSpec
    lease: dict[str, Any] | None
    now: int
    ended: str | None = None


@frozen
class LeaseEnded:
    """A lease of this worker ended; `reason` fenced / run_terminal ends it early."""

    lease_id: str
    reason: str | None


@frozen
class Touch:
    """The worker called on one of its leases (liveness)."""


@frozen
class Resubscribe:
    """The registry restarted: subscribe again with what this session still takes."""


@frozen
class StickyReport:
    """A worker's sticky cache counts, as its last ``complete`` reported them (cumulative)."""

    counts: Any  # dict[str, int]: hit, miss, eviction, forced_cold_replay


@frozen
class History:
    """GET /v1/api/steps/{lease}/history: the run's full history, fenced to this live lease."""

    lease_id: str
    step_id: str
    item_index: int | None
    fence: int


@frozen
class SessionInfo:
    """Ask a session what it knows (workers list, expiry decisions)."""


@frozen
class Reregistered:
    """The worker registered again under its id: the session rereads its registration
    (name, capabilities, build id, sticky settings), so a worker that dropped ``local_steps``
    gets no more plans and one that changed its sticky settings is offered by the new ones."""


# --------------------------------------------------------------------------- timers


@frozen
class TimerIndexChanged:
    """A passivated run's deadline is on record at `due` (ms): wake for it if sooner."""

    due: int


@frozen
class LeasesDueBy:
    """A lease actor left its expiry timer unarmed (lease.py "lazy expiry"): the
    timer actor must sweep the live leases by `due` (ms), if not sooner."""

    due: int


@frozen
class SweepLeases:
    """The timer actor's own lease-sweep timer fired."""


# --------------------------------------------------------------------------- worker sessions
# (AFFINITY.md "Worker sessions": /sessions/ws_<run id>.<name>, one per run and session name)


@frozen
class SessionNote:
    """Work session -> run actor (ask): a `SessionChanged` event for its machine."""

    event: Any  # stepd.sansio.events.SessionChanged


@frozen
class EnsureHolder:
    """To a work session: tell the run where it stands and look for a holder if it has none."""


@frozen
class RenewSession:
    """API -> work session (ask): the holder renews its authority."""

    worker_id: str


@frozen
class ReleaseSession:
    """API -> work session (ask): the holder closes it (a graceful stop)."""

    worker_id: str


@frozen
class CloseSession:
    """Run actor -> work session: the run is over."""
