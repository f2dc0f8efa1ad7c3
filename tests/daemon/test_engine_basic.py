"""The engine in-process: a real LMDB directory, real actors, a virtual clock."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from stepd.actors import ManualClock
from stepd.actors.daemon import Daemon
from stepd.sansio.errors import Unprocessable

from .helpers import run_worker, seq_definition


def add(lease):  # type: ignore[no-untyped-def]
    i = lease["input"]["i"]
    acc = lease["input"]["acc"] or 0
    return acc + i, {"acc": acc + i}


async def test_a_run_goes_end_to_end(tmp_path: Path) -> None:
    clock = ManualClock(wall_ms=1_700_000_000_000)
    async with Daemon.open(str(tmp_path / "data"), clock=clock) as engine:
        reg = await engine.register_worker(name="w", definitions=[seq_definition("seq", 5)])
        wid = reg["worker_id"]
        run_id, created = await engine.start_run("seq", None)
        assert created
        stop = anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(run_worker, engine, wid, {"add": add}, stop)
            with anyio.fail_after(10):
                result = await engine.result(run_id, wait_ms=10_000)
                while result["status"] == "running":
                    result = await engine.result(run_id, wait_ms=10_000)
            stop.set()
        assert result["status"] == "completed", result
        assert result["result"] == 10
        # What a result call answers (`outcome`, off the stored record): the view's four.
        assert await engine.outcome(run_id, wait_ms=1) == await engine.outcome(run_id) == {
            k: result[k] for k in ("run_id", "status", "result", "error")}
        running, _ = await engine.start_run("seq", None)
        assert await engine.outcome(running) == {"run_id": running, "status": "running",
                                                 "result": None, "error": None}
        types = [e["type"] for e in engine.journal(run_id)]
        assert types[0] == "run_started" and types[-1] == "run_completed"
        assert types.count("step_completed") == 5


async def test_unknown_workflow_is_unprocessable(tmp_path: Path) -> None:
    async with Daemon.open(str(tmp_path / "data")) as engine:
        with pytest.raises(Unprocessable):
            await engine.start_run("nope", None)


async def test_idempotency_key_returns_the_original_run(tmp_path: Path) -> None:
    async with Daemon.open(str(tmp_path / "data")) as engine:
        await engine.register_worker(definitions=[seq_definition("seq", 1)])
        a, created_a = await engine.start_run("seq", None, idempotency_key="k")
        b, created_b = await engine.start_run("seq", None, idempotency_key="k")
        assert created_a and not created_b and a == b
