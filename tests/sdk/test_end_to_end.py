"""A workflow end to end through `Worker` and `Client`, on every transport.

WebSocket and HTTP long-poll against ``stepd serve`` on 127.0.0.1 (uvicorn),
and the embedded daemon in process: the same code, the same results.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

import stepd

from .conftest import Stack, journal_types, serving, unique

pytestmark = pytest.mark.timeout(60)


async def classify(ctx: stepd.StepContext, input: Any, steps: dict[str, Any]) -> dict[str, Any]:
    ctx.patch_state(label="billing", ticket=input["ticket"])
    return {"label": "billing", "loop": "async"}


def draft(ctx: stepd.StepContext, input: Any, steps: dict[str, Any]) -> dict[str, Any]:
    # A plain function runs on a thread of the worker's pool, not on the event loop.
    return {"draft": f"about {ctx.state['label']}", "thread": threading.current_thread().name,
            "classified": steps["classify"]["label"]}


def short(ctx: stepd.StepContext) -> str:
    return f"{ctx.step_id}:{ctx.attempt}"


def bare() -> str:
    return "no arguments"


async def collect(ctx: stepd.StepContext, input: Any, steps: dict[str, Any]) -> dict[str, Any]:
    return steps


def support(name: str) -> stepd.Workflow:
    return (stepd.Workflow(name, version="v1").then(classify).then(draft)
            .then(short).then(bare).then(collect))


def test_a_run_goes_end_to_end(stack: Stack) -> None:
    name = unique("support")
    worker = stack.worker(support(name), concurrency=4, name="e2e-worker", build_id="b1")
    with serving(worker):
        assert worker.transport == stack.transport
        run = stack.client.start(name, {"ticket": 42}, idempotency_key=f"{name}:42",
                                 correlation={"ticket": "T-42"})
        assert isinstance(run, stepd.RunHandle) and run.created
        outputs = run.result(timeout=20)

    status = stack.client.status(run)
    assert status.status == "completed" and status.done
    assert status.workflow == name and status.definition_version == "v1"
    assert status.definition_hash == support(name).definition_hash
    assert status.state == {"label": "billing", "ticket": 42}
    assert status.correlation == {"ticket": "T-42"}
    assert status.idempotency_key == f"{name}:42"
    assert status.result == outputs and status.error is None
    assert status.raw["run_id"] == run.run_id
    assert outputs["classify"] == {"label": "billing", "loop": "async"}
    assert outputs["draft"]["thread"] != "MainThread" and "AnyIO" in outputs["draft"]["thread"]
    assert outputs["draft"]["classified"] == "billing"
    assert outputs["short"] == "short:1" and outputs["bare"] == "no arguments"

    types = journal_types(stack.client, run)
    assert types[0] == "run_started" and types[-1] == "run_completed"
    assert types.count("step_started") == 5 and types.count("step_completed") == 5
    offered = [e for e in stack.client.journal(run) if e["type"] == "step_offered"]
    assert {e.get("worker_name") for e in offered} == {"e2e-worker"}

    # The same idempotency key returns the original run.
    again = stack.client.start(name, {"ticket": 43}, idempotency_key=f"{name}:42")
    assert again == run and not again.created


def test_the_context_carries_the_lease(stack: Stack) -> None:
    name = unique("ctx")
    seen: list[dict[str, Any]] = []

    def item(ctx: stepd.StepContext, input: Any) -> int:
        seen.append({
            "run_id": ctx.run_id, "step_id": ctx.step_id, "attempt": ctx.attempt,
            "item_index": ctx.item_index, "key": ctx.idempotency_key, "lease": ctx.lease_id,
            "trace": ctx.trace_id, "span": ctx.span_id, "correlation": ctx.correlation,
            "current": stepd.current_context() is ctx, "state": dict(ctx.state),
        })
        return int(input) * 10

    wf = stepd.Workflow(name).for_each([1, 2, 3], item, into="tens")
    with serving(stack.worker(wf)):
        run = stack.client.start(name, None, correlation="c-1")
        assert run.result(timeout=20) == [10, 20, 30]
    assert stack.client.status(run).state["tens"] == [10, 20, 30]
    assert sorted(s["item_index"] for s in seen) == [0, 1, 2]
    for s in seen:
        assert s["run_id"] == run.run_id and s["step_id"] == "item" and s["attempt"] == 1
        assert s["correlation"] == "c-1" and s["current"] and s["state"] == {}
        assert s["lease"].startswith("l_") and len(s["trace"]) == 32 and len(s["span"]) == 16
    assert len({s["key"] for s in seen}) == 3  # one idempotency key per item


def test_body_errors_become_failure_classes(stack: Stack) -> None:
    name = unique("errors")
    attempts: list[int] = []

    async def flaky(ctx: stepd.StepContext, input: Any) -> str:
        attempts.append(ctx.attempt)
        if ctx.attempt == 1:
            raise stepd.Retryable("upstream 503")
        return "ok"

    def typed(ctx: stepd.StepContext, input: Any) -> None:
        raise stepd.StepFailure("rate_limited", "429 from upstream")

    def broken(ctx: stepd.StepContext, input: Any) -> None:
        raise ValueError("bad input 7")

    retry = stepd.Retry(max_attempts=2, initial_backoff=1)
    ok_wf = stepd.Workflow(name).then(flaky, retry=retry)
    typed_wf = stepd.Workflow(name + "-typed").then(typed)
    broken_wf = stepd.Workflow(name + "-broken").then(broken)
    with serving(stack.worker(ok_wf, typed_wf, broken_wf)):
        assert stack.client.start(ok_wf).result(timeout=20) == "ok"
        with pytest.raises(stepd.RunFailed) as typed_err:
            stack.client.start(typed_wf).result(timeout=20)
        with pytest.raises(stepd.RunFailed) as broken_err:
            stack.client.start(broken_wf).result(timeout=20)
    assert attempts == [1, 2]
    assert typed_err.type is stepd.RunFailed and typed_err.value.reason == "step_failed"
    assert typed_err.value.step_id == "typed" and "429 from upstream" in typed_err.value.message
    failed = [e for e in stack.client.journal(typed_err.value.run_id) if e["type"] == "step_failed"]
    assert [(e["error_class"], e["message"]) for e in failed] == [("rate_limited",
                                                                   "429 from upstream")]
    failed = [e for e in stack.client.journal(broken_err.value.run_id)
              if e["type"] == "step_failed"]
    assert failed[0]["error_class"] == "fatal"
    assert failed[0]["message"] == "ValueError: bad input 7"  # the message, never a traceback
