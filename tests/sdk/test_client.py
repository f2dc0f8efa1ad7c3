"""`Client`: typed errors, waiting for results, listing runs, auth."""

from __future__ import annotations

import threading
import time
from typing import Any

import anyio
import pytest

import stepd

from .conftest import KEYS, NetDaemon, Proxy, Stack, serving, unique

pytestmark = pytest.mark.timeout(60)


def echo(ctx: stepd.StepContext, input: Any) -> Any:
    return input


def test_client_errors_are_typed(stack: Stack) -> None:
    client = stack.client
    name = unique("errors")
    gate = stepd.Workflow(name).wait("go", into="go").then(echo, input="${state.go}")
    gate.budget(max_state_bytes=64)
    with serving(stack.worker(gate)):
        with pytest.raises(stepd.NotFound):
            client.status("r_doesnotexist")
        with pytest.raises(stepd.NotFound):
            client.result("r_doesnotexist", timeout=1)
        with pytest.raises(stepd.Unprocessable):
            client.start(unique("nobody-registered-this"))
        with pytest.raises(stepd.Invalid) as bad_key:
            client.start(gate, idempotency_key="")
        assert bad_key.value.field == "idempotency_key"
        with pytest.raises(stepd.Invalid) as bad_status:
            list(client.list_runs(status="bogus"))
        assert bad_status.value.field == "status"
        with pytest.raises(stepd.Invalid) as bad_deadline:
            client.start(gate, deadline="soon")
        assert bad_deadline.value.field == "deadline"

        run = client.start(gate)
        # A signal whose wait would push the state over max_state_bytes is refused,
        # typed, naming the budget; nothing is recorded and the run keeps waiting.
        with pytest.raises(stepd.BudgetExceeded) as refused:
            run.signal("go", "x" * 200)
        assert refused.value.budget == "max_state_bytes"
        assert refused.value.reason == "budget_exceeded"
        assert isinstance(refused.value, stepd.Conflict)
        assert client.status(run).status == "waiting"
        assert client.status(run).waiting_for == "go"
        client.signal(run, "go", "ok")
        assert run.result(timeout=20) == "ok"
        with pytest.raises(stepd.RunTerminal):
            client.cancel(run)
        with pytest.raises(stepd.RunTerminal):
            client.signal(run, "go", "again")
    types = [e["type"] for e in client.journal(run)]
    assert "signal_rejected" in types


def test_result_waits_and_raises_typed_outcomes(stack: Stack) -> None:
    client = stack.client
    name = unique("result")

    async def slow(ctx: stepd.StepContext, input: Any) -> Any:
        await anyio.sleep(0.3)
        if input == "fail":
            raise stepd.StepFailure("bad_input", "cannot do that")
        return input

    wf = stepd.Workflow(name).then(slow)
    waiter = stepd.Workflow(name + "-w").wait("never")
    with serving(stack.worker(wf, waiter)):
        run = client.start(wf, {"n": 1})
        with pytest.raises(TimeoutError):
            run.result(timeout=0.05)
        began = time.monotonic()
        assert run.result(timeout=20) == {"n": 1}  # waited for the body
        assert time.monotonic() - began > 0.1

        with pytest.raises(stepd.RunFailed) as failed:
            client.result(client.start(wf, "fail"), timeout=20)
        assert failed.type is stepd.RunFailed and failed.value.status == "failed"
        assert failed.value.reason == "step_failed" and failed.value.step_id == "slow"

        pending = client.start(waiter)
        box: dict[str, Any] = {}

        def wait() -> None:
            try:
                pending.result(timeout=20)
            except BaseException as exc:  # noqa: BLE001 - checked below
                box["error"] = exc

        thread = threading.Thread(target=wait)
        thread.start()
        time.sleep(0.1)
        pending.cancel()
        thread.join(20)
        assert isinstance(box["error"], stepd.RunCancelled)
        assert isinstance(box["error"], stepd.RunFailed)
        assert client.status(pending).error == stepd.RunError("cancelled", "cancelled",
                                                              "never")

        timed = client.start(waiter, deadline="200ms")
        with pytest.raises(stepd.RunTimedOut):
            timed.result(timeout=20)


