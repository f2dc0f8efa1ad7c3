"""Scripted runs whose journals are recorded as golden files.

`python -m tests.sansio.golden_scenarios` (re)records `golden/*.json`: each file
holds the definitions, the start arguments, every input event with its time,
and the journal and status the machine produced. `test_golden_journals.py`
replays the inputs and demands the same journal and status, so a change in the
machine's behaviour shows up as a diff a reviewer has to accept on purpose.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from stepd.sansio import events as ev
from stepd.sansio.definition import Definition, parse_definition
from stepd.sansio.run import RunMachine

GOLDEN = Path(__file__).parent / "golden"

RESEARCH = {
    "name": "research_run",
    "version": "research.v2",
    "steps": [
        {"id": "plan", "kind": "task", "body": "plan_research", "input": "${input}"},
        {"id": "tasks", "kind": "for_each", "items": "${state.tasks}", "body": "execute_task",
         "into": "results", "max_parallel": 2},
        {"id": "approval", "kind": "wait", "event": "approved", "timeout_ms": 3600000, "into": "approval"},
        {"id": "pause", "kind": "sleep", "duration_ms": 1000},
        {"id": "children", "kind": "start_workflows", "workflow": "summarise", "items": "${state.results}",
         "wait": True, "into": "summaries"},
        {"id": "send", "kind": "task", "body": "send_summary", "delivery": "at_most_once",
         "retry": {"max_attempts": 1}},
    ],
    "budgets": {"max_transitions": 20, "max_for_each_items": 12, "max_state_bytes": 32768,
                "max_cost_units": 40, "max_started_workflows": 8},
    "deadline_ms": 86400000,
}
SUMMARISE = {"name": "summarise", "version": "s1", "steps": [{"id": "sum", "kind": "task", "body": "sum"}]}

RETRIES = {
    "name": "flaky",
    "steps": [
        {"id": "fetch", "kind": "task", "body": "fetch", "timeout_ms": 5000,
         "retry": {"max_attempts": 4, "initial_backoff_ms": 100, "retry_on": ["rate_limited"]}},
        {"id": "loop", "kind": "task", "body": "loop"},
    ],
    "budgets": {"max_transitions": 4},
}

BUDGET = {
    "name": "gated",
    "steps": [
        {"id": "gate", "kind": "wait", "event": "go", "into": "doc"},
        {"id": "done", "kind": "task", "body": "done"},
    ],
    "budgets": {"max_state_bytes": 64},
}


class Script:
    def __init__(self, name: str, definitions: list[dict[str, Any]], start: dict[str, Any]) -> None:
        self.name = name
        self.definitions = definitions
        self.start = start
        self.inputs: list[dict[str, Any]] = []
        defs = [parse_definition(d) for d in definitions]
        self.defs: dict[str, Definition] = {d.name: d for d in defs}
        self.machine, tr = start_machine(self.defs, start)
        self.journal = list(tr.journal)

    def send(self, event: Any, now: int) -> ev.Transition:
        self.inputs.append(encode_event(event, now))
        tr = self.machine.handle(event, now)
        self.journal.extend(tr.journal)
        return tr

    def offer(self, step: str, item: int | None, lease: str, now: int,
              worker: tuple[str, str] = ("w_1", "worker-1")) -> int:
        tr = self.send(ev.AttemptOffered(step, item, lease, *worker), now)
        assert tr.lease is not None
        return int(tr.lease["fence"])

    def save(self) -> None:
        GOLDEN.mkdir(exist_ok=True)
        doc = {
            "definitions": self.definitions,
            "start": self.start,
            "inputs": self.inputs,
            "journal": self.journal,
            "status": self.machine.status_view(),
        }
        (GOLDEN / f"{self.name}.json").write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")


def start_machine(defs: dict[str, Definition], start: dict[str, Any]) -> tuple[RunMachine, ev.Transition]:
    return RunMachine.start(
        run_id=start["run_id"], definition=defs[start["workflow"]], input=start["input"],
        now_ms=start["now"], correlation=start.get("correlation"),
        idempotency_key=start.get("idempotency_key"),
        resolve=lambda name, version: defs.get(name),
    )


def encode_event(event: Any, now: int) -> dict[str, Any]:
    return {"event": type(event).__name__, "fields": dataclasses.asdict(event), "now": now}


def decode_event(doc: dict[str, Any]) -> tuple[Any, int]:
    cls = getattr(ev, doc["event"])
    return cls(**doc["fields"]), doc["now"]


def research() -> Script:
    s = Script("research_run", [RESEARCH, SUMMARISE],
               {"run_id": "r_golden1", "workflow": "research_run", "input": {"brief": 42},
                "now": 1_000, "idempotency_key": "brief:42:research", "correlation": {"brief": 42}})
    f = s.offer("plan", None, "l1", 1_010)
    s.send(ev.AttemptStarted("plan", None, f), 1_011)
    s.send(ev.AttemptCompleted("plan", None, f, {"n": 3}, {"tasks": ["a", "b", "c"]},
                               {"input_tokens": 100, "output_tokens": 20, "cost_usd": 0.002}), 1_050)
    fences = {i: s.offer("tasks", i, f"l_t{i}", 1_060) for i in (0, 1)}
    s.send(ev.AttemptStarted("tasks", 1, fences[1]), 1_061)
    s.send(ev.AttemptCompleted("tasks", 1, fences[1], "B"), 1_070)
    fences[2] = s.offer("tasks", 2, "l_t2", 1_071)
    s.send(ev.AttemptFailed("tasks", 0, fences[0], "retryable", "503"), 1_080)
    s.send(ev.SignalReceived("approved", {"by": "ann"}), 1_085)  # early: buffered
    s.send(ev.AttemptCompleted("tasks", 2, fences[2], "C"), 1_090)
    s.send(ev.Tick(), 1_280)
    fences[0] = s.offer("tasks", 0, "l_t0b", 1_281)
    s.send(ev.AttemptCompleted("tasks", 0, fences[0], "A"), 1_300)  # wait consumes the buffered signal
    s.send(ev.Tick(), 2_300)  # the sleep ends; children start
    kids = [f"r_golden1.children.{i}" for i in range(3)]
    for i in (2, 0, 1):
        s.send(ev.ChildFinished(kids[i], "completed", f"sum-{i}"), 2_400 + i)
    f = s.offer("send", None, "l_send", 2_500)
    s.send(ev.AttemptStarted("send", None, f), 2_501)
    s.send(ev.AttemptCompleted("send", None, f, {"sent": True}), 2_510)
    return s


def retries() -> Script:
    s = Script("retries", [RETRIES], {"run_id": "r_golden2", "workflow": "flaky", "input": None, "now": 0})
    f = s.offer("fetch", None, "l1", 1)
    s.send(ev.AttemptUnservable("fetch", None, f, "w_1", "old build"), 2)
    w2 = ("w_2", "worker-2")  # the slot is never offered to w_1 again
    f = s.offer("fetch", None, "l2", 3, worker=w2)
    s.send(ev.AttemptStarted("fetch", None, f), 4)
    s.send(ev.Tick(), 5_004)  # step timeout: fenced, retried after backoff
    s.send(ev.Tick(), 5_104)
    f = s.offer("fetch", None, "l3", 5_105, worker=w2)
    s.send(ev.AttemptOrphaned("fetch", None, f), 35_105)
    s.send(ev.AttemptRevived("fetch", None, f), 36_000)
    s.send(ev.AttemptFailed("fetch", None, f, "rate_limited", "429"), 36_001)
    s.send(ev.Tick(), 36_201)
    f = s.offer("fetch", None, "l4", 36_202, worker=w2)
    s.send(ev.AttemptCompleted("fetch", None, f, {"_next_step": "loop"}), 36_300)
    for n in range(4):
        f = s.offer("loop", None, f"l_loop{n}", 36_400 + n)
        s.send(ev.AttemptCompleted("loop", None, f, {"_next_step": "loop"}), 36_450 + n)
    return s


def budget() -> Script:
    s = Script("budget", [BUDGET], {"run_id": "r_golden3", "workflow": "gated", "input": None, "now": 0})
    s.send(ev.SignalReceived("go", "x" * 80), 10)  # refused: over max_state_bytes
    s.send(ev.SignalReceived("go", "small"), 20)
    s.send(ev.Cancel("operator"), 30)
    return s


SCENARIOS = (research, retries, budget)

if __name__ == "__main__":
    for scenario in SCENARIOS:
        scenario().save()
        print("recorded", scenario.__name__)
