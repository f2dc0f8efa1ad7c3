"""The worker session machine: one registered worker's connection to the daemon, sans I/O.

A worker reaches the daemon over a push connection (a WebSocket, or the
in-process adapter of an embedded daemon) that grants *credit*, or by HTTP
long-poll *claims*. Either way the daemon needs one place that knows, for
that worker: where to deliver a lease (the attached connection, or which
claim waits), how many more it may take, which runnable slots it was handed
and is turning into leases right now, which leases it holds, where a
``cancel`` goes when one of them ends early, and whether the worker is still
around at all. That is this machine; the session actor
(`stepd.actors.daemon.session`) is its shell (STYLE.md rule 1: events in,
actions out, time passed in, no I/O).

Events are methods; each returns the actions the shell performs, in order:

* `Subscribe` / `Unsubscribe`: tell the registry how many slots this worker
  takes now (push credit, or one claim's ``max``), or that a claim left;
* `Offer`: ask the slot's run for a lease (the run may refuse: the slot moved on);
* `PushLease` / `PushCancel`: write to the attached connection;
* `ClaimReady`, then `answer`: end a waiting claim with the leases it got;
* `Release`: a lease that can no longer be delivered (its connection or claim
  went away): hand it back at once instead of after its TTL;
* `Return`: slots this session was handed but can no longer take;
* `Expire`: the worker has been idle past its expiry: forget it.

A lease belongs to the worker, not to the connection (PROTOCOL.md): when a
connection is replaced the held leases stay; only undelivered slots and
credit are tied to the connection that granted them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Final

from .events import AttemptSpec
from .frozen import frozen

__all__ = [
    "ANSWER",
    "Answer",
    "ClaimReady",
    "Expire",
    "FrameOrder",
    "Offer",
    "PushCancel",
    "PushLease",
    "Release",
    "Return",
    "SessionMachine",
    "Subscribe",
    "Unsubscribe",
]

SlotKey = tuple[str, str, "int | None"]  # (run_id, step_id, item_index)

ANSWER: Final = -1
"""The claim of a slot that goes out in the answer to its worker's own call (a
``complete`` with ``claim_next``), not to a push connection or a waiting claim: the
slot the completed lease frees takes it, so neither credit nor a claim is used."""


def _held(lease: dict[str, Any]) -> dict[str, Any]:
    # Spelled out, not a comprehension of .get: one per lease offered (a lease the
    # run made has every key; a partial one, in tests, gets None for the missing).
    try:
        return {"lease_id": lease["lease_id"], "run_id": lease["run_id"],
                "step_id": lease["step_id"], "item_index": lease["item_index"],
                "attempt": lease["attempt"], "fence": lease["fence"]}
    except KeyError:
        get = lease.get
        return {"lease_id": get("lease_id"), "run_id": get("run_id"), "step_id": get("step_id"),
                "item_index": get("item_index"), "attempt": get("attempt"),
                "fence": get("fence")}


def slot_of(spec: AttemptSpec) -> SlotKey:
    return (spec.run_id, spec.step_id, spec.item_index)


# --------------------------------------------------------------------------- actions


@frozen
class Subscribe:
    """Tell the registry this worker takes `n` more slots (push credit, or one claim)."""

    n: int
    claim: int | None = None  # the claim they are for (None: the push connection)
    run_id: str | None = None  # only this run's slots (a claim's filter)


@frozen
class Unsubscribe:
    """Withdraw what was subscribed: the push credit (claim None) or one claim."""

    claim: int | None = None


@frozen
class Offer:
    """Ask the slot's run for a lease for this worker; `offered` reports the outcome."""

    spec: AttemptSpec
    claim: int | None


@frozen
class PushLease:
    lease: dict[str, Any]


@frozen
class PushCancel:
    lease_id: str
    reason: str  # "fenced" | "run_terminal"


@frozen
class Answer:
    """End a waiting claim with the leases it got (possibly none)."""

    claim: int
    leases: tuple[dict[str, Any], ...]


@frozen
class ClaimReady:
    """A claim has leases and no offer under way: `answer` it (now, or after the
    slots already queued for it are in, so one claim takes a batch)."""

    claim: int


@frozen
class Release:
    """A lease issued for a connection or claim that is gone: give it back now."""

    lease_id: str


@frozen
class Return:
    """Slots handed to this session that it can no longer take: queue them again."""

    specs: tuple[AttemptSpec, ...]


@frozen
class Expire:
    """Idle past the expiry: forget the worker (its journals keep its id)."""