def test_list_runs_pages_and_workers(stack: Stack) -> None:
    client = stack.client
    name = unique("list")
    wf = stepd.Workflow(name).then(echo)
    with serving(stack.worker(wf, name="lister")) as worker:
        runs = [client.start(wf, i) for i in range(5)]
        for run in runs:
            run.result(timeout=20)
        listed = list(client.list_runs(workflow=name, limit=None))
        assert [r.run_id for r in listed] == [r.run_id for r in reversed(runs)]  # newest first
        assert all(r.status == "completed" and r.done for r in listed)
        assert len(list(client.list_runs(workflow=name, limit=3))) == 3
        assert list(client.list_runs(workflow=name, status="failed")) == []
        mine = [w for w in client.workers() if w["worker_id"] == worker.worker_id]
        assert mine and mine[0]["name"] == "lister" and mine[0]["connected"]
    handle = client.handle(runs[0].run_id)
    assert handle == runs[0] and str(handle) == runs[0].run_id
    assert handle.status().status == "completed"


def test_keys_and_scopes_are_typed_errors(auth_net: NetDaemon) -> None:
    name = unique("auth")
    wf = stepd.Workflow(name).then(echo)
    with (
        stepd.Client(auth_net.url, trust_env=False) as anonymous,
        pytest.raises(stepd.Unauthorized),
    ):
        anonymous.status("r_x")
    with (
        stepd.Client(auth_net.url, key="wrong-key-0123456789", trust_env=False) as wrong,
        pytest.raises(stepd.Unauthorized),
    ):
        list(wrong.list_runs())
    bad_worker = stepd.Worker(auth_net.url, key=KEYS["execute"]).register(wf)
    with pytest.raises(stepd.Forbidden):
        bad_worker.serve()  # an execute key cannot register a worker
    worker = stepd.Worker(auth_net.url, key=KEYS["worker"]).register(wf)
    with (
        stepd.Client(auth_net.url, key=KEYS["execute"], trust_env=False) as client,
        serving(worker),
    ):
        assert worker.transport == "websocket"
        run = client.start(wf, "authorized")
        assert run.result(timeout=20) == "authorized"
    with (
        stepd.Client(auth_net.url, key=KEYS["worker"], trust_env=False) as as_worker,
        pytest.raises(stepd.Forbidden),
    ):
        as_worker.start(wf)


def test_unavailable_is_retried_for_idempotent_calls_only(net: NetDaemon,
                                                          make_proxy: Any) -> None:
    proxy: Proxy = make_proxy(net)
    proxy.unavailable = 2
    with (
        stepd.Client(proxy.url, trust_env=False, retries=3) as client,
        pytest.raises(stepd.NotFound),
    ):  # two 503s, then the real answer
        client.status("r_doesnotexist")
    assert proxy.answered_503 == 2
    proxy.unavailable = 10
    with (
        stepd.Client(proxy.url, trust_env=False, retries=2) as client,
        pytest.raises(stepd.Unavailable),
    ):
        list(client.list_runs())
    assert proxy.answered_503 == 2 + 3  # the first try and two retries
    proxy.unavailable = 10
    with (
        stepd.Client(proxy.url, trust_env=False, retries=3) as client,
        pytest.raises(stepd.Unavailable),
    ):  # a signal is not repeated
        client.signal("r_doesnotexist", "go")
    assert proxy.answered_503 == 2 + 3 + 1
    proxy.unavailable = 0
    with (
        stepd.Client("http://127.0.0.1:9", trust_env=False, retries=1) as client,
        pytest.raises(stepd.Unavailable) as err,
    ):  # nothing listens there
        client.status("r_x")
    assert "cannot reach" in str(err.value)
