"""The defaults a user gets without knobs (issue 16): worker slots, the embedded loop.

The collector policy of an embedded daemon is tested in child processes
(tests/test_gc_policy.py): it is process-wide.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from pathlib import Path

import pytest

import stepd
from stepd.worker import DEFAULT_CONCURRENCY

uvloop = pytest.importorskip("uvloop")


def test_a_worker_has_100_slots_unless_told() -> None:
    assert DEFAULT_CONCURRENCY == 100
    assert stepd.Worker("http://127.0.0.1:1").concurrency == 100
    assert stepd.Worker("http://127.0.0.1:1", concurrency=8).concurrency == 8


def _loop_kind() -> str:
    return type(asyncio.get_running_loop()).__module__.split(".")[0]


async def _loop_of_daemon() -> str:
    return _loop_kind()


def test_the_sync_embedded_daemon_runs_on_uvloop_and_serves_a_run(tmp_path: Path) -> None:
    """The background loop is uvloop's; a run goes through it end to end."""
    wf = stepd.Workflow(f"defaults-{uuid.uuid4().hex[:8]}").then("double", id="d", input="${input}")

    async def double(ctx: stepd.StepContext, x: int) -> int:
        assert _loop_kind() == "uvloop"  # an async body runs on the daemon's loop
        return 2 * x

    with stepd.embedded(tmp_path / "data") as daemon:
        assert daemon.call_blocking(_loop_of_daemon) == "uvloop"
        client = stepd.Client(daemon)
        worker = stepd.Worker(client).register(wf, bodies={"double": double})
        serving = threading.Thread(target=worker.serve)
        serving.start()
        try:
            assert worker.wait_ready(10)
            assert client.start(wf, 21).result(timeout=30) == 42
        finally:
            worker.stop()
            serving.join(30)
        assert not serving.is_alive()


def test_uvloop_false_keeps_asyncios_own_loop(tmp_path: Path) -> None:
    with stepd.embedded(tmp_path / "data", uvloop=False) as daemon:
        assert daemon.call_blocking(_loop_of_daemon) == "asyncio"
