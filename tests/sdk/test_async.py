"""The async API on both anyio backends: `AsyncClient`, ``await worker.run()``, the
embedded daemon's async form, and a network worker on trio."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest

import stepd
import stepd.channels.http
import stepd.channels.websocket
from stepd._http1 import Http1Client, wants_httpx

from .conftest import NetDaemon, unique

pytestmark = pytest.mark.timeout(60)


async def shout(ctx: stepd.StepContext, input: Any) -> str:
    await anyio.lowlevel.checkpoint()
    ctx.patch_state(loud=True)
    return str(input).upper()


def mark(ctx: stepd.StepContext, input: Any, steps: dict[str, Any]) -> dict[str, Any]:
    return {"shout": steps["shout"], "thread": threading.current_thread().name,
            "loud": ctx.state["loud"]}


def pipeline(name: str) -> stepd.Workflow:
    return stepd.Workflow(name).then(shout).then(mark, input=None)


async def test_embedded_async_form(tmp_path: Path) -> None:
    name = unique("async")
    async with stepd.embedded(tmp_path / "data") as daemon:
        client = stepd.AsyncClient(daemon)
        worker = stepd.Worker(client, concurrency=4).register(pipeline(name))
        async with anyio.create_task_group() as tg:
            assert await tg.start(worker.run) is worker  # returns once registered
            assert worker.transport == "inprocess"
            run = await client.start(name, "hi", idempotency_key=f"{name}:1")
            assert isinstance(run, stepd.AsyncRunHandle)
            result = await run.result(timeout=20)
            assert result["shout"] == "HI" and result["loud"] is True
            assert result["thread"] != threading.current_thread().name
            status = await client.status(run)
            assert status.status == "completed" and status.state == {"loud": True}
            assert [r.run_id async for r in client.list_runs(workflow=name)] == [run.run_id]
            assert (await client.journal(run))[-1]["type"] == "run_completed"
            worker.stop()
        assert worker.running == 0


@pytest.mark.parametrize("transport", ["auto", "websocket-library", "http", "http-httpx"])
async def test_network_worker_and_async_client(net: NetDaemon, transport: str,
                                               anyio_backend: Any,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """``http-httpx``: the worker and the client through httpx, as for https or a proxy;
    ``websocket-library``: the worker's WebSocket through the websockets library (as for
    wss:// or a proxy) rather than the lean client (stepd.channels._wsproto)."""
    name = unique("net-async")
    if transport == "http-httpx":
        monkeypatch.setattr(stepd.channels.http, "wants_httpx", lambda url, trust_env: True)
        transport = "http"
    if transport == "websocket-library":
        monkeypatch.setattr(stepd.channels.websocket, "LEAN", False)
        transport = "auto"
    async with stepd.AsyncClient(net.url, trust_env=False) as client:
        worker = stepd.Worker(client, transport=transport).register(pipeline(name))
        lean = client._backend.lean is not None  # type: ignore[attr-defined]
        assert lean is (stepd.channels.http.wants_httpx is wants_httpx)
        async with anyio.create_task_group() as tg:
            await tg.start(worker.run)
            assert isinstance(worker._http, Http1Client) is lean
            # On trio the WebSocket runs on websockets' trio client (websockets >= 17).
            assert worker.transport == ("http" if transport == "http" else "websocket")
            run = await client.start(name, "net")
            assert (await run.result(timeout=20))["shout"] == "NET"
            with pytest.raises(stepd.NotFound):
                await client.status("r_missing")
            worker.stop()


async def test_cancelling_run_fails_the_running_bodies_back(tmp_path: Path) -> None:
    name = unique("cancelled")
    running = anyio.Event()

    async def hold(ctx: stepd.StepContext, input: Any) -> str:
        if ctx.attempt == 1:
            running.set()
            await anyio.sleep_forever()  # until the test cancels it
        return f"attempt {ctx.attempt}"

    wf = stepd.Workflow(name).then(hold, retry=stepd.Retry(initial_backoff=1))
    async with stepd.embedded(tmp_path / "data") as daemon:
        client = stepd.AsyncClient(daemon)
        first = stepd.Worker(daemon, name="first").register(wf)
        async with anyio.create_task_group() as tg:
            await tg.start(first.run)
            run = await client.start(wf)
            await running.wait()
            tg.cancel_scope.cancel()  # the worker's own task is cancelled
        second = stepd.Worker(daemon, name="second").register(wf)
        async with anyio.create_task_group() as tg:
            await tg.start(second.run)
            assert await run.result(timeout=20) == "attempt 2"
            second.stop()
        failed = [e for e in await client.journal(run) if e["type"] == "step_failed"]
        assert [(e["error_class"], e["worker_id"]) for e in failed] == [
            ("retryable", first.worker_id)]
        assert "was cancelled" in failed[0]["message"]


def test_a_worker_in_another_loop_runs_on_the_embedded_daemons_loop(tmp_path: Path) -> None:
    name = unique("elsewhere")

    async def main(daemon: stepd.Embedded) -> Any:
        client = stepd.AsyncClient(daemon)
        worker = stepd.Worker(client).register(pipeline(name))
        async with anyio.create_task_group() as tg:
            await tg.start(worker.run)
            result = await (await client.start(name, "x")).result(timeout=20)
            worker.stop()
        return result

    with stepd.embedded(tmp_path / "data") as daemon:
        for backend in ("asyncio", "trio"):
            assert anyio.run(main, daemon, backend=backend)["shout"] == "X"
        # Blocking calls on the daemon's own loop would deadlock: refused clearly.
        with pytest.raises(RuntimeError, match="deadlock"):
            daemon.call_blocking(daemon.call_blocking, None)  # type: ignore[arg-type]
