"""A run's history read back from its journal: where a fork branches off, and what it keeps.

A fork (`RunMachine.fork`, the fork API) starts a new run from a completed
step of another: it copies the journal up to that step's completion and goes
on with the state, step outputs, visits, fences and budget usage the run had
right then. The run record holds only the latest of each, so they are folded
from the journal, which says everything that changed them: every
``state_patched`` entry carries the ``values`` it wrote, every step-level
``step_completed`` its ``output``.

Why not a snapshot per step in the record: it would grow every transition of
every run for an operation that is rare; the journal is written anyway, and
reading it back costs only the fork.

Pure (STYLE.md rule 1): a list of journal entries in, a `ForkPoint` out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from .definition import Definition
from .errors import Invalid, Unprocessable
from .record import slot_key

__all__ = ["ForkPoint", "fork_point"]

#: Entries that end a step's completion without applying it (a budget breach)
#: or without a next step to go to (a `_next_step` naming no step).
_NOT_APPLIED = frozenset({"budget_exceeded"})
_NO_NEXT = frozenset({"budget_exceeded", "step_failed"})


@dataclass(slots=True)
class ForkPoint:
    """What a run had right after one completion of a step (the fork's starting record).

    Attributes:
        step_id: the step.
        seq: the journal sequence number of the last entry the fork copies.
        journal: the copied entries, ``seq`` 1 to `seq`.
        output: the step's output then (the fork's next step follows from it).
    """

    step_id: str
    seq: int
    journal: list[dict[str, Any]]
    output: Any = None
    state: dict[str, Any] = field(default_factory=dict)
    steps: dict[str, Any] = field(default_factory=dict)
    visits: dict[str, int] = field(default_factory=dict)
    fences: dict[str, int] = field(default_factory=dict)
    transitions: int = 0
    cost_units: int = 0
    started_workflows: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cost_usd: float = 0.0


def _step_level(e: dict[str, Any]) -> bool:
    """A whole step's completion (a task's, or a for_each's, wait's... from `_finish_step`),
    not one item of a for_each."""
    return e.get("type") == "step_completed" and e.get("item_index") is None


def _after(journal: list[dict[str, Any]], i: int) -> tuple[int, dict[str, Any] | None]:
    """The last index of completion `i` (its ``state_patched`` included) and the entry after it."""
    end = i
    nxt = journal[i + 1] if i + 1 < len(journal) else None
    if nxt is not None and nxt.get("type") == "state_patched" and nxt.get("item_index") is None:
        end = i + 1
        nxt = journal[i + 2] if i + 2 < len(journal) else None
    return end, nxt


def fork_point(journal: list[dict[str, Any]], definition: Definition, step_id: str) -> ForkPoint:
    """Where a fork from the last completion of `step_id` branches off, and what it keeps.

    Args:
        journal: the source run's whole journal, in order (``seq`` 1, 2, ...).
        definition: the source run's pinned definition.
        step_id: the completed step to fork from.

    Raises:
        Invalid: (field ``from_step``) no such step, or it never completed with a
            next step to go to (it failed, breached a budget, or has not run yet).
        Unprocessable: the journal is from before it kept outputs and state
            values (a run of an older daemon), or it is not whole.
    """
    try:
        definition.index_of(step_id)
    except KeyError:
        raise Invalid(f"{step_id!r} is not a step of {definition.name!r}",
                      field="from_step") from None
    cut = -1
    for i in range(len(journal) - 1, -1, -1):
        e = journal[i]
        if _step_level(e) and e.get("step_id") == step_id:
            end, nxt = _after(journal, i)
            if nxt is not None and nxt.get("type") in _NO_NEXT and nxt.get("step_id") == step_id:
                continue  # this completion ended the run instead of moving on
            cut = end
            break
    if cut < 0:
        raise Invalid(f"step {step_id!r} has not completed in this run (a fork starts after a "
                      "completed step)", field="from_step")
    prefix = journal[:cut + 1]
    if any(e.get("seq") != n for n, e in enumerate(prefix, 1)):
        raise Unprocessable("the run's journal is not whole: it cannot be forked")
    point = ForkPoint(step_id=step_id, seq=len(prefix), journal=prefix)
    _fold(point, prefix, definition)
    return point


def _fold(p: ForkPoint, prefix: list[dict[str, Any]], definition: Definition) -> None:
    """Replay the prefix's effects on the record's fields (mirrors `_RunSteps._finish_step`
    and `_RunAttempts._on_completed`, which journal each change they apply)."""
    for i, e in enumerate(prefix):
        kind = e.get("type")
        if kind == "step_scheduled":
            sid = str(e["step_id"])
            p.visits[sid] = max(p.visits.get(sid, 0), int(e.get("visit", 1)))
        elif kind == "step_offered":
            key = slot_key(str(e["step_id"]), e.get("item_index"))
            p.fences[key] = max(p.fences.get(key, 0), int(e.get("fence", 0)))
        elif kind == "child_started":
            p.started_workflows += 1
        elif kind == "state_patched":
            values = e.get("values")
            if not isinstance(values, dict):
                raise Unprocessable("the run's journal is from before stepd kept state values "
                                    "in it: it cannot be forked")
            p.state.update(values)
        elif kind == "step_completed":
            usage = e.get("usage") or {}
            p.input_tokens += int(usage.get("input_tokens") or 0)
            p.output_tokens += int(usage.get("output_tokens") or 0)
            cost = p.cost_usd + float(usage.get("cost_usd") or 0.0)
            p.cost_usd = cost if math.isfinite(cost) else p.cost_usd
            nxt = prefix[i + 1] if i + 1 < len(prefix) else None
            if nxt is not None and nxt.get("type") in _NOT_APPLIED:
                continue  # refused over budget: nothing of it was applied
            if "attempt" in e:  # a task's or an item's attempt: its cost counts
                p.cost_units += getattr(definition.step(str(e["step_id"])), "cost_units", 0)
            if _step_level(e):
                if "output" not in e:
                    raise Unprocessable("the run's journal is from before stepd kept step "
                                        "outputs in it: it cannot be forked")
                p.transitions += 1
                p.steps[str(e["step_id"])] = e["output"]
    p.output = p.steps.get(p.step_id)
