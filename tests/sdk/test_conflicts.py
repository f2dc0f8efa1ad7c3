"""Every 409 branch of the worker, provoked for real, and cancellation reaching bodies.

* ``run_terminal``: a run cancelled while its bodies run (an async body and a
  sync body); the bodies are cancelled (WebSocket/in-process ``cancel`` push,
  or the heartbeat's 409 over HTTP), nothing more is posted, and the worker
  remembers the run.
* ``fenced``: the step's timeout passes while the body runs; the daemon fences
  the lease; the body is cancelled; the retry completes. And a lease that
  expires (the worker stops heartbeating) and is recovered: the late result
  is dropped, the new attempt completes.
* ``already_applied``: the daemon's answer to ``complete`` is lost on the
  network (a proxy swallows it, then cuts the connection); the worker sends
  ``complete`` again on the next connection, gets ``already_applied``, and
  treats it as success.
* ``not_started``: a worker with a bug (it skips ``started``) completes an
  ``at_most_once`` step; the worker logs an error, stops and raises.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import anyio
import pytest

import stepd

from .conftest import (
    NetDaemon,
    Proxy,
    Stack,
    eventually,
    journal_types,
    serving,
    unique,
)

pytestmark = pytest.mark.timeout(60)


def test_cancelling_a_run_cancels_its_async_and_sync_bodies(fast_stack: Stack) -> None:
    stack = fast_stack
    name = unique("cancel")
    running = {"async": threading.Event(), "sync": threading.Event()}
    seen: dict[str, Any] = {}

    async def hold_async(ctx: stepd.StepContext, input: Any) -> str:
        running["async"].set()
        try:
            await anyio.sleep_forever()  # until the test cancels it
        finally:
            seen["async"] = (ctx.cancelled, ctx.cancel_reason, ctx.cancel_scope.cancel_called)
        return "not reached"

    def hold_sync(ctx: stepd.StepContext, input: Any) -> str:
        running["sync"].set()
        fired = ctx.cancel_event.wait(30)
        seen["sync"] = (fired, ctx.cancel_reason)
        ctx.check_cancelled()  # raises stepd.Cancelled
        return "not reached"

    wf_async = stepd.Workflow(name + "-a").then(hold_async)
    wf_sync = stepd.Workflow(name + "-s").then(hold_sync)
    worker = stack.worker(wf_async, wf_sync, concurrency=4)
    with serving(worker):
        run_a = stack.client.start(wf_async)
        run_s = stack.client.start(wf_sync)
        assert running["async"].wait(10) and running["sync"].wait(10)
        run_a.cancel()
        stack.client.cancel(run_s)
        eventually(lambda: len(seen) == 2, what="both bodies cancelled")
        assert seen["async"] == (True, "run_terminal", True)
        assert seen["sync"] == (True, "run_terminal")
        for run in (run_a, run_s):
            with pytest.raises(stepd.RunCancelled) as err:
                run.result(timeout=10)
            assert err.value.status == "cancelled" and err.value.reason == "cancelled"
            # run_terminal: the worker takes nothing more of the run.
            eventually(lambda run=run: worker._run_is_over(run.run_id), what="run remembered")
        # Nothing was posted for the cancelled attempts, and no error was recorded.
        eventually(lambda: worker.running == 0, what="leases released")
        assert worker.errors == []
    for run in (run_a, run_s):
        types = journal_types(stack.client, run)
        assert "step_completed" not in types and "step_failed" not in types
        assert types[-1] == "run_cancelled"


@pytest.mark.parametrize("kind", ["async", "sync"])
def test_a_fenced_lease_cancels_its_body_and_the_retry_completes(fast_stack: Stack,
                                                                   kind: str) -> None:
    stack = fast_stack
    name = unique("fenced")
    seen: list[tuple[int, str | None]] = []

    if kind == "async":
        async def slow(ctx: stepd.StepContext, input: Any) -> int:
            if ctx.attempt == 1:
                try:
                    await anyio.sleep_forever()  # until the test cancels it
                finally:
                    seen.append((ctx.attempt, ctx.cancel_reason))
            return ctx.attempt
    else:
        def slow(ctx: stepd.StepContext, input: Any) -> int:  # type: ignore[misc]
            if ctx.attempt == 1:
                ctx.cancel_event.wait(30)
                seen.append((ctx.attempt, ctx.cancel_reason))
                ctx.check_cancelled()
            return ctx.attempt

    retry = stepd.Retry(max_attempts=2, initial_backoff=1, retry_on=["timeout"])
    wf = stepd.Workflow(name).then(slow, timeout="400ms", retry=retry)
    worker = stack.worker(wf)
    with serving(worker):
        run = stack.client.start(wf)
        assert run.result(timeout=20) == 2
        assert worker.errors == []
    assert seen == [(1, "fenced")]
    events = stack.client.journal(run)
    failed = [e for e in events if e["type"] == "step_failed"]
    assert [(e["attempt"], e["error_class"]) for e in failed] == [(1, "timeout")]
    completed = [e for e in events if e["type"] == "step_completed"]
    assert [e["attempt"] for e in completed] == [2]


def test_an_expired_lease_is_recovered_and_its_late_result_dropped(
        fast_stack: Stack, caplog: pytest.LogCaptureFixture) -> None:
    stack = fast_stack
    name = unique("expired")
    finished: list[int] = []

    def slow(ctx: stepd.StepContext, input: Any) -> int:
        if ctx.attempt == 1:
            # TTL 300 ms + recovery window 200 ms: the attempt is recovered
            # meanwhile. Whatever this returns is late.
            ctx.cancel_event.wait(1.5)
            time.sleep(0.1)
        finished.append(ctx.attempt)
        return ctx.attempt

    wf = stepd.Workflow(name).then(slow)
    worker = stack.worker(wf)

    async def no_heartbeats(active: Any, scope: anyio.CancelScope) -> None:
        with scope:  # ended with the body, like the real heartbeat loop
            await anyio.sleep_forever()

    worker._heartbeats = no_heartbeats  # type: ignore[method-assign]  # a worker gone silent
    caplog.set_level(logging.INFO, logger="stepd.worker")
    with serving(worker):
        run = stack.client.start(wf)
        assert run.result(timeout=20) == 2
        eventually(lambda: sorted(finished) == [1, 2], what="the late body to end")
        eventually(lambda: worker.running == 0, what="the late lease to be dropped")
        assert worker.errors == []
    types = journal_types(stack.client, run)
    assert "step_orphaned" in types and "step_recovered" in types
    completed = [e for e in stack.client.journal(run) if e["type"] == "step_completed"]
    assert [e["attempt"] for e in completed] == [2]
    if stack.kind == "http":
        # No push over HTTP: the late complete was sent and answered `fenced`.
        assert any("was fenced" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("transport", ["websocket", "http"])
def test_a_lost_answer_to_complete_is_already_applied_and_counts_as_success(
        net: NetDaemon, make_proxy: Any, transport: str,
        caplog: pytest.LogCaptureFixture) -> None:
    proxy: Proxy = make_proxy(net)
    name = unique("applied")

    async def work(ctx: stepd.StepContext, input: Any) -> str:
        await anyio.sleep(0.1)  # `started` is answered meanwhile
        proxy.swallow = True  # from now on the daemon's answers are lost
        return "done"

    wf = stepd.Workflow(name).then(work)
    caplog.set_level(logging.DEBUG, logger="stepd.worker")
    with stepd.Client(net.url, trust_env=False) as client:
        worker = stepd.Worker(proxy.url, transport=transport, concurrency=2).register(wf)
        with serving(worker):
            worker_id = worker.worker_id
            run = client.start(wf)
            # The completion is durable on the daemon, but its answer never arrived.
            eventually(lambda: "step_completed" in journal_types(client, run),
                       what="the completion")
            proxy.cut()
            proxy.swallow = False
            assert run.result(timeout=20) == "done"
            eventually(lambda: any("already applied" in r.getMessage() for r in caplog.records),
                       what="the resent complete to be answered already_applied")
            assert worker.worker_id == worker_id  # registered again with the same id
            assert worker.errors == []
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
        types = journal_types(client, run)
        assert types.count("step_completed") == 1 and "step_failed" not in types


def test_not_started_is_a_loud_worker_error(stack: Stack,
                                            caplog: pytest.LogCaptureFixture) -> None:
    name = unique("notstarted")

    def send(ctx: stepd.StepContext, input: Any) -> str:
        return "sent"

    wf = stepd.Workflow(name).then(send, delivery="at_most_once")

    class ForgetsStarted(stepd.Worker):
        """A worker with a bug: it never sends `started`."""

        async def _started(self, active: Any) -> None:
            self._started_answered(active)  # as if answered, never sent

    worker = ForgetsStarted(stack.client if stack.kind == "embedded" else stack.url,
                            transport="auto" if stack.kind == "embedded" else stack.kind)
    worker.register(wf)
    with pytest.raises(stepd.NotStarted) as err, serving(worker):
        run = stack.client.start(wf)
        eventually(lambda: worker.errors, what="the not_started answer")
    assert "not_started" in str(err.value) and "worker bug" in str(err.value)
    assert any(r.levelno == logging.ERROR and "not_started" in r.getMessage()
               for r in caplog.records)
    assert "step_completed" not in journal_types(stack.client, run)
