"""One worker session ("affinity session", `WorkSession`): its state machine, sans I/O.

AFFINITY.md "Worker sessions". A session pins a run's steps of one named
session (`session_spec.SessionSpec`) to one worker, the *holder*. Its record
is durable; this machine takes an event and ``now`` (ms) and returns the
effects for its actor shell, which persists the record first, then performs
them (STYLE.md rules 1 and 17). Timers stay in the shell: it arms one at
`next_deadline()`.

States (a table, `TRANSITIONS`; an event not listed raises `IllegalTransition`
and changes nothing):

* ``pending``: no holder; the shell looks for a worker whose manifest
  resources match and that has a free slot of its ``max_sessions``, and feeds
  `Acquired`.
* ``held``: a holder with authority until ``lease_until``. `Renew` by the
  holder moves ``lease_until`` to ``now + lease_ms``, capped by the absolute
  ``expires_at`` (``created_at + ttl_ms``), which nothing ever extends.
* ``closed`` (the run ended), ``lost`` (holder gone and ``reacquire:
  "never"``), ``expired`` (its TTL passed): terminal.

Holder loss (``lease_until`` passed, or the holder closed it on a graceful
stop): with ``reacquire: "same_requirements"`` back to ``pending`` (the lost
holder is never chosen again for it; TTL and the run's routing kept); with
``"never"``, ``lost``. Every change of holder or end is told to the run
(`NotifyRun`), and the slot of a holder that no longer holds is freed
(`FreeSlot`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .enums import IdentityEnum
from .errors import Fenced, IllegalTransition
from .session_spec import Reacquire

__all__ = [
    "TRANSITIONS",
    "Acquired",
    "Close",
    "FreeSlot",
    "NotifyRun",
    "Released",
    "Renew",
    "Tick",
    "WorkSessionMachine",
    "WorkSessionRecord",
    "WorkSessionStatus",
]


class WorkSessionStatus(IdentityEnum):
    PENDING = "pending"
    HELD = "held"
    CLOSED = "closed"
    LOST = "lost"
    EXPIRED = "expired"

    @property
    def terminal(self) -> bool:
        return self in _TERMINAL


_TERMINAL = frozenset({WorkSessionStatus.CLOSED, WorkSessionStatus.LOST,
                       WorkSessionStatus.EXPIRED})


@dataclass(slots=True)
class WorkSessionRecord:
    """The durable record of one session (table ``work_sessions``, by id)."""

    session_id: str
    run_id: str
    name: str
    lease_ms: int
    max_concurrent: int
    reacquire: Reacquire
    created_at: int
    expires_at: int  # created_at + ttl_ms: never moved
    status: WorkSessionStatus = WorkSessionStatus.PENDING
    holder: str | None = None
    generation: int = 0  # acquisitions so far: 1 is the first holder
    lease_until: int | None = None
    lost_holders: list[str] = field(default_factory=list)
    ended: str | None = None  # why it is terminal: run_ended, holder_lost, expired
    held_since: int | None = None  # when the current holder acquired it (the workers API)

    def to_dict(self) -> dict[str, Any]:
        return {
            "session_id": self.session_id, "run_id": self.run_id, "name": self.name,
            "lease_ms": self.lease_ms, "max_concurrent": self.max_concurrent,
            "reacquire": self.reacquire.text, "created_at": self.created_at,
            "expires_at": self.expires_at, "status": self.status.text,
            "holder": self.holder, "generation": self.generation,
            "lease_until": self.lease_until, "lost_holders": list(self.lost_holders),
            "ended": self.ended, "held_since": self.held_since,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> WorkSessionRecord:
        return cls(
            session_id=d["session_id"], run_id=d["run_id"], name=d["name"],
            lease_ms=d["lease_ms"], max_concurrent=d["max_concurrent"],
            reacquire=Reacquire(d["reacquire"]), created_at=d["created_at"],
            expires_at=d["expires_at"], status=WorkSessionStatus(d["status"]),
            holder=d["holder"], generation=d["generation"], lease_until=d["lease_until"],
            lost_holders=list(d["lost_holders"]), ended=d["ended"],
            held_since=d.get("held_since"),  # absent from records written before it
        )


# --------------------------------------------------------------------------- events


@dataclass(frozen=True, slots=True)
class Acquired:
    """The shell reserved a slot of `worker_id` (in the same transaction as the record)."""

    worker_id: str


@dataclass(frozen=True, slots=True)
class Renew:
    """The holder renews its authority (the ``session_renew`` call)."""

    worker_id: str


@dataclass(frozen=True, slots=True)
class Released:
    """The holder closed the session (``session_close``, a graceful stop)."""

    worker_id: str


@dataclass(frozen=True, slots=True)
class Close:
    """The run is over: the session ends and frees its slot."""


@dataclass(frozen=True, slots=True)
class Tick:
    """Time reached `next_deadline()`."""


Event = Acquired | Renew | Released | Close | Tick

# --------------------------------------------------------------------------- effects


@dataclass(frozen=True, slots=True)
class NotifyRun:
    """Tell the run: ``acquired`` (new holder), ``lost`` (holder gone; `reacquire` says
    whether another takes over) or ``expired``."""

    kind: str
    worker_id: str | None
    generation: int
    reacquire: bool = False


@dataclass(frozen=True, slots=True)
class FreeSlot:
    """`worker_id` no longer holds this session: its ``max_sessions`` slot is free."""

    worker_id: str


Effect = NotifyRun | FreeSlot


# --------------------------------------------------------------------------- the machine


class WorkSessionMachine:
    """Event in, effects out; `record` is then the session's new durable record."""

    __slots__ = ("record",)

    def __init__(self, record: WorkSessionRecord) -> None:
        self.record = record

    @classmethod
    def create(cls, session_id: str, run_id: str, name: str, *, lease_ms: int, ttl_ms: int,
               max_concurrent: int, reacquire: Reacquire, now: int) -> WorkSessionMachine:
        """A new pending session; its absolute TTL starts now."""
        return cls(WorkSessionRecord(
            session_id=session_id, run_id=run_id, name=name, lease_ms=lease_ms,
            max_concurrent=max_concurrent, reacquire=reacquire, created_at=now,
            expires_at=now + ttl_ms))

    @property
    def status(self) -> WorkSessionStatus:
        return self.record.status

    def next_deadline(self) -> int | None:
        """When `Tick` has something to do: the holder's lease end or the TTL."""
        r = self.record
        if r.status.terminal:
            return None
        if r.status is WorkSessionStatus.HELD and r.lease_until is not None:
            return min(r.lease_until, r.expires_at)
        return r.expires_at

    def handle(self, event: Event, now: int) -> list[Effect]:
        """Apply one event.

        Raises:
            IllegalTransition: not allowed in the current state (nothing changed).
            Fenced: a renew by a worker that does not hold the session (nothing changed).
        """
        name = TRANSITIONS.get((self.record.status, type(event)))
        if name is None:
            raise IllegalTransition(
                f"{type(event).__name__} is not allowed when session "
                f"{self.record.session_id} is {self.record.status.text}")
        handler: Callable[[WorkSessionMachine, Any, int], list[Effect]] = getattr(
            WorkSessionMachine, name)
        return handler(self, event, now)

    # ------------------------------------------------------------------ handlers

    def _on_acquired(self, ev: Acquired, now: int) -> list[Effect]:
        r = self.record
        if now >= r.expires_at:
            return self._expire()
        r.status = WorkSessionStatus.HELD
        r.holder = ev.worker_id
        r.generation += 1
        r.held_since = now
        r.lease_until = min(now + r.lease_ms, r.expires_at)
        return [NotifyRun("acquired", ev.worker_id, r.generation)]

    def _on_renew(self, ev: Renew, now: int) -> list[Effect]:
        r = self.record
        if ev.worker_id != r.holder:
            raise Fenced(f"session {r.session_id} is held by another worker")
        # The authority moves; the absolute TTL never does (AFFINITY.md).
        r.lease_until = min(now + r.lease_ms, r.expires_at)
        return []

    def _on_released(self, ev: Released, now: int) -> list[Effect]:
        if ev.worker_id != self.record.holder:
            raise Fenced(f"session {self.record.session_id} is held by another worker")
        return self._holder_lost()

    def _on_close(self, ev: Close, now: int) -> list[Effect]:
        r = self.record
        effects: list[Effect] = [FreeSlot(r.holder)] if r.holder is not None else []
        r.status, r.holder, r.lease_until, r.ended = WorkSessionStatus.CLOSED, None, None, "run_ended"
        r.held_since = None
        return effects

    def _on_tick(self, ev: Tick, now: int) -> list[Effect]:
        r = self.record
        if now >= r.expires_at:
            return self._expire()
        if r.status is WorkSessionStatus.HELD and r.lease_until is not None and now >= r.lease_until:
            return self._holder_lost()
        return []

    def _on_ended(self, ev: Any, now: int) -> list[Effect]:
        return []  # a tick or close of an ended session: nothing more to do

    def _on_renew_ended(self, ev: Renew | Released, now: int) -> list[Effect]:
        raise Fenced(f"session {self.record.session_id} is {self.record.status.text}")

    # ------------------------------------------------------------------ helpers

    def _holder_lost(self) -> list[Effect]:
        r = self.record
        assert r.holder is not None
        lost = r.holder
        effects: list[Effect] = [FreeSlot(lost)]
        r.lost_holders.append(lost)
        r.holder, r.lease_until, r.held_since = None, None, None
        if r.reacquire is Reacquire.SAME_REQUIREMENTS:
            r.status = WorkSessionStatus.PENDING
            effects.append(NotifyRun("lost", lost, r.generation, reacquire=True))
        else:
            r.status, r.ended = WorkSessionStatus.LOST, "holder_lost"
            effects.append(NotifyRun("lost", lost, r.generation, reacquire=False))
        return effects

    def _expire(self) -> list[Effect]:
        r = self.record
        effects: list[Effect] = [FreeSlot(r.holder)] if r.holder is not None else []
        r.status, r.holder, r.lease_until, r.ended = (WorkSessionStatus.EXPIRED, None, None,
                                                      "expired")
        r.held_since = None
        effects.append(NotifyRun("expired", None, r.generation))
        return effects


P, H = WorkSessionStatus.PENDING, WorkSessionStatus.HELD

#: (state, event type) -> handler name. Pairs not here raise IllegalTransition.
TRANSITIONS: dict[tuple[WorkSessionStatus, type], str] = {
    (P, Acquired): "_on_acquired",
    (P, Tick): "_on_tick",
    (P, Close): "_on_close",
    (P, Renew): "_on_renew_ended",  # a worker that lost it renews: fenced
    (P, Released): "_on_renew_ended",
    (H, Renew): "_on_renew",
    (H, Released): "_on_released",
    (H, Tick): "_on_tick",
    (H, Close): "_on_close",
}
for _s in _TERMINAL:
    TRANSITIONS[(_s, Tick)] = "_on_ended"
    TRANSITIONS[(_s, Close)] = "_on_ended"
    TRANSITIONS[(_s, Renew)] = "_on_renew_ended"
    TRANSITIONS[(_s, Released)] = "_on_renew_ended"
del _s
