"""The worker: unservable leases, graceful stop, spans and usage, fallback, reconnects."""

from __future__ import annotations

import threading
import time
from typing import Any

import anyio
import pytest

import stepd

from .conftest import NetDaemon, Proxy, Stack, eventually, journal_types, serving, unique

pytestmark = pytest.mark.timeout(60)


def test_a_lease_for_a_body_the_worker_lacks_is_failed_unservable(stack: Stack) -> None:
    name = unique("unservable")

    def b(ctx: stepd.StepContext, input: Any) -> str:
        return "served by the second worker"

    # The first worker registers the definition but holds no callable for "b".
    lacking = stack.worker(stepd.Workflow(name, version="v1").then("b"), name="lacking")
    holding = stack.worker(stepd.Workflow(name, version="v1").then(b), name="holding")
    with serving(lacking):
        run = stack.client.start(name)
        eventually(lambda: "step_unservable" in journal_types(stack.client, run),
                   what="the unservable answer")
        assert stack.client.status(run).status == "running"
        with serving(holding):
            assert run.result(timeout=20) == "served by the second worker"
    events = stack.client.journal(run)
    unservable = [e for e in events if e["type"] == "step_unservable"]
    assert len(unservable) == 1 and unservable[0]["worker_id"] == lacking.worker_id
    assert "holds no body 'b'" in unservable[0]["message"]
    started = [e for e in events if e["type"] == "step_started"]
    assert [e["worker_id"] for e in started] == [holding.worker_id]  # no body ran before
    assert "step_failed" not in [e["type"] for e in events]  # no retry budget spent


def test_stop_lets_a_running_body_finish_within_the_grace_period(stack: Stack) -> None:
    name = unique("grace")
    running = threading.Event()

    async def slow(ctx: stepd.StepContext, input: Any) -> str:
        running.set()
        await anyio.sleep(0.3)
        return "finished"

    wf = stepd.Workflow(name).then(slow)
    worker = stack.worker(wf)
    with serving(worker, grace=10.0):
        run = stack.client.start(wf)
        assert running.wait(10)
    # serving() called stop(grace=10) and joined: the body had finished and was reported.
    assert stack.client.status(run).status == "completed"
    assert run.result(timeout=5) == "finished"


@pytest.mark.parametrize("kind", ["async", "sync"])
def test_a_body_past_the_grace_period_is_failed_back_and_retried_elsewhere(
        stack: Stack, kind: str) -> None:
    name = unique("pastgrace")
    running = threading.Event()
    ended: list[str | None] = []

    if kind == "async":
        async def stubborn(ctx: stepd.StepContext, input: Any) -> str:
            if ctx.attempt == 1:
                running.set()
                try:
                    await anyio.sleep_forever()  # until the test cancels it
                finally:
                    ended.append(ctx.cancel_reason)
            return f"attempt {ctx.attempt}"
    else:
        def stubborn(ctx: stepd.StepContext, input: Any) -> str:  # type: ignore[misc]
            if ctx.attempt == 1:
                running.set()
                ctx.cancel_event.wait(30)  # a well-behaved sync body watches its event
                ended.append(ctx.cancel_reason)
                ctx.check_cancelled()
            return f"attempt {ctx.attempt}"

    wf = stepd.Workflow(name).then(stubborn, retry=stepd.Retry(max_attempts=3,
                                                               initial_backoff=1))
    first = stack.worker(wf, name="first")
    second = stack.worker(wf, name="second")
    with serving(first, grace=0.2):
        run = stack.client.start(wf)
        assert running.wait(10)
        started = time.monotonic()
    assert time.monotonic() - started < 10
    eventually(lambda: ended == ["shutdown"], what="the body to see the shutdown")
    with serving(second):
        assert run.result(timeout=20) == "attempt 2"
    events = stack.client.journal(run)
    failed = [e for e in events if e["type"] == "step_failed"]
    assert len(failed) == 1 and failed[0]["error_class"] == "retryable"
    assert failed[0]["worker_id"] == first.worker_id
    assert "stopped" in failed[0]["message"]
    completed = [e for e in events if e["type"] == "step_completed"]
    assert [(e["attempt"], e["worker_id"]) for e in completed] == [(2, second.worker_id)]


def test_a_sync_body_ignoring_cancellation_is_abandoned_after_the_grace_period(
        stack: Stack) -> None:
    name = unique("deaf")
    running = threading.Event()
    release = threading.Event()

    def deaf(ctx: stepd.StepContext, input: Any) -> str:
        if ctx.attempt == 1:
            running.set()
            release.wait(30)  # never looks at ctx.cancel_event
        return f"attempt {ctx.attempt}"

    wf = stepd.Workflow(name).then(deaf, retry=stepd.Retry(initial_backoff=1))
    worker = stack.worker(wf)
    try:
        with serving(worker, grace=0.1):
            run = stack.client.start(wf)
            assert running.wait(10)
        failed = [e for e in stack.client.journal(run) if e["type"] == "step_failed"]
        assert [e["error_class"] for e in failed] == ["retryable"]
    finally:
        release.set()  # let the abandoned thread end


