"""Local steps in the SDK, on every transport (WebSocket, HTTP, embedded): AFFINITY.md
"Local steps".

The daemons here use short lease timings (TTL 300 ms, heartbeats every 100 ms),
so a parent lease that stopped renewing while its local bodies ran would
expire within the test and show as ``step_orphaned`` / a second attempt.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import anyio
import pytest

import stepd

from .conftest import Stack, eventually, journal_types, serving, unique

pytestmark = pytest.mark.timeout(60)

NO_BACKOFF = stepd.Retry(max_attempts=3, initial_backoff=0)


class Seen:
    """What the bodies saw, by step id (thread-safe: sync bodies run in threads)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls: list[tuple[str, int, str, str | None]] = []

    def add(self, ctx: stepd.StepContext) -> None:
        with self.lock:
            self.calls.append((ctx.step_id, ctx.attempt, ctx.lease_id, ctx.idempotency_key))

    def of(self, step_id: str) -> list[tuple[str, int, str, str | None]]:
        with self.lock:
            return [c for c in self.calls if c[0] == step_id]


def pipeline(name: str, seen: Seen, **options: Any) -> stepd.Workflow:
    """prep -> norm (local, fails its first attempt) -> tally (ordinary)."""

    def prep(ctx: stepd.StepContext, input: Any) -> dict[str, Any]:
        seen.add(ctx)
        ctx.patch_state(prepped=True)
        return {"n": int(input["n"]) + 1}

    def norm(ctx: stepd.StepContext, input: Any) -> int:
        seen.add(ctx)
        assert ctx.state["prepped"] is True  # the parent's patch, before the daemon saw it
        if ctx.attempt == 1:
            raise stepd.Retryable("first attempt fails")
        ctx.heartbeat({"done": 1})
        return int(input) * 10

    def tally(ctx: stepd.StepContext, input: Any) -> int:
        seen.add(ctx)
        return int(input) + 1

    return (stepd.Workflow(name).then(prep)
            .then(norm, input="${steps.prep.n}", local=True, retry=NO_BACKOFF, **options)
            .then(tally, input="${steps.norm}"))


def test_local_steps_run_in_the_parent_worker_with_no_lease_of_their_own(
        fast_stack: Stack) -> None:
    name, seen = unique("local"), Seen()
    worker = fast_stack.worker(pipeline(name, seen), local_steps=True)
    with serving(worker):
        run = fast_stack.client.start(name, {"n": 1})
        assert run.result(timeout=20) == 21
    prep_lease = seen.of("prep")[0][2]
    # Both attempts of norm ran under the parent's lease, with a stable idempotency key.
    assert [(c[1], c[2], c[3]) for c in seen.of("norm")] == [
        (1, prep_lease, f"{run.run_id}/norm"), (2, prep_lease, f"{run.run_id}/norm")]
    events = fast_stack.client.journal(run)
    norm = [e for e in events if e.get("step_id") == "norm"]
    assert {e.get("execution_mode") for e in norm} == {"local"}
    assert [e["type"] for e in norm] == ["step_scheduled", "step_started", "step_failed",
                                         "step_started", "step_completed"]
    assert norm[-1]["progress"] == {"done": 1} and norm[-1]["input"] == 2
    offered = [e["step_id"] for e in events if e["type"] == "step_offered"]
    assert offered == ["prep", "tally"]  # no round trip for norm
    assert "step_orphaned" not in [e["type"] for e in events]
    # The workers list shows what the worker declared.
    me = next(w for w in fast_stack.client.workers() if w["worker_id"] == worker.worker_id)
    assert me["protocol_version"] == "1.20" and me["capabilities"] == ["local_steps"]
    assert me["manifest"]["local_steps"] == {"status": "supported"}
    assert me["manifest"]["sessions"] == {"status": "rejected"}


