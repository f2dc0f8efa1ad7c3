"""A poison run cannot crash-loop: its actor's crashes are counted durably and bounded.

The hardening issue saw a run whose every transition failed to commit restart
~1,800 times in 40 s, silently, forever. Here a transition that cannot be
stored (an integer msgpack cannot hold, which the transports refuse at the
boundary but the engine API does not) crashes the run actor on every try: the
run must end `failed` with reason `internal` and a journaled message after
`MAX_CRASHES`, the lease's caller must hear `run_terminal`, every crash must
be logged at WARNING or above, and the count must survive a daemon restart.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from stepd.actors.daemon import Daemon, DaemonConfig, store
from stepd.actors.daemon.run import MAX_CRASHES
from stepd.sansio.errors import RunTerminal
from stepd.sansio.lease import Op

from .helpers import claim_one

FLOW = {"name": "flow", "steps": [{"id": "a", "kind": "task", "body": "a"},
                                  {"id": "b", "kind": "task", "body": "b"}]}


async def test_a_poison_transition_fails_the_run_with_reason_internal(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    async with Daemon.open(str(tmp_path / "data"), config=DaemonConfig()) as engine:
        wid = (await engine.register_worker(definitions=[FLOW]))["worker_id"]
        run_id, _ = await engine.start_run("flow", None)
        lease = await claim_one(engine, wid)
        await engine.lease_call(lease["lease_id"], Op.STARTED, {})
        with pytest.raises(RunTerminal):
            await engine.lease_call(lease["lease_id"], Op.COMPLETE, {"output": 2**70})
        status = engine.status(run_id)
        assert status["status"] == "failed"
        assert status["error"]["reason"] == "internal"
        assert "crashed" in status["error"]["message"]
        assert "OverflowError" in status["error"]["message"]
        journal = engine.journal(run_id)
        assert journal[-1]["type"] == "run_failed"
        assert journal[-1]["error"]["reason"] == "internal"
        crashes = engine.storage.get(store.RUN_CRASHES, run_id)
        assert len(crashes["at"]) == MAX_CRASHES + 1
    crash_logs = [r for r in caplog.records
                  if f"/runs/{run_id}" in r.getMessage() and "crashed" in r.getMessage()]
    assert len(crash_logs) == MAX_CRASHES + 1
    assert all(r.levelno >= logging.WARNING for r in crash_logs)
    gave_up = [r for r in caplog.records if "reason internal" in r.getMessage()]
    assert len(gave_up) == 1 and gave_up[0].levelno == logging.ERROR


async def test_the_crash_count_survives_a_restart(tmp_path: Path) -> None:
    """Crashes before a daemon restart still count after it (the bound is durable)."""
    path = str(tmp_path / "data")
    async with Daemon.open(path) as engine:
        wid = (await engine.register_worker(definitions=[FLOW]))["worker_id"]
        run_id, _ = await engine.start_run("flow", None)
        lease = await claim_one(engine, wid)
        await engine.lease_call(lease["lease_id"], Op.STARTED, {})
        now = engine.clock.time_ms()
        for i in range(MAX_CRASHES):  # as if it had crashed this often before the restart
            await engine.storage.write(store.count_crash_txn, run_id, now - i, "Boom: earlier",
                                       10 * 60_000, 2 * MAX_CRASHES + 1)
    async with Daemon.open(path) as engine:
        # One more crash is enough now.
        with pytest.raises(RunTerminal):
            await engine.lease_call(lease["lease_id"], Op.COMPLETE, {"output": 2**70})
        assert engine.status(run_id)["error"]["reason"] == "internal"
