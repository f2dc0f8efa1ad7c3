"""Messages between the daemon's actors: frozen, slotted dataclasses (STYLE.md rule 12).

Who sends what:

* protocol handler -> lease actor: `LeaseCall`
* lease actor -> run actor: `ApplyAttempt` (ask), `AttemptNote` (tell)
* protocol handler / engine -> run actor: `Offer`, `Signal`, `CancelRun`, `Resync`,
  `InboxChanged`
* run actor -> lease actor: `EndLease`
* run actor / engine -> registry: `Announce`, `WithdrawSlots`, `ReturnSpecs`,
  `RegisterWorker`, `Claim`, `CancelWait`
* timers: each actor's own `Due`
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from stepd.sansio.events import AttemptSpec
from stepd.sansio.lease import Op

from .store import InTxn


@dataclass(frozen=True, slots=True)
class Due:
    """An actor's own timer fired."""


@dataclass(frozen=True, slots=True)
class IdleCheck:
    """Sent by a run actor to itself after start: passivate if nothing is queued."""


# --------------------------------------------------------------------------- leases


@dataclass(frozen=True, slots=True)
class LeaseCall:
    """A worker call on a lease (PROTOCOL.md "Worker calls")."""

    op: Op
    body: Any = None  # the call's parsed body: progress, output/state_patch/usage/spans, error
    # The worker registered on the connection the call came in on, when the
    # transport knows it (WebSocket, in process); None over plain HTTP.
    caller: str | None = None
    # Names this call (unique in the process): written into the lease record
    # with the outcome it lands, so a retry after its actor died can tell its
    # own landed outcome (answered 200) from an earlier call's (409).
    token: int = 0


@dataclass(frozen=True, slots=True)
class ReleaseLease:
    """The lease was offered but never reached its worker: give the slot back now."""


@dataclass(frozen=True, slots=True)
class EndLease:
    """The run ended this lease: `reason` is what later calls are told."""

    reason: str  # "fenced" | "run_terminal"


# --------------------------------------------------------------------------- runs


@dataclass(frozen=True, slots=True)
class Offer:
    """Turn a queued slot into a lease held by this worker (registry assignment)."""

    spec: AttemptSpec
    worker_id: str
    worker_name: str


@dataclass(frozen=True, slots=True)
class ApplyAttempt:
    """A lease actor hands a worker call to its run: persist it, then answer.

    `lease` is the lease record as it must be stored once the call applies;
    `event` the run machine event (AttemptStarted / AttemptCompleted / ...).
    """

    lease_id: str
    op: Op
    lease: Any  # dict: the updated lease record
    event: Any


@dataclass(frozen=True, slots=True)
class AttemptNote:
    """Timing news from a lease actor: orphaned, revived, or lost (recovered)."""

    lease_id: str
    event: Any
    lease: Any = None  # dict: the lease record to store with it (recovered: fenced)


@dataclass(frozen=True, slots=True)
class Signal:
    name: str
    payload: Any = None
    also: InTxn | None = None  # written in the signal's transaction (its audit entry)


@dataclass(frozen=True, slots=True)
class CancelRun:
    message: str = "cancelled"
    also: InTxn | None = None  # written in the cancel's transaction (its audit entry)


@dataclass(frozen=True, slots=True)
class Resync:
    """Re-announce runnable slots and make sure every live lease has its actor."""


@dataclass(frozen=True, slots=True)
class InboxChanged:
    """Messages (child results, cancels) wait in this run's durable inbox."""


# --------------------------------------------------------------------------- registry


@dataclass(frozen=True, slots=True)
class Announce:
    """These slots are runnable (deduplicated by the registry)."""

    specs: tuple[AttemptSpec, ...]


@dataclass(frozen=True, slots=True)
class WithdrawSlots:
    run_id: str
    slots: tuple[tuple[str, int | None], ...] | None = None  # None: every slot of the run


@dataclass(frozen=True, slots=True)
class ReturnSpecs:
    """Assigned slots that were never offered (the claimant went away): queue them again."""

    specs: tuple[AttemptSpec, ...]


@dataclass(frozen=True, slots=True)
class RegisterWorker:
    worker_id: str
    name: str
    keys: frozenset[tuple[str, str | None, str]]  # (workflow, version, body)


@dataclass(frozen=True, slots=True)
class ForgetWorkers:
    """Workers expired for idleness (`Engine.expire_workers`): route nothing to them."""

    worker_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Claim:
    """Take up to `max` runnable slots for this worker; with `waiter`, park if none."""

    worker_id: str
    max: int
    run_id: str | None
    waiter: Any = None  # registry.Waiter: a one-shot slot the registry fills


@dataclass(frozen=True, slots=True)
class CancelWait:
    waiter: Any


@dataclass(frozen=True, slots=True)
class RegistryStats:
    """Ask for the registry's counts (for /metrics and GET /v1/api/workers)."""