def test_a_worker_without_local_steps_gets_them_as_ordinary_leases(fast_stack: Stack) -> None:
    name, seen = unique("nolocal"), Seen()
    worker = fast_stack.worker(pipeline(name, seen))  # local_steps off: the default
    with serving(worker):
        run = fast_stack.client.start(name, {"n": 1})
        assert run.result(timeout=20) == 21
    events = fast_stack.client.journal(run)
    assert not [e for e in events if "execution_mode" in e]
    assert [e["step_id"] for e in events if e["type"] == "step_offered"] == [
        "prep", "norm", "norm", "tally"]
    assert len({c[2] for c in seen.calls}) == 4  # a lease per attempt
    me = next(w for w in fast_stack.client.workers() if w["worker_id"] == worker.worker_id)
    assert me["capabilities"] == [] and me["manifest"]["local_steps"] == {"status": "rejected"}


def test_the_parent_lease_is_renewed_while_local_bodies_run(fast_stack: Stack) -> None:
    name = unique("renew")

    def prep(ctx: stepd.StepContext) -> str:
        return "p"

    async def slow(ctx: stepd.StepContext) -> str:
        await anyio.sleep(0.9)  # three lease TTLs, no heartbeat of its own
        return "slow"

    wf = stepd.Workflow(name).then(prep).then(slow, local=True)
    worker = fast_stack.worker(wf, local_steps=True)
    with serving(worker):
        run = fast_stack.client.start(name)
        assert run.result(timeout=20) == "slow"
    types = journal_types(fast_stack.client, run)
    assert "step_orphaned" not in types and types.count("step_offered") == 1


def test_per_attempt_timeout_stops_an_async_local_body_and_retries_it(fast_stack: Stack) -> None:
    name, attempts = unique("attempt-timeout"), []

    def prep(ctx: stepd.StepContext) -> str:
        return "p"

    async def hang(ctx: stepd.StepContext) -> str:
        attempts.append(ctx.attempt)
        if ctx.attempt == 1:
            await anyio.sleep_forever()  # interrupted at its 100 ms timeout
        return "second"

    wf = stepd.Workflow(name).then(prep).then(hang, local=True, timeout=100, retry=NO_BACKOFF)
    worker = fast_stack.worker(wf, local_steps=True)
    with serving(worker):
        run = fast_stack.client.start(name)
        assert run.result(timeout=20) == "second"
    failed = [e for e in fast_stack.client.journal(run) if e["type"] == "step_failed"]
    assert [(e["step_id"], e["error_class"], e["execution_mode"]) for e in failed] == [
        ("hang", "timeout", "local")]
    assert attempts == [1, 2]


def test_total_timeout_is_observed_at_heartbeat_in_a_sync_body(fast_stack: Stack) -> None:
    name = unique("total-timeout")
    stopped = threading.Event()

    def prep(ctx: stepd.StepContext) -> str:
        return "p"

    def spin(ctx: stepd.StepContext) -> str:
        deadline = time.monotonic() + 10
        try:
            while time.monotonic() < deadline:  # bounded: the heartbeat raises first
                time.sleep(0.01)
                ctx.heartbeat()
        except stepd.Cancelled:
            stopped.set()
            raise
        return "never"

    wf = stepd.Workflow(name).then(prep).then(spin, local=True, total_timeout=150,
                                                 retry=NO_BACKOFF)
    worker = fast_stack.worker(wf, local_steps=True)
    with serving(worker):
        run = fast_stack.client.start(name)
        eventually(lambda: fast_stack.client.status(run).status == "failed", what="the failure")
    assert stopped.is_set()
    events = fast_stack.client.journal(run)
    failed = next(e for e in events if e["type"] == "run_failed")
    assert failed["error"]["step_id"] == "spin"
    assert failed["error"]["message"].startswith("total_timeout")
    # One attempt: the total timeout ends the step, no retry after it.
    assert [e["attempt"] for e in events if e["type"] == "step_started"
            and e.get("step_id") == "spin"] == [1]