Action = (Subscribe | Unsubscribe | Offer | PushLease | PushCancel | Answer | ClaimReady | Release
          | Return | Expire)


# --------------------------------------------------------------------------- the machine


@dataclass(slots=True)
class _Claim:
    max: int
    run_id: str | None
    deadline: int
    leases: list[dict[str, Any]] = field(default_factory=list)
    pending: int = 0  # slots handed for it whose offer is under way


@dataclass(slots=True)
class SessionMachine:
    """One worker's session. See the module docstring.

    Attributes:
        worker_id: the worker.
        expiry_ms: forget the worker after this long idle (0: never).
        attached: the push connection's id, or None.
        credit: push credit granted and not yet handed a slot.
        held: lease id -> what the workers list shows of it, for the leases this worker holds.
        last_active: when the worker last did anything (ms).
    """

    worker_id: str
    expiry_ms: int
    last_active: int
    attached: int | None = None
    credit: int = 0
    held: dict[str, dict[str, Any]] = field(default_factory=dict)
    claims: dict[int, _Claim] = field(default_factory=dict)
    in_hand: dict[SlotKey, int | None] = field(default_factory=dict)  # slot -> claim (None: push)

    # ------------------------------------------------------------------ queries

    def idle(self) -> bool:
        """No connection, no claim, no lease held, no slot in hand: expiry may run."""
        return self.attached is None and not self.claims and not self.held and not self.in_hand

    def next_deadline(self) -> int | None:
        """When `tick` has something to do: the earliest claim deadline, or the expiry."""
        # Read after every message: no generator over an empty dict (the push path has no claims).
        if self.attached is not None and not self.claims:
            return None  # a push connection holds it: not idle, no claim (every step's case)
        due = min([c.deadline for c in self.claims.values()]) if self.claims else None
        if self.idle() and self.expiry_ms > 0:
            expiry = self.last_active + self.expiry_ms
            due = expiry if due is None else min(due, expiry)
        return due

    def holds(self, lease_id: str) -> bool:
        return lease_id in self.held

    # ------------------------------------------------------------------ connection and credit

    def attach(self, conn: int, now: int) -> list[Action]:
        """A push connection registered as this worker (replacing any earlier one)."""
        self.last_active = now
        out: list[Action] = []
        if self.attached is not None and self.credit:
            out.append(Unsubscribe())
        self.attached = conn
        self.credit = 0  # the new connection grants its own
        return out

    def detach(self, conn: int, now: int) -> list[Action]:
        """A push connection ended; a later one may have replaced it already."""
        if self.attached != conn:
            return []
        self.last_active = now
        self.attached = None
        out: list[Action] = []
        if self.credit:
            out.append(Unsubscribe())
        self.credit = 0
        return out

    def grant(self, n: int, now: int) -> list[Action]:
        """The attached connection grants `n` more leases (the WebSocket ``credit`` frame)."""
        self.last_active = now
        if self.attached is None or n <= 0:
            return []
        self.credit += n
        return [Subscribe(n)]

    # ------------------------------------------------------------------ claims

    def claim(self, claim: int, max_n: int, run_id: str | None, deadline: int,
              now: int) -> list[Action]:
        """An HTTP long-poll claim: up to `max_n` leases, answered at `deadline` at the latest."""
        self.last_active = now
        self.claims[claim] = _Claim(max_n, run_id, deadline)
        return [Subscribe(max_n, claim, run_id)]

    def abandon(self, claim: int, now: int) -> list[Action]:
        """The claimant went away before its answer (its request was cut)."""
        self.last_active = now
        c = self.claims.pop(claim, None)
        if c is None:
            return []
        return [Unsubscribe(claim), *(Release(lease["lease_id"]) for lease in c.leases)]

    # ------------------------------------------------------------------ slots and leases

    def slot(self, spec: AttemptSpec, claim: int | None, now: int) -> list[Action]:
        """The registry hands this session one runnable slot (for a claim, push credit, or
        the answer to its worker's own call: `ANSWER`)."""
        if claim is None:
            if self.attached is None:
                return [Return((spec,))]  # the connection went away meanwhile
            if self.credit > 0:
                self.credit -= 1
        elif claim != ANSWER:
            c = self.claims.get(claim)
            if c is None:
                return [Return((spec,))]  # the claim was answered or abandoned meanwhile
            c.pending += 1
        self.in_hand[(spec.run_id, spec.step_id, spec.item_index)] = claim  # slot_of(spec)
        return [Offer(spec, claim)]

    def offered(self, spec: AttemptSpec, lease: dict[str, Any] | None, now: int) -> list[Action]:
        """The run answered an `Offer`: a lease, or None (the slot had moved on)."""
        claim = self.in_hand.pop((spec.run_id, spec.step_id, spec.item_index), None)
        out: list[Action] = []
        if claim is None:  # push credit
            if lease is None:
                if self.attached is not None:  # the credit is still the worker's
                    self.credit += 1
                    out.append(Subscribe(1))
                return out
            if self.attached is None:
                return [Release(lease["lease_id"])]
            self.held[lease["lease_id"]] = _held(lease)
            return [PushLease(lease)]
        if claim == ANSWER:  # the worker's call answers with it: only held here
            if lease is not None:
                self.held[lease["lease_id"]] = _held(lease)
            return out
        c = self.claims.get(claim)
        if c is None:
            return [] if lease is None else [Release(lease["lease_id"])]
        c.pending -= 1
        if lease is not None:
            self.held[lease["lease_id"]] = _held(lease)
            c.leases.append(lease)
        if c.pending == 0:
            if c.leases:
                out.append(ClaimReady(claim))
            else:  # every slot it was handed had moved on: it waits on
                out.append(Subscribe(c.max, claim, c.run_id))
        return out

    def answer(self, claim: int) -> list[Action]:
        """End a ready claim (`ClaimReady`) with the leases it got; nothing if it moved on."""
        c = self.claims.get(claim)
        if c is None or c.pending or not c.leases:
            return []
        del self.claims[claim]
        return [Unsubscribe(claim), Answer(claim, tuple(c.leases))]

    def lease_ended(self, lease_id: str, reason: str | None, now: int) -> list[Action]:
        """A lease of this worker ended; `reason` fenced/run_terminal ends it early."""
        if now > self.last_active:  # noqa: PLR1730 - `max`, written out (a lease ends every step)
            self.last_active = now
        if self.held.pop(lease_id, None) is None:
            return []
        if reason in ("fenced", "run_terminal") and self.attached is not None:
            return [PushCancel(lease_id, reason)]
        return []

    def touch(self, now: int) -> None:
        """The worker called on one of its leases."""
        self.last_active = now

    # ------------------------------------------------------------------ time

    def tick(self, now: int) -> list[Action]:
        """Answer the claims whose deadline came; expire an idle worker."""
        out: list[Action] = []
        for claim, c in list(self.claims.items()):
            if c.deadline <= now and c.pending == 0:
                del self.claims[claim]
                out.append(Unsubscribe(claim))
                out.append(Answer(claim, tuple(c.leases)))
        if self.idle() and self.expiry_ms > 0 and now >= self.last_active + self.expiry_ms:
            out.append(Expire())
        return out

    def resubscribe(self) -> list[Action]:
        """The registry restarted and forgot every subscription: make them again."""
        out: list[Action] = []
        if self.attached is not None and self.credit:
            out.append(Subscribe(self.credit))
        for claim, c in self.claims.items():
            left = c.max - len(c.leases) - c.pending
            if left > 0:
                out.append(Subscribe(left, claim, c.run_id))
        return out


class FrameOrder:
    """The frames of one lease are applied in the order they arrived; other leases' run beside.

    A worker may send ``complete`` right behind ``started`` without waiting for
    its answer; applied out of order, an at_most_once ``complete`` would find
    its attempt not started. Sans I/O: `arrive` numbers a frame and says which
    earlier frame of the same lease it must wait for (None: run it now);
    `done` retires a frame. The shell holds the waits.
    """

    __slots__ = ("_last", "_next")

    def __init__(self) -> None:
        self._last: dict[str, int] = {}  # lease id -> the last frame that arrived for it
        self._next = 0

    def arrive(self, lease_id: str | None) -> tuple[int, int | None]:
        """A frame for `lease_id` arrived: its ticket, and the ticket it waits for."""
        self._next += 1
        ticket = self._next
        if lease_id is None:
            return ticket, None
        before = self._last.get(lease_id)
        self._last[lease_id] = ticket
        return ticket, before

    def done(self, lease_id: str | None, ticket: int) -> None:
        """The frame `ticket` was applied (or failed): later frames of its lease may go."""
        if lease_id is not None and self._last.get(lease_id) == ticket:
            del self._last[lease_id]

    def __len__(self) -> int:
        return len(self._last)