def test_a_stopping_worker_takes_no_new_lease(stack: Stack) -> None:
    # The stopping worker still runs a body (grace); a run started meanwhile goes
    # to another worker. WebSocket credit cannot be taken back by a frame: the
    # worker closes the connection (its push session hands unoffered slots back)
    # and reconnects without credit; a lease pushed before that is handed back
    # as unservable (no retry budget spent), never run and never dropped. A lease
    # offered to it as its connection closes, before the push, is released by the
    # daemon instead (`step_recovered`, released, not started): no budget spent either.
    name = unique("late")
    running = threading.Event()
    release = threading.Event()

    async def hold(ctx: stepd.StepContext, input: Any) -> str:
        if input == "hold":
            running.set()
            while not release.is_set():
                await anyio.sleep(0.01)
        return f"done {input}"

    wf = stepd.Workflow(name).then(hold)
    first = stack.worker(wf, concurrency=2, name="first")
    second = stack.worker(wf, name="second")
    try:
        with serving(first, grace=10.0):
            held = stack.client.start(wf, "hold")
            assert running.wait(10)
            first.stop(grace=10.0)  # one slot free, its credit granted
            eventually(lambda: first.stopping, what="stopping")
            late = stack.client.start(wf, "late")
            with serving(second):
                assert late.result(timeout=20) == "done late"
            assert first.running == 1  # still finishing "hold" within its grace
            release.set()
    finally:
        release.set()
    assert held.result(timeout=10) == "done hold"
    events = stack.client.journal(late)
    started = [e["worker_id"] for e in events if e["type"] == "step_started"]
    assert started == [second.worker_id]
    offered_to_first = [e for e in events
                        if e["type"] == "step_offered" and e["worker_id"] == first.worker_id]
    unservable = [e for e in events if e["type"] == "step_unservable"]
    released = [e for e in events if e["type"] == "step_recovered" and e["released"]
                and not e["started"]]
    assert sorted(e["lease_id"] for e in unservable + released) == \
        sorted(e["lease_id"] for e in offered_to_first)
    assert all("is stopping" in e["message"] for e in unservable)
    assert {e["attempt"] for e in events if e["type"] == "step_offered"} == {1}


def test_spans_roll_usage_up_into_the_step_and_the_run(stack: Stack) -> None:
    name = unique("spans")

    async def agent(ctx: stepd.StepContext, input: Any) -> dict[str, Any]:
        with ctx.span("plan", phase="1") as outer:
            outer.set_usage(model="m", input_tokens=100, output_tokens=10)
            with ctx.span("llm.call") as inner:
                inner.set_usage(model="m", input_tokens=20, output_tokens=5)
                with ctx.span("tool") as innermost:
                    innermost.add_usage(model="m", input_tokens=3)
                    innermost.add_usage(output_tokens=1)
        ctx.heartbeat({"progress": 1.0})
        return {"usage": ctx.usage, "ids": [outer.span_id, inner.span_id, innermost.span_id]}

    def explicit(ctx: stepd.StepContext, input: Any) -> str:
        with ctx.span("ignored") as s:
            s.set_usage(model="m", input_tokens=999, output_tokens=999)
        ctx.set_usage(model="m", input_tokens=1000, output_tokens=1)  # overrides the spans
        return "ok"

    wf = stepd.Workflow(name).then(agent).then(explicit)
    with serving(stack.worker(wf)):
        run = stack.client.start(wf)
        assert run.result(timeout=20) == "ok"
    status = stack.client.status(run)
    assert status.usage.input_tokens == 123 + 1000
    assert status.usage.output_tokens == 16 + 1
    assert status.usage.cost_usd == pytest.approx((1123 * 1.0 + 17 * 2.0) / 1e6)

    export = stack.client.export(run)
    spans = {s["name"]: s for s in export["spans"] if s["step_id"] == "agent"}
    lease_span = spans["plan"]["parent_span_id"]
    assert len(lease_span) == 16
    assert spans["llm.call"]["parent_span_id"] == spans["plan"]["span_id"]
    assert spans["tool"]["parent_span_id"] == spans["llm.call"]["span_id"]
    # Each span carries its own usage, exclusive of its children.
    assert spans["plan"]["usage"]["input_tokens"] == 100
    assert spans["llm.call"]["usage"]["input_tokens"] == 20
    assert spans["tool"]["usage"] == {"model": "m", "input_tokens": 3, "output_tokens": 1,
                                      "cost_usd": pytest.approx(5e-6)}
    assert spans["plan"]["attributes"] == {"phase": "1"}
    for s in spans.values():
        assert s["end_ms"] >= s["start_ms"] > 0


