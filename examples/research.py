"""Seed 004's guardrails: `research_run` with a version, an idempotency key and five budgets.

    python examples/research.py                    # on an embedded daemon (a temporary directory)
    python examples/research.py --url http://127.0.0.1:7707 [--key KEY]   # on `stepd serve`

`research_run` (version ``research.v2``) plans research tasks, runs them with a
``for_each``, waits for an approval, pauses on a durable timer, starts one
``summarise`` child run per result and sends the summary. Its budgets are the
seed's: ``max_transitions`` 20, ``max_for_each_items`` 12, ``max_state_bytes``
32768, ``max_cost_units`` 40, ``max_started_workflows`` 8. It shows:

1. idempotent dispatch: starting brief 42 twice with the key
   ``brief:42:research`` returns the same run (``created`` False);
2. a signal refused over budget: an approval whose notes would push the state
   past ``max_state_bytes`` raises `stepd.BudgetExceeded` (``.budget`` names
   it), nothing is recorded and the run keeps waiting; a smaller approval is
   then accepted and the run completes;
3. budget breaches: a planner that discovers 20 tasks fails its run at once
   with ``budget_exceeded`` / ``max_for_each_items`` (nothing is scheduled),
   and one with 10 results fails with ``max_started_workflows`` before any
   child run is created.

It exits 0 when every outcome is the expected one.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from typing import Any

import stepd

BUDGETS = {"max_transitions": 20, "max_for_each_items": 12, "max_state_bytes": 32768,
           "max_cost_units": 40, "max_started_workflows": 8}


def plan_research(ctx: stepd.StepContext, brief: dict[str, Any]) -> dict[str, Any]:
    # An agent planner: how much work it finds is up to it. The budgets bound it.
    tasks = [f"{brief['topic']}: source {i + 1}" for i in range(brief["breadth"])]
    ctx.patch_state(tasks=tasks)
    return {"planned": len(tasks)}


def execute_task(ctx: stepd.StepContext, task: str) -> dict[str, Any]:
    return {"task": task, "finding": f"finding #{ctx.item_index + 1}"}  # type: ignore[operator]


def summarise(ctx: stepd.StepContext, result: dict[str, Any]) -> str:
    return f"{result['finding']} ({result['task']})"


def send_summary(ctx: stepd.StepContext, input: Any, steps: dict[str, Any]) -> dict[str, Any]:
    return {"sent": True, "approved_by": steps["approval"]["by"],
            "summaries": steps["summarise"]}


summarise_wf = stepd.Workflow("summarise", version="summarise.v1").then(summarise)

research_run = (
    stepd.Workflow("research_run", version="research.v2")
    .then(plan_research, id="plan")
    .for_each("${state.tasks}", execute_task, id="tasks", into="results", max_parallel=4)
    .wait("approved", id="approval", timeout="1h", into="approval")
    .sleep("100ms", id="pause")
    .start_workflows(summarise_wf, "${state.results}", wait=True, into="summaries")
    .then(send_summary, id="send", delivery="at_most_once", retry=stepd.Retry(max_attempts=1))
    .budget(**BUDGETS)
)


def wait_for_signal_wait(client: stepd.Client, run: stepd.RunHandle,
                         timeout: float = 30.0) -> stepd.RunStatus:
    deadline = time.monotonic() + timeout
    while True:
        status = client.status(run)
        if status.waiting_for or status.done:
            return status
        if time.monotonic() > deadline:
            raise TimeoutError(f"run {run} is still {status.status}")
        time.sleep(0.02)


def show_budget(status: stepd.RunStatus) -> str:
    usage = dict(status.budget.usage)
    return ", ".join(f"{k} {usage.get(k[4:], '-')}/{v}" for k, v in status.budget.limits.items()
                     if v is not None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", help="a running daemon (default: an embedded one)")
    parser.add_argument("--key", help="its API key")
    args = parser.parse_args()
    checks: list[tuple[str, bool]] = []

    def check(what: str, ok: bool) -> None:
        checks.append((what, ok))
        print(f"  [{'ok' if ok else 'FAILED'}] {what}")

    with ExitStack() as stack:
        if args.url:
            target: Any = args.url
        else:
            target = stack.enter_context(
                stepd.embedded(stack.enter_context(tempfile.TemporaryDirectory()) + "/data"))
        client = stack.enter_context(stepd.Client(target, key=args.key))
        worker = stepd.Worker(client, concurrency=8, name="research-worker")
        worker.register(research_run, summarise_wf)
        thread = threading.Thread(target=worker.serve, kwargs={"handle_signals": False})
        thread.start()
        stack.callback(thread.join, 30)
        stack.callback(worker.stop)
        if not worker.wait_ready(10):
            print("the worker did not register", file=sys.stderr)
            return 1
        # A per-invocation tag keeps the keys fresh when this runs twice against one daemon.
        tag = "" if not args.url else f":{time.time_ns():x}"

        print(f"1. idempotent dispatch ({research_run.name} {research_run.version}, "
              f"hash {research_run.definition_hash[:12]})")
        brief = {"brief_id": 42, "topic": "LMDB durability", "breadth": 4}
        key = f"brief:42:research{tag}"
        run = client.start(research_run, brief, idempotency_key=key)
        again = client.start(research_run, brief, idempotency_key=key)
        print(f"  start -> {run.run_id} (created={run.created}); "
              f"again -> {again.run_id} (created={again.created})")
        check("the same key returns the original run", again == run and not again.created)
        status = client.status(run)
        print(f"  status: version {status.definition_version}, hash {status.definition_hash[:12]},"
              f" idempotency key {status.idempotency_key!r}")
        check("the run pins version and hash",
              status.definition_version == "research.v2"
              and status.definition_hash == research_run.definition_hash)

        print("2. a signal refused over budget, then a smaller one accepted")
        status = wait_for_signal_wait(client, run)
        print(f"  {status.status}, waiting for {status.waiting_for!r}; "
              f"state is {status.budget.usage['state_bytes']} bytes of "
              f"{BUDGETS['max_state_bytes']}")
        try:
            run.signal("approved", {"by": "editor@example.com", "notes": "x" * 40_000})
            check("the oversized approval is refused", False)
        except stepd.BudgetExceeded as exc:
            print(f"  refused: BudgetExceeded(budget={exc.budget!r}): {exc}")
            check("BudgetExceeded names max_state_bytes", exc.budget == "max_state_bytes")
        status = client.status(run)
        check(f"the run keeps waiting (status {status.status!r}, nothing recorded)",
              status.status == "waiting" and "approval" not in status.state)
        run.signal("approved", {"by": "editor@example.com", "notes": "ship it"})
        result = run.result(timeout=30)
        status = client.status(run)
        print(f"  accepted; run {status.status}: {len(result['summaries'])} summaries, "
              f"sent={result['sent']}")
        print(f"  budget used: {show_budget(status)}")
        check("the run completed with one summary per task",
              status.status == "completed" and len(result["summaries"]) == 4)

        print("3. budget breaches fail the run at once, with the budget's name")
        for breadth, budget in ((20, "max_for_each_items"), (10, "max_started_workflows")):
            wide = client.start(research_run, {"brief_id": 43, "topic": "everything",
                                               "breadth": breadth})
            if breadth == 10:  # it gets as far as the approval
                wait_for_signal_wait(client, wide)
                wide.signal("approved", {"by": "editor@example.com"})
            try:
                wide.result(timeout=30)
                check(f"a planner with {breadth} tasks fails", False)
                continue
            except stepd.RunFailed as exc:
                print(f"  {breadth} tasks: run {exc.status}, {exc.reason} at step {exc.step_id!r}: "
                      f"{exc.message}")
                check(f"{breadth} tasks: budget_exceeded naming {budget}",
                      exc.reason == "budget_exceeded" and budget in exc.message)
            events = client.journal(wide)
            offered = sum(1 for e in events if e["type"] == "step_offered" and e["step_id"] == "tasks")
            children = sum(1 for e in events if e["type"] == "child_started")
            print(f"    journal: {offered} task attempts offered, {children} child runs started")
            if budget == "max_for_each_items":
                check("nothing of the for_each was scheduled", offered == 0)
            else:
                check("no child run was created", children == 0)

    failed = [what for what, ok in checks if not ok]
    print(f"{len(checks) - len(failed)}/{len(checks)} checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
