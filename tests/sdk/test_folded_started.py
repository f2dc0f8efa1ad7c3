"""The SDK folds an at_least_once `started` into `complete` when the body ends
before its first heartbeat is due, and sends it on its own when the body runs
longer (docs/leases.md "A folded started"). On every transport, the journal
reads the same either way: `step_started` before `step_completed`.
"""

from __future__ import annotations

import time
from typing import Any

import stepd

from .conftest import Stack, serving, unique


def _steps(stack: Stack, run_id: str) -> list[str]:
    return [e["type"] for e in stack.client.journal(run_id) if e["type"].startswith("step_")]


def test_fast_bodies_fold_and_slow_ones_say_started_while_running(fast_stack: Stack) -> None:
    fast = stepd.Workflow(unique()).then("quick", id="a").then("quick", id="b")
    slow = stepd.Workflow(unique()).then("slow", id="a")
    seen: list[str] = []

    async def quick(ctx: stepd.StepContext, input: Any) -> str:
        return "q"

    def slow_body(ctx: stepd.StepContext, input: Any) -> str:
        # Stay in the body until the daemon shows the attempt started: only the
        # held-back `started`, sent at the heartbeat gap (25 ms here), does that.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if "step_started" in _steps(fast_stack, ctx.run_id):
                seen.append("started while running")
                break
            time.sleep(0.01)
        return "s"

    worker = fast_stack.worker(fast, slow, bodies={"quick": quick, "slow": slow_body})
    with serving(worker):
        r1 = fast_stack.client.start(fast.name, None)
        assert r1.result(timeout=20) == "q"
        r2 = fast_stack.client.start(slow.name, None)
        assert r2.result(timeout=20) == "s"
    assert seen == ["started while running"]
    assert _steps(fast_stack, r1.run_id).count("step_started") == 2
    for run in (r1, r2):
        events = _steps(fast_stack, run.run_id)
        assert events.index("step_started") < events.index("step_completed"), events