def test_the_worker_falls_back_to_http_when_the_websocket_is_refused(
        net: NetDaemon, make_proxy: Any) -> None:
    proxy: Proxy = make_proxy(net)
    proxy.refuse_websocket = True
    name = unique("fallback")

    def echo(ctx: stepd.StepContext, input: Any) -> Any:
        return input

    wf = stepd.Workflow(name).then(echo)
    with stepd.Client(proxy.url, trust_env=False) as client:
        worker = stepd.Worker(client).register(wf)  # transport="auto"
        with serving(worker):
            assert worker.transport == "http"
            assert client.start(wf, {"x": 1}).result(timeout=20) == {"x": 1}
    assert proxy.refused == 1


@pytest.mark.parametrize("transport", ["websocket", "http"])
def test_a_worker_keeps_its_leases_across_a_reconnect(net: NetDaemon, make_proxy: Any,
                                                      transport: str) -> None:
    proxy: Proxy = make_proxy(net)
    name = unique("reconnect")
    running = threading.Event()
    release = threading.Event()

    async def long(ctx: stepd.StepContext, input: Any) -> str:
        running.set()
        while not release.is_set():
            await anyio.sleep(0.01)
        return "survived"

    wf = stepd.Workflow(name).then(long)
    with stepd.Client(net.url, trust_env=False) as client:
        worker = stepd.Worker(proxy.url, transport=transport).register(wf)
        with serving(worker):
            worker_id = worker.worker_id
            run = client.start(wf)
            assert running.wait(10)
            before = proxy.connections
            proxy.cut()
            eventually(lambda: proxy.connections > before, what="a reconnect")
            release.set()
            assert run.result(timeout=20) == "survived"
            assert worker.worker_id == worker_id
            assert worker.errors == []
        events = client.journal(run)
        assert [e["type"] for e in events].count("step_offered") == 1  # the same lease
        workers = {w["worker_id"]: w for w in client.workers()}
        assert workers[worker_id]["name"] == worker.name


def test_sigterm_stops_a_serving_worker_gracefully(net: NetDaemon, tmp_path: Any) -> None:
    import os
    import signal
    import subprocess
    import sys
    import textwrap

    name = unique("sigterm")
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time, anyio, stepd

        async def slow(ctx, input):
            print("running", flush=True)
            await anyio.sleep(0.5)
            return "finished despite SIGTERM"

        wf = stepd.Workflow({name!r}).then(slow)
        worker = stepd.Worker({net.url!r}, grace=10).register(wf)
        worker.serve()
        print("served", flush=True)
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "NO_PROXY": "*"})
    try:
        with stepd.Client(net.url, trust_env=False) as client:
            run = eventually(lambda: _try_start(client, name), what="the worker to register")
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == "running"
            proc.send_signal(signal.SIGTERM)
            assert run.result(timeout=20) == "finished despite SIGTERM"
            assert proc.wait(20) == 0
            assert proc.stdout.read().strip() == "served"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def _try_start(client: stepd.Client, name: str) -> stepd.RunHandle | None:
    try:
        return client.start(name)
    except stepd.Unprocessable:  # not registered yet
        return None


def test_heartbeats_keep_a_long_body_s_lease_alive(fast_stack: Stack) -> None:
    """Bodies longer than a lease TTL plus its recovery window keep their first attempt.

    fast_stack: TTL 300 ms, heartbeats every 100 ms. The worker starts a lease's
    heartbeat task only once its body has run for the heartbeat gap (25 ms
    here); a body shorter than that never needs one. One body heartbeats on its
    own only; the other also reports progress (`ctx.heartbeat`) on the way.
    """
    stack = fast_stack
    name = unique("beats")

    async def quiet(ctx: stepd.StepContext, input: Any) -> int:
        await anyio.sleep(0.7)  # TTL 0.3 s + recovery window 0.2 s: recovered without beats
        return ctx.attempt

    def chatty(ctx: stepd.StepContext, input: Any, steps: dict[str, Any]) -> int:
        for i in range(7):
            ctx.heartbeat({"done": i})
            time.sleep(0.1)
        return ctx.attempt

    wf = stepd.Workflow(name).then(quiet).then(chatty)
    worker = stack.worker(wf)
    with serving(worker):
        run = stack.client.start(wf)
        assert run.result(timeout=20) == 1
        eventually(lambda: not worker._active, what="every lease released")
    types = journal_types(stack.client, run)
    assert "step_orphaned" not in types and "step_recovered" not in types
    assert [e["attempt"] for e in stack.client.journal(run) if e["type"] == "step_completed"] \
        == [1, 1]
