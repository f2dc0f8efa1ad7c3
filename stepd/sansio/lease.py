"""The lease state machine and the 409 precedence rule, sans I/O.

A lease is one attempt held by one worker for bounded time (PROTOCOL.md
"Lease"). Its life:

    offered --started--> started --complete--> completed
       |                    |   \\--fail-----> failed
       |                    |
       +--(no heartbeat for lease_ttl_ms)--> orphaned
                               | heartbeat/started/complete/fail inside
                               |   recovery_window_ms: revived (back to
                               |   offered or started, then the call applies)
                               +--(window passes)--> fenced (recovered)

and from any live state the run can end it: `fenced` (a later attempt
supersedes it, or the step timed out) or `run_terminal` (the run is over).

Two pieces live here:

* `reject_reason`: the one function that decides which of the four 409
  reasons a worker call gets, with PROTOCOL.md's precedence. The lease actor
  asks it of its in-memory record, and the storage transaction asks it again
  of the durable record (STYLE.md rule 16), so the two cannot drift.
* `LeaseMachine`: expiry and recovery timing. Time is passed in; the machine
  exposes `next_deadline()` and the actor arms one timer for it (rule 4).
  `orphaned` is never persisted: after a daemon restart every live lease gets a
  full TTL again (issue: "a restart does not mass-expire healthy workers").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .enums import IdentityEnum
from .errors import IllegalTransition


class LeaseStatus(IdentityEnum):
    OFFERED = "offered"
    STARTED = "started"
    ORPHANED = "orphaned"  # in memory only
    COMPLETED = "completed"  # ended by this lease's own `complete`
    FAILED = "failed"  # ended by this lease's own `fail` (unservable included)
    FENCED = "fenced"  # superseded: recovered, timed out, or another lease ended the slot
    RUN_TERMINAL = "run_terminal"  # the run ended while this lease was live

    #: Offered, started or orphaned: a plain attribute per member, not a property.
    live: bool

    def __init__(self, value: str) -> None:
        super().__init__(value)
        self.live = value in ("offered", "started", "orphaned")


_LIVE = frozenset(s for s in LeaseStatus if s.live)
#: By stored value: `LeaseStatus(value)` is two Python calls (the enum's `__call__`
#: and `__new__`), and the writer reads a lease record on every worker call.
_BY_VALUE: dict[str, LeaseStatus] = {s.value: s for s in LeaseStatus}


class Op(IdentityEnum):
    STARTED = "started"
    HEARTBEAT = "heartbeat"
    COMPLETE = "complete"
    FAIL = "fail"


# The members the per-step paths below test, as module names. On 3.11 `EnumType`
# defines `__getattr__`, so a lookup on an Enum class (`LeaseStatus.FENCED`) takes
# the slot hook and calls `type.__getattribute__` as a Python-level attribute:
# ~1,400 instructions (callgrind) and ~100 ns, against ~10 ns for a global
# (bench/README.md, "Enum lookups"). ~20 of them a step here.
_OFFERED, _STARTED, _ORPHANED = LeaseStatus.OFFERED, LeaseStatus.STARTED, LeaseStatus.ORPHANED
_COMPLETED, _FAILED = LeaseStatus.COMPLETED, LeaseStatus.FAILED
_FENCED, _RUN_TERMINAL = LeaseStatus.FENCED, LeaseStatus.RUN_TERMINAL
_OP_STARTED, _OP_HEARTBEAT = Op.STARTED, Op.HEARTBEAT
_OP_COMPLETE, _OP_FAIL = Op.COMPLETE, Op.FAIL


#: The closed list of 409 reasons on worker calls, in precedence order.
REASONS = ("already_applied", "fenced", "run_terminal", "not_started")


@dataclass(slots=True)
class LeaseRecord:
    """The durable lease (table `leases`), keyed by lease id."""

    lease_id: str
    run_id: str
    step_id: str
    item_index: int | None
    fence: int
    attempt: int
    worker_id: str
    worker_name: str
    delivery: str
    status: LeaseStatus = LeaseStatus.OFFERED
    started: bool = False
    offered_at: int = 0
    ended_at: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "lease_id": self.lease_id,
            "run_id": self.run_id,
            "step_id": self.step_id,
            "item_index": self.item_index,
            "fence": self.fence,
            "attempt": self.attempt,
            "worker_id": self.worker_id,
            "worker_name": self.worker_name,
            "delivery": self.delivery,
            # `orphaned` is a timing state, not a durable one.
            "status": (
                (_STARTED if self.started else _OFFERED).text
                if self.status is _ORPHANED
                else self.status.text
            ),
            "started": self.started,
            "offered_at": self.offered_at,
            "ended_at": self.ended_at,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LeaseRecord:
        return cls(
            lease_id=d["lease_id"],
            run_id=d["run_id"],
            step_id=d["step_id"],
            item_index=d["item_index"],
            fence=d["fence"],
            attempt=d["attempt"],
            worker_id=d["worker_id"],
            worker_name=d["worker_name"],
            delivery=d["delivery"],
            status=_BY_VALUE.get(d["status"]) or LeaseStatus(d["status"]),
            started=d["started"],
            offered_at=d["offered_at"],
            ended_at=d["ended_at"],
        )


def reject_reason(
    lease: LeaseRecord, op: Op, *, run_terminal: bool, current_fence: int | None
) -> str | None:
    """Which 409 reason a worker call on `lease` gets, or None to accept it.

    PROTOCOL.md "The four rejections": when several apply, the first in the
    table wins: already_applied, fenced, run_terminal, not_started.

    Args:
        lease: the lease as last persisted (or as held in memory).
        op: the call.
        run_terminal: the run is completed, failed, cancelled or timed out.
        current_fence: the run's latest fence for this lease's slot; a larger
            one means a later attempt exists (None: unknown, skip the check).
    """
    status = lease.status
    if status is _COMPLETED or status is _FAILED:
        return "already_applied"
    if status is _FENCED or (current_fence is not None and current_fence > lease.fence):
        return "fenced"
    if status is _RUN_TERMINAL or run_terminal:
        return "run_terminal"
    if (
        (op is _OP_COMPLETE or op is _OP_FAIL)
        and lease.delivery == "at_most_once"
        and not lease.started
    ):
        return "not_started"
    return None


# --------------------------------------------------------------------------- the table

_O, _S, _R = _OFFERED, _STARTED, _ORPHANED

#: (status, trigger) -> next status. `revive` returns to offered or started
#: (whichever the lease was), so its target is None here. A pair that is not
#: listed raises IllegalTransition and changes nothing.
LEASE_TRANSITIONS: dict[tuple[LeaseStatus, str], LeaseStatus | None] = {
    (_O, "started"): _S,
    (_O, "heartbeat"): _O,
    (_S, "started"): _S,
    (_S, "heartbeat"): _S,
    (_O, "expire"): _R,
    (_S, "expire"): _R,
    (_R, "revive"): None,
    (_R, "recover"): LeaseStatus.FENCED,
}
for _live in (_O, _S, _R):
    LEASE_TRANSITIONS[(_live, "complete")] = LeaseStatus.COMPLETED
    LEASE_TRANSITIONS[(_live, "fail")] = LeaseStatus.FAILED
    LEASE_TRANSITIONS[(_live, "fence")] = LeaseStatus.FENCED
    LEASE_TRANSITIONS[(_live, "run_end")] = LeaseStatus.RUN_TERMINAL
del _live

_END_TRIGGER = {
    LeaseStatus.COMPLETED: "complete",
    LeaseStatus.FAILED: "fail",
    LeaseStatus.FENCED: "fence",
    LeaseStatus.RUN_TERMINAL: "run_end",
}


def _step(status: LeaseStatus, trigger: str, lease_id: str) -> LeaseStatus | None:
    try:
        return LEASE_TRANSITIONS[(status, trigger)]
    except KeyError:
        raise IllegalTransition(f"lease {lease_id}: {trigger} is not allowed when {status.value}") from None


def lease_mermaid() -> str:
    """The lease table as a Mermaid state diagram (docs/leases.md)."""
    lines = ["stateDiagram-v2", "    [*] --> offered: claim"]
    for (src, trigger), dst in LEASE_TRANSITIONS.items():
        if dst is None:
            lines.append(f"    {src.value} --> offered: {trigger} (never started)")
            lines.append(f"    {src.value} --> started: {trigger} (had started)")
        else:
            lines.append(f"    {src.value} --> {dst.value}: {trigger}")
    for end in (LeaseStatus.COMPLETED, LeaseStatus.FAILED, LeaseStatus.FENCED, LeaseStatus.RUN_TERMINAL):
        lines.append(f"    {end.value} --> [*]")
    return "\n".join(lines)


# --------------------------------------------------------------------------- timing


@dataclass(frozen=True, slots=True)
class Orphaned:
    """The lease expired: journal `step_orphaned`, start the recovery window."""


@dataclass(frozen=True, slots=True)
class Revived:
    """A call arrived inside the recovery window: journal `step_revived`."""


@dataclass(frozen=True, slots=True)
class Recover:
    """The recovery window passed: hand the attempt back to the run (`AttemptLost`)."""

    started: bool


TimingAction = Orphaned | Revived | Recover


class LeaseMachine:
    """Expiry, orphaning, revival and recovery of one live lease.

    The machine holds the lease record and two times: `expires_at` (last
    heartbeat or issue plus the TTL) and, once orphaned, `recover_at`.
    """

    __slots__ = ("expires_at", "record", "recover_at", "ttl_ms", "window_ms")

    def __init__(self, record: LeaseRecord, *, ttl_ms: int, window_ms: int, now: int) -> None:
        self.record = record
        self.ttl_ms = ttl_ms
        self.window_ms = window_ms
        self.expires_at = now + ttl_ms
        self.recover_at: int | None = None

    @property
    def status(self) -> LeaseStatus:
        return self.record.status

    def next_deadline(self) -> int | None:
        if self.record.status is LeaseStatus.ORPHANED:
            return self.recover_at
        if self.record.status.live:
            return self.expires_at
        return None

    def touch(self, op: Op, now: int) -> list[TimingAction]:
        """A call the durable check accepted arrived: extend, or revive first.

        Raises:
            IllegalTransition: the lease is not live (the caller should have
                answered with `reject_reason`).
        """
        r = self.record
        if not r.status.live:
            raise IllegalTransition(f"lease {r.lease_id} is {r.status.value}")
        actions: list[TimingAction] = []
        if r.status is _ORPHANED:
            _step(r.status, "revive", r.lease_id)
            r.status = _STARTED if r.started else _OFFERED
            self.recover_at = None
            actions.append(Revived())
        if op is _OP_STARTED or op is _OP_HEARTBEAT:
            nxt = _step(r.status, op.text, r.lease_id)
            assert nxt is not None
            r.status = nxt
            if op is _OP_STARTED:
                r.started = True
        self.expires_at = now + self.ttl_ms
        return actions

    def tick(self, now: int) -> list[TimingAction]:
        """Time passed: expire or recover as due."""
        r = self.record
        if r.status in (LeaseStatus.OFFERED, LeaseStatus.STARTED) and now >= self.expires_at:
            r.status = _step(r.status, "expire", r.lease_id) or r.status
            self.recover_at = now + self.window_ms
            if self.window_ms > 0:
                return [Orphaned()]
            return [Orphaned(), *self.tick(now)]
        if r.status is LeaseStatus.ORPHANED and self.recover_at is not None and now >= self.recover_at:
            r.status = _step(r.status, "recover", r.lease_id) or r.status
            r.ended_at = now
            self.recover_at = None
            return [Recover(started=r.started)]
        return []

    def end(self, status: LeaseStatus, now: int) -> None:
        """The lease ended (its own complete/fail, or the run superseded it)."""
        if status not in _END_TRIGGER:  # `in`, then a subscript: no `get` call (a step each)
            raise IllegalTransition(f"cannot end lease {self.record.lease_id} as {status.value}")
        trigger = _END_TRIGGER[status]
        nxt = _step(self.record.status, trigger, self.record.lease_id)
        assert nxt is status
        self.record.status = status
        self.record.ended_at = now
        self.recover_at = None

    def rearm(self, now: int) -> None:
        """After a daemon restart: a full TTL from now (PROTOCOL.md; issue L5)."""
        if self.record.status.live:
            self.record.status = LeaseStatus.STARTED if self.record.started else LeaseStatus.OFFERED
            self.expires_at = now + self.ttl_ms
            self.recover_at = None
