"""What goes into the run machine (events) and what comes out (effects).

Events are frozen, slotted dataclasses and are never subclassed (STYLE.md rule
3). The machine turns one event into a `Transition`: the journal entries to
append and the effects for the actor shell to perform *after* it has persisted
the machine's new record (persist, then acknowledge, then act: DESIGN.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .frozen import frozen
from .sticky import StickyClaim, StickyWorker

# --------------------------------------------------------------------------- events


@frozen
class AttemptOffered:
    """The registry hands a queued slot to a worker under a new lease."""

    step_id: str
    item_index: int | None
    lease_id: str
    worker_id: str
    worker_name: str = ""
    #: The worker declared ``local_steps`` (stepd.sansio.capabilities): its lease
    #: carries the plan of the local steps that follow (AFFINITY.md "Local steps").
    local_steps: bool = False
    #: The worker declared sticky execution (None: the lease is as it always was).
    sticky: StickyWorker | None = None


@frozen
class AttemptStarted:
    """The worker said `started` for the lease holding this fence."""

    step_id: str
    item_index: int | None
    fence: int


@frozen
class AttemptCompleted:
    step_id: str
    item_index: int | None
    fence: int
    output: Any = None
    state_patch: dict[str, Any] | None = None
    usage: dict[str, Any] | None = None  # {"input_tokens", "output_tokens", "cost_usd"} priced
    spans: tuple[Any, ...] | list[Any] | None = None  # journaled with the completion
    #: `stepd.sansio.local_steps.LocalRecord` values: local steps run in the worker,
    #: journaled in the same transition as this completion.
    local_steps: tuple[Any, ...] | None = None
    #: The history cursor the worker cached (its identity checked at the protocol
    #: boundary); None: it cached nothing.
    sticky: StickyClaim | None = None


@frozen
class AttemptFailed:
    step_id: str
    item_index: int | None
    fence: int
    error_class: str
    message: str = ""


@frozen
class AttemptLost:
    """The lease expired and its recovery window passed (PROTOCOL.md "Expiry and recovery")."""

    step_id: str
    item_index: int | None
    fence: int
    started: bool


@frozen
class AttemptOrphaned:
    """The lease expired; the attempt waits out the recovery window (journal only)."""

    step_id: str
    item_index: int | None
    fence: int


@frozen
class AttemptRevived:
    """A late call arrived inside the recovery window (journal only)."""

    step_id: str
    item_index: int | None
    fence: int


@frozen
class AttemptReleased:
    """An offered lease never reached its worker (the connection died, the
    claim's answer was lost): hand the slot back at once, same attempt."""

    step_id: str
    item_index: int | None
    fence: int


@frozen
class AttemptUnservable:
    """The worker does not hold this definition, version or body; hand the slot back."""

    step_id: str
    item_index: int | None
    fence: int
    worker_id: str
    message: str = ""


@frozen
class SignalReceived:
    name: str
    payload: Any = None


@frozen
class Tick:
    """Time has reached (at least) the machine's `next_deadline()`; fire what is due."""


@frozen
class ChildFinished:
    child_run_id: str
    status: str
    result: Any = None
    error: dict[str, Any] | None = None


@frozen
class Cancel:
    message: str = "cancelled"  # the run's error message: the canceller's reason, if given


@frozen
class Retry:
    """Resume a failed run at the step it failed on, with a fresh retry budget.

    The operator's decision (the retry API), so the step is entered again as
    a new visit whatever its delivery: budgets and the deadline still apply.
    """


@frozen
class Begin:
    """Enter the first step of a child run its parent created unbegun (`RunRecord.begun`)."""


@frozen
class InternalFailure:
    """The daemon gives up on the run: its actor crashed too often (a poison run).

    The run fails with reason `internal` and the message journaled, so a crash
    loop ends in a visible failure instead of restarting forever.
    """

    message: str


@frozen
class SessionChanged:
    """A worker session of this run changed (AFFINITY.md "Worker sessions"), told by
    its actor after its own record is durable.

    `kind`: ``acquired`` (`worker_id` holds it now, acquisition `generation`),
    ``lost`` (its holder is gone; `reacquire`: another will take it over, else
    the run fails ``session_lost``) or ``expired`` (its absolute TTL passed).
    """

    name: str
    session_id: str
    kind: str
    worker_id: str | None = None
    generation: int = 0
    reacquire: bool = False


Event = (
    AttemptOffered
    | AttemptStarted
    | AttemptCompleted
    | AttemptFailed
    | AttemptLost
    | AttemptOrphaned
    | AttemptRevived
    | AttemptReleased
    | AttemptUnservable
    | SignalReceived
    | Tick
    | ChildFinished
    | Cancel
    | InternalFailure
    | Begin
    | SessionChanged
    | Retry
)

# --------------------------------------------------------------------------- effects


@frozen
class AttemptSpec:
    """Everything the registry needs to offer one slot to a worker."""

    run_id: str
    workflow: str
    version: str | None
    definition_hash: str
    step_id: str
    body: str
    item_index: int | None
    attempt: int
    delivery: str
    timeout_ms: int | None
    idempotency_key: str
    excluded_workers: tuple[str, ...] = ()
    #: The worker session of the step (its id), or None. With a session the
    #: slot goes only to `pinned`, its holder; None: nobody yet (it waits).
    session: str | None = None
    pinned: str | None = None
    #: Sticky execution: offer only to this worker (the one that ran the run's
    #: previous step and cached its history) until `prefer_until` (ms), then to
    #: anyone. Never on a session's step: the session's holder is where it goes.
    prefer: str | None = None
    prefer_until: int | None = None


@frozen
class Runnable:
    """These slots are queued: offer each to exactly one worker."""

    attempts: tuple[AttemptSpec, ...]


@frozen
class Withdraw:
    """These queued slots are no longer runnable (the run ended or the step moved on)."""

    run_id: str
    slots: tuple[tuple[str, int | None], ...]


@frozen
class EndLeases:
    """These live leases are over: `reason` is the 409 reason later calls get.

    The shell tells their holders (the WebSocket `cancel` frame) and stops the
    lease actors; the durable checks need nothing more, since the run record's
    fences and status already answer later calls.
    """

    lease_ids: tuple[str, ...]
    reason: str  # "fenced" | "run_terminal"


@frozen
class ChildSpec:
    run_id: str
    input: Any


@frozen
class StartChildren:
    """Create these child runs in the same transaction as the parent's transition.

    `definition` is the child workflow's definition, already resolved by the
    machine's catalog lookup, so creating the children cannot fail for want of it.
    """

    parent_run_id: str
    step_id: str
    definition: Any  # stepd.sansio.definition.Definition (Any: no import cycle)
    children: tuple[ChildSpec, ...]
    correlation: Any = None
    depth: int = 1  # the children's depth (the parent's plus one)


@frozen
class CancelChildren:
    run_ids: tuple[str, ...]


@frozen
class NotifyParent:
    """This run is terminal and its parent waits on it."""

    parent_run_id: str
    child_run_id: str


@frozen
class RunEnded:
    run_id: str
    status: str


Effect = (
    Runnable
    | Withdraw
    | EndLeases
    | StartChildren
    | CancelChildren
    | NotifyParent
    | RunEnded
)


@dataclass(slots=True)
class Transition:
    """The output of one event: journal entries to append and effects to perform.

    `lease` is set by `AttemptOffered`: the lease payload (PROTOCOL.md "Lease"
    minus what the registry adds). `refused` is set when a signal was refused
    over budget: `(reason, budget)`; the record then changed only by the
    `signal_rejected` journal entry.
    """

    journal: list[dict[str, Any]] = field(default_factory=list)
    effects: list[Effect] = field(default_factory=list)
    lease: dict[str, Any] | None = None
    refused: tuple[str, str] | None = None
