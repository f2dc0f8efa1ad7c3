"""The durable record of one run: what the run machine reads and rewrites.

A run's record is everything needed to rebuild its machine after a crash
(STYLE.md rule 11): the pinned definition identity, input, state, step outputs,
the current step's frame with one slot per attempt in flight, fence counters,
buffered signals, budget usage and journal sequence. It is stored as one
msgpack map per run (`to_dict`/`from_dict`); enums travel by `.value`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .status import RunStatus, SlotPhase

RECORD_VERSION = 1

# Members by stored value: `from_dict` reads a record back per start and per status
# read, and `RunStatus(value)` is two Python calls (`EnumType.__call__`,
# `Enum.__new__`) where a dict subscript is none. An unknown value still goes
# through the Enum, for its ValueError.
_RUN_STATUS: dict[str, RunStatus] = {m.text: m for m in RunStatus}
_SLOT_PHASE: dict[str, SlotPhase] = {m.text: m for m in SlotPhase}


def slot_key(step_id: str, item_index: int | None) -> str:
    """Key of a slot's fence counter: fences grow per step (and item), across loops."""
    return step_id if item_index is None else f"{step_id}/{item_index}"


@dataclass(slots=True)
class Slot:
    """One attempt position: a task step, or one item of a for_each."""

    item_index: int | None
    input: Any
    cost_units: int
    attempt: int = 1
    phase: SlotPhase = SlotPhase.QUEUED
    fence: int = 0
    lease_id: str | None = None
    worker_id: str | None = None
    not_before: int | None = None  # backoff: the next attempt is queued at this time (ms)
    timeout_at: int | None = None  # per-step timeout of the started attempt (ms)
    excluded: list[str] = field(default_factory=list)  # workers that answered unservable
    queued_at: int | None = None  # when it last became runnable (schedule-to-start metrics)

    def to_dict(self) -> dict[str, Any]:
        return {
            "i": self.item_index,
            "in": self.input,
            "c": self.cost_units,
            "a": self.attempt,
            "p": self.phase.text,
            "f": self.fence,
            "l": self.lease_id,
            "w": self.worker_id,
            "nb": self.not_before,
            "to": self.timeout_at,
            "x": self.excluded,
            "q": self.queued_at,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Slot:
        return cls(
            item_index=d["i"],
            input=d["in"],
            cost_units=d["c"],
            attempt=d["a"],
            phase=_SLOT_PHASE[d["p"]] if d["p"] in _SLOT_PHASE else SlotPhase(d["p"]),
            fence=d["f"],
            lease_id=d["l"],
            worker_id=d["w"],
            not_before=d["nb"],
            timeout_at=d["to"],
            excluded=list(d["x"]),
            queued_at=d.get("q"),
        )


@dataclass(slots=True)
class Frame:
    """The execution of the current step (one visit of it)."""

    step_id: str
    index: int
    visit: int
    slots: list[Slot] = field(default_factory=list)  # live and queued slots only
    # for_each
    total: int = 0
    pending: list[Any] = field(default_factory=list)  # rendered inputs not yet slotted, in order
    next_item: int = 0
    outputs: list[Any] = field(default_factory=list)
    done: int = 0
    # wait
    event: str | None = None
    # wait timeout or sleep wake-up (ms)
    due_at: int | None = None
    # start_workflows (wait=True)
    children: list[str] = field(default_factory=list)
    finished: list[bool] = field(default_factory=list)

    def slot(self, item_index: int | None) -> Slot | None:
        for s in self.slots:
            if s.item_index == item_index:
                return s
        return None

    def to_dict(self) -> dict[str, Any]:
        return {
            "s": self.step_id,
            "ix": self.index,
            "v": self.visit,
            "sl": [s.to_dict() for s in self.slots],
            "t": self.total,
            "pe": self.pending,
            "ni": self.next_item,
            "o": self.outputs,
            "d": self.done,
            "e": self.event,
            "due": self.due_at,
            "ch": self.children,
            "fi": self.finished,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Frame:
        return cls(
            step_id=d["s"],
            index=d["ix"],
            visit=d["v"],
            slots=[Slot.from_dict(s) for s in d["sl"]],
            total=d["t"],
            pending=list(d["pe"]),
            next_item=d["ni"],
            outputs=list(d["o"]),
            done=d["d"],
            event=d["e"],
            due_at=d["due"],
            children=list(d["ch"]),
            finished=list(d["fi"]),
        )


@dataclass(slots=True)
class RunRecord:
    run_id: str
    workflow: str
    version: str | None
    definition_hash: str
    input: Any
    created_at: int
    correlation: Any = None
    idempotency_key: str | None = None
    parent: dict[str, Any] | None = None  # {"run_id", "step_id"}
    status: RunStatus = RunStatus.RUNNING
    state: dict[str, Any] = field(default_factory=dict)
    steps: dict[str, Any] = field(default_factory=dict)
    result: Any = None
    error: dict[str, Any] | None = None
    frame: Frame | None = None
    visits: dict[str, int] = field(default_factory=dict)
    fences: dict[str, int] = field(default_factory=dict)
    signals: list[dict[str, Any]] = field(default_factory=list)  # buffered, oldest first
    transitions: int = 0
    cost_units: int = 0
    started_workflows: int = 0
    state_bytes: int = 2  # len(b"{}")
    input_tokens: int = 0
    output_tokens: int = 0
    cost_usd: float = 0.0
    updated_at: int = 0
    deadline_at: int | None = None
    seq: int = 0  # last journal sequence number
    #: 0 for a run started through the API; a child run is one deeper than its parent.
    depth: int = 0
    #: False for a child run created by its parent's transition but whose first
    #: step is not entered yet: its own actor enters it (`Begin`), in its own
    #: transaction, so a tree of child runs is built one level per transaction
    #: instead of recursively inside the parent's.
    begun: bool = True
    #: Worker sessions by name: {"id", "holder", "gen", "status"} (AFFINITY.md);
    #: status pending | held | lost | expired. The recorded routing a holder
    #: change keeps.
    sessions: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: A fork's origin: ``{"run_id", "step_id", "seq"}`` (the run, the step it
    #: branched off after, the last journal entry it copied); None otherwise.
    forked_from: dict[str, Any] | None = None
    #: Sticky execution's bookkeeping (`stepd.sansio.sticky`), None until a
    #: sticky worker first takes one of the run's steps.
    sticky: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        d = self._to_dict()
        # Written only when not the default: the records of every top-level run,
        # and of every run before these fields existed, stay as they were.
        if self.depth:
            d["depth"] = self.depth
        if not self.begun:
            d["begun"] = False
        if self.sessions:
            d["ws"] = self.sessions
        if self.forked_from is not None:
            d["forked_from"] = self.forked_from
        if self.sticky is not None:
            d["sticky"] = self.sticky
        return d

    def _to_dict(self) -> dict[str, Any]:
        return {
            "rv": RECORD_VERSION,
            "run_id": self.run_id,
            "workflow": self.workflow,
            "version": self.version,
            "hash": self.definition_hash,
            "input": self.input,
            "created_at": self.created_at,
            "correlation": self.correlation,
            "idempotency_key": self.idempotency_key,
            "parent": self.parent,
            "status": self.status.text,
            "state": self.state,
            "steps": self.steps,
            "result": self.result,
            "error": self.error,
            "frame": None if self.frame is None else self.frame.to_dict(),
            "visits": self.visits,
            "fences": self.fences,
            "signals": self.signals,
            "transitions": self.transitions,
            "cost_units": self.cost_units,
            "started_workflows": self.started_workflows,
            "state_bytes": self.state_bytes,
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "cost_usd": self.cost_usd,
            "updated_at": self.updated_at,
            "deadline_at": self.deadline_at,
            "seq": self.seq,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunRecord:
        if d.get("rv") != RECORD_VERSION:
            raise ValueError(f"run record version {d.get('rv')!r} is not {RECORD_VERSION}")
        frame = d["frame"]
        return cls(
            run_id=d["run_id"],
            workflow=d["workflow"],
            version=d["version"],
            definition_hash=d["hash"],
            input=d["input"],
            created_at=d["created_at"],
            correlation=d["correlation"],
            idempotency_key=d["idempotency_key"],
            parent=d["parent"],
            status=_RUN_STATUS[d["status"]] if d["status"] in _RUN_STATUS else RunStatus(d["status"]),
            state=d["state"],
            steps=d["steps"],
            result=d["result"],
            error=d["error"],
            frame=None if frame is None else Frame.from_dict(frame),
            visits=d["visits"],
            fences=d["fences"],
            signals=d["signals"],
            transitions=d["transitions"],
            cost_units=d["cost_units"],
            started_workflows=d["started_workflows"],
            state_bytes=d["state_bytes"],
            input_tokens=d["input_tokens"],
            output_tokens=d["output_tokens"],
            cost_usd=d["cost_usd"],
            updated_at=d["updated_at"],
            deadline_at=d["deadline_at"],
            seq=d["seq"],
            depth=d.get("depth", 0),
            begun=d.get("begun", True),
            sessions=d.get("ws") or {},
            forked_from=d.get("forked_from"),
            sticky=d.get("sticky"),
        )