def test_a_cancelled_run_stops_its_local_body_and_reports_nothing(fast_stack: Stack) -> None:
    name = unique("cancel-local")
    entered, stopped = threading.Event(), threading.Event()

    def prep(ctx: stepd.StepContext) -> str:
        return "p"

    def wait(ctx: stepd.StepContext) -> str:
        entered.set()
        deadline = time.monotonic() + 10
        try:
            while time.monotonic() < deadline:
                time.sleep(0.01)
                ctx.heartbeat()
        except stepd.Cancelled:
            stopped.set()
            raise
        return "never"

    wf = stepd.Workflow(name).then(prep).then(wait, local=True)
    worker = fast_stack.worker(wf, local_steps=True)
    with serving(worker):
        run = fast_stack.client.start(name)
        assert entered.wait(10)
        fast_stack.client.cancel(run)
        assert stopped.wait(10)  # the parent's cancel reached the local body
    assert fast_stack.client.status(run).status == "cancelled"
    assert not [e for e in fast_stack.client.journal(run) if e.get("execution_mode")]


def test_shutdown_completes_the_parent_with_the_local_steps_finished_so_far(
        fast_stack: Stack) -> None:
    name = unique("stop-local")
    entered = threading.Event()

    def prep(ctx: stepd.StepContext) -> str:
        return "p"

    def quick(ctx: stepd.StepContext) -> str:
        return "q"

    async def long(ctx: stepd.StepContext) -> str:
        if ctx.lease.get("execution_mode") == "local":
            entered.set()
            await anyio.sleep_forever()  # cut at the end of the grace period
        return "as a lease"

    wf = stepd.Workflow(name).then(prep).then(quick, local=True).then(long, local=True)
    first = fast_stack.worker(wf, local_steps=True, name="first")
    with serving(first, grace=0.2):
        run = fast_stack.client.start(name)
        assert entered.wait(10)
    # Stopped: prep completed with quick's record; long was cut and never reported.
    events = fast_stack.client.journal(run)
    assert [e["step_id"] for e in events if e["type"] == "step_completed"] == ["prep", "quick"]
    assert [e.get("execution_mode") for e in events if e["type"] == "step_completed"] == [
        None, "local"]
    second = fast_stack.worker(wf, name="second")  # no local steps: long comes as a lease
    with serving(second):
        assert run.result(timeout=20) == "as a lease"


def test_losing_the_parent_lease_stops_the_local_body(fast_stack: Stack) -> None:
    """The parent's ``timeout_ms`` covers its local steps (one lease): when it passes, the
    daemon fences the lease and the local body is stopped; nothing of it is reported."""
    name = unique("fenced-local")
    stopped = threading.Event()

    def prep(ctx: stepd.StepContext) -> str:
        return "p"

    async def long(ctx: stepd.StepContext) -> str:
        try:
            await anyio.sleep_forever()  # until the lost lease stops it
        except BaseException:
            stopped.set()
            raise
        return "never"

    wf = (stepd.Workflow(name).then(prep, timeout=200, retry=stepd.Retry(max_attempts=1))
          .then(long, local=True))
    worker = fast_stack.worker(wf, local_steps=True)
    with serving(worker):
        run = fast_stack.client.start(name)
        eventually(lambda: fast_stack.client.status(run).status == "failed", what="the failure")
        assert stopped.wait(10)
    events = fast_stack.client.journal(run)
    assert [e["error_class"] for e in events if e["type"] == "step_failed"] == ["timeout"]
    assert not [e for e in events if e.get("execution_mode")]


def test_local_steps_and_sticky_execution_on_one_worker(fast_stack: Stack) -> None:
    """Both capabilities declared by the one manifest builder; the step after the local one
    goes to the holder as a delta that already holds the local step's output (a hit)."""
    name, seen = unique("localsticky"), Seen()
    worker = fast_stack.worker(pipeline(name, seen), local_steps=True, sticky_cache_capacity=4)
    with serving(worker):
        run = fast_stack.client.start(name, {"n": 1})
        assert run.result(timeout=20) == 21
    assert [e["step_id"] for e in fast_stack.client.journal(run)
            if e["type"] == "step_offered"] == ["prep", "tally"]

    def mine() -> dict[str, Any]:
        return next(w for w in fast_stack.client.workers() if w["worker_id"] == worker.worker_id)

    me = mine()
    assert me["capabilities"] == ["local_steps", "sticky"]
    assert me["manifest"]["local_steps"] == {"status": "supported"}
    assert me["manifest"]["sticky"]["status"] == "supported"
    assert me["manifest"]["sticky"]["capacity"] == 4
    assert eventually(lambda: {k: (mine()["sticky"] or {}).get(k) for k in ("hit", "miss")}
                      == {"hit": 1, "miss": 1}, what="one miss (prep), one hit (tally)")
    with pytest.raises(stepd.Invalid) as err:
        stepd.Worker(fast_stack.client, protocol_version="1.17", sticky_cache_capacity=4)
    assert err.value.field == "protocol_version"


