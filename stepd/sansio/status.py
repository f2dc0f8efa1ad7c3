"""Run status and the fixed vocabularies the run status view and journal use.

WORKFLOWS.md "Run status" is the contract: seven statuses, and a closed list of
error reasons. They are enums stored by `.value` (STYLE.md rule 3), so a record
read back from LMDB and the wire form agree by construction.
"""

from __future__ import annotations

from .enums import IdentityEnum


class RunStatus(IdentityEnum):
    RUNNING = "running"
    WAITING = "waiting"
    SLEEPING = "sleeping"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    TIMED_OUT = "timed_out"

    #: Completed, failed, cancelled or timed out: a plain attribute per member
    #: (read several times per step), not a property.
    terminal: bool

    def __init__(self, value: str) -> None:
        super().__init__(value)
        self.terminal = value in ("completed", "failed", "cancelled", "timed_out")


_TERMINAL = frozenset(s for s in RunStatus if s.terminal)
TERMINAL_STATUSES = _TERMINAL


class ErrorReason(IdentityEnum):
    """`error.reason` of a run that did not complete (WORKFLOWS.md "Run status")."""

    BUDGET_EXCEEDED = "budget_exceeded"
    STEP_FAILED = "step_failed"
    LEASE_LOST = "lease_lost"
    WAIT_TIMEOUT = "wait_timeout"
    TEMPLATE = "template"
    CANCELLED = "cancelled"
    DEADLINE = "deadline"
    INTERNAL = "internal"  # the daemon gave up: the run's actor crashed too often
    SESSION_LOST = "session_lost"  # a worker session's holder was lost, reacquire "never"
    SESSION_EXPIRED = "session_expired"  # a worker session's absolute TTL passed while needed


class SlotPhase(IdentityEnum):
    """Where one attempt slot (a task step, or one item of a for_each) stands.

    `queued`: runnable, waiting to be offered to a worker. `offered`: a lease
    exists, `started` has not arrived. `started`: the body is running.
    `backoff`: the last attempt failed and the next waits for its backoff timer.
    `done`: the slot's output is in.
    """

    QUEUED = "queued"
    OFFERED = "offered"
    STARTED = "started"
    BACKOFF = "backoff"
    DONE = "done"


LIVE_PHASES = frozenset({SlotPhase.OFFERED, SlotPhase.STARTED})