def test_a_local_bodys_usage_and_spans_are_priced_into_the_run_and_its_trace(
        fast_stack: Stack) -> None:
    """ctx.span / ctx.set_usage in a local body count as a remote body's do: priced with
    the daemon's price book (model ``m``: 1 and 2 USD per million tokens), summed into
    the run's usage, and shown in its trace under the local step's span."""
    from stepd.sansio.local_steps import local_span_id
    from stepd.sansio.trace import TraceBuilder

    name = unique("localusage")

    def ask(ctx: stepd.StepContext, input: Any) -> int:
        with ctx.span("llm.call") as span:
            span.set_usage(model="m", input_tokens=1000, output_tokens=500)
        return 1

    def summarise(ctx: stepd.StepContext, input: Any) -> int:
        with ctx.span("llm.call", attempt=ctx.attempt) as span:
            span.set_usage(model="m", input_tokens=100 * ctx.attempt, output_tokens=0)
        if ctx.attempt == 1:
            raise stepd.Retryable("try again")  # its tokens were spent all the same
        return 2

    def grade(ctx: stepd.StepContext, input: Any) -> int:
        ctx.set_usage(model="m", input_tokens=7, output_tokens=3)
        return 3

    flow = (stepd.Workflow(name).then(ask)
            .then(summarise, local=True, retry=NO_BACKOFF)
            .then(grade, local=True))
    worker = fast_stack.worker(flow, local_steps=True)
    with serving(worker):
        run = fast_stack.client.start(name, {})
        assert run.result(timeout=20) == 3
    status = fast_stack.client.status(run)
    # 1000 + 100 + 200 + 7 in, 500 + 3 out.
    assert (status.usage.input_tokens, status.usage.output_tokens) == (1307, 503)
    assert status.usage.cost_usd == pytest.approx((1307 * 1 + 503 * 2) / 1e6)
    events = fast_stack.client.journal(run)
    assert [e["step_id"] for e in events if e["type"] == "step_offered"] == ["ask"]
    lease_id = next(e["lease_id"] for e in events if e["type"] == "step_offered")
    done = {e["step_id"]: e for e in events if e["type"] == "step_completed"}
    summary_span = local_span_id(lease_id, "summarise")
    assert [s["parent_span_id"] for s in done["summarise"]["spans"]] == [summary_span] * 2
    assert done["summarise"]["usage"]["cost_usd"] == pytest.approx(300 / 1e6)
    assert done["grade"]["usage"] == {"model": "m", "input_tokens": 7, "output_tokens": 3,
                                      "cost_usd": pytest.approx((7 + 6) / 1e6)}
    # The trace (what the OTel export sends): the local steps under the parent's span,
    # their body spans under them.
    spans = TraceBuilder().feed(run.run_id, {}, events)
    by_id = {s.span_id: s for s in spans}
    assert by_id[summary_span].attributes["stepd.execution_mode"] == "local"
    assert [s.name for s in spans if s.parent_span_id == summary_span] == ["llm.call"] * 2
    assert by_id[local_span_id(lease_id, "grade")].attributes["gen_ai.usage.input_tokens"] == 7
    # The run's export lists them with the run's other spans.
    assert len([s for s in fast_stack.client.export(run)["spans"]
                if s["step_id"] == "summarise"]) == 2
