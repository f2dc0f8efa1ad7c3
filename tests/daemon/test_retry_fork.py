"""Retry, fork and a cancel reason through the daemon's API: real LMDB, real actors,
a virtual clock, and the daemon closed and reopened on the same data directory.

What is acknowledged must hold after a restart: a retry answered 200 is on
record (the reopened daemon offers the retried step), a fork and its link
both ways survive, and the audit entry of each is written in its transaction.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from stepd.actors import ManualClock
from stepd.actors.daemon import Daemon, DaemonConfig
from stepd.sansio.errors import Invalid, NotFound, NotRetryable
from stepd.sansio.lease import Op

from .helpers import claim_one, eventually, finish

T0 = 1_700_000_000_000
CONFIG = DaemonConfig(worker_expiry_ms=0)

FLOW = {"name": "flow", "steps": [
    {"id": "a", "kind": "task", "body": "a"},
    {"id": "b", "kind": "task", "body": "b", "input": "${steps.a}"},
    {"id": "c", "kind": "task", "body": "c", "input": "${state}"},
], "budgets": {"max_transitions": 10}}

PRICEY = {"name": "pricey", "steps": [
    {"id": "a", "kind": "task", "body": "a", "cost_units": 3},
    {"id": "b", "kind": "task", "body": "b", "cost_units": 3},
], "budgets": {"max_cost_units": 5}}


async def register(d: Daemon) -> str:
    reg = await d.register_worker(name="w", definitions=[FLOW, PRICEY])
    return str(reg["worker_id"])


async def fail(d: Daemon, lease: dict[str, Any], message: str = "upstream down") -> None:
    await d.lease_call(lease["lease_id"], Op.STARTED, {})
    await d.lease_call(lease["lease_id"], Op.FAIL, {"error_class": "fatal", "message": message})


def status(d: Daemon, run_id: str) -> str:
    return str(d.status(run_id)["status"])


async def test_a_retry_acknowledged_before_a_restart_is_carried_out_after_it(
        tmp_path: Path) -> None:
    path = str(tmp_path / "data")
    clock = ManualClock(wall_ms=T0)
    async with Daemon.open(path, clock=clock, config=CONFIG) as d:
        wid = await register(d)
        run_id, _ = await d.start_run("flow", {"x": 1})
        await finish(d, await claim_one(d, wid), {"n": 1}, {"seen": "a"})
        await fail(d, await claim_one(d, wid))
        await eventually(lambda: status(d, run_id) == "failed")
        running, _ = await d.start_run("flow", 2)
        with pytest.raises(NotRetryable, match="is running: only a failed run"):
            await d.retry(running)
    # The daemon went away with the run failed; a new one retries it, and stops
    # again at once: the answer was the promise that the retry is on record.
    async with Daemon.open(path, clock=clock, config=CONFIG) as d:
        entry = d.audit.new_entry(key_id=None, scope="execute", action="runs.retry",
                                  target=run_id, status=200, reason=None)
        answer = await d.retry(run_id, audit=entry)
        assert answer == {"run_id": run_id, "status": "running", "step_id": "b"}
    async with Daemon.open(path, clock=clock, config=CONFIG) as d:
        wid = await register(d)
        lease = await claim_one(d, wid, run_id=run_id)
        assert (lease["step_id"], lease["attempt"], lease["input"]) == ("b", 1, {"n": 1})
        assert lease["idempotency_key"] == f"{run_id}/b#2"  # a new visit of b
        await finish(d, lease, "B")
        await finish(d, await claim_one(d, wid, run_id=run_id), "C")
        done = await eventually(lambda: (v := d.status(run_id))["status"] == "completed" and v)
        assert done["result"] == "C" and done["state"] == {"seen": "a"}
        types = [e["type"] for e in d.journal(run_id)]
        assert types.count("run_failed") == 1 and types.count("run_retried") == 1
        retried = next(e for e in d.journal(run_id) if e["type"] == "run_retried")
        assert retried["step_id"] == "b" and retried["error"]["message"] == "fatal: upstream down"
        audited = [e for e in d.audit.page(100, None)[0] if e.action == "runs.retry"]
        assert [(e.target, e.status) for e in audited] == [(run_id, 200)]


async def test_a_run_failed_on_its_budget_is_refused_and_left_as_it_was(tmp_path: Path) -> None:
    async with Daemon.open(str(tmp_path / "data"), clock=ManualClock(wall_ms=T0),
                           config=CONFIG) as d:
        wid = await register(d)
        run_id, _ = await d.start_run("pricey")
        await finish(d, await claim_one(d, wid), 1)
        await finish(d, await claim_one(d, wid), 2)
        before = await eventually(lambda: (v := d.status(run_id))["status"] == "failed" and v)
        with pytest.raises(NotRetryable, match="max_cost_units") as info:
            await d.retry(run_id)
        assert info.value.budget == "max_cost_units"
        assert d.status(run_id) == before
        assert "run_retried" not in [e["type"] for e in d.journal(run_id)]
        with pytest.raises(NotFound):
            await d.retry("r_01JDV5Z8Q3X4M6N7P8R9S0T1U2")


async def test_a_fork_keeps_the_history_and_both_links_survive_a_restart(tmp_path: Path) -> None:
    path = str(tmp_path / "data")
    clock = ManualClock(wall_ms=T0)
    async with Daemon.open(path, clock=clock, config=CONFIG) as d:
        wid = await register(d)
        src, _ = await d.start_run("flow", {"x": 1}, correlation="T-9")
        await finish(d, await claim_one(d, wid), {"n": 1}, {"k": "a"})
        await finish(d, await claim_one(d, wid), "B", {"k": "b"})
        await finish(d, await claim_one(d, wid), "C", {"k": "c"})
        await eventually(lambda: status(d, src) == "completed")
        source_journal = d.journal(src)
        for bad, why in (("nope", "is not a step"), ("", "non-empty")):
            with pytest.raises(Invalid, match=why) as info:
                await d.fork(src, bad)
            assert info.value.field == "from_step"
        clock.advance(5)
        fork_id, created = await d.fork(src, "a", idempotency_key="fork-1")
        assert created and fork_id != src
        assert await d.fork(src, "a", idempotency_key="fork-1") == (fork_id, False)
        fork_journal = d.journal(fork_id)
        cut = fork_journal.index(next(e for e in fork_journal if e["type"] == "run_forked"))
        assert cut > 0 and fork_journal[:cut] == source_journal[:cut]
        assert fork_journal[cut]["from_seq"] == cut
        view = d.status(fork_id)
        assert view["state"] == {"k": "a"} and view["input"] == {"x": 1}
        assert view["correlation"] == "T-9" and view["current_steps"] == ["b"]
        assert view["budget"]["usage"]["transitions"] == 1
        assert view["forked_from"] == {"run_id": src, "step_id": "a"}
    async with Daemon.open(path, clock=clock, config=CONFIG) as d:
        wid = await register(d)
        assert d.status(src)["forks"] == [{"run_id": fork_id, "step_id": "a"}]
        lease = await claim_one(d, wid, run_id=fork_id)
        assert (lease["step_id"], lease["input"]) == ("b", {"n": 1})
        await finish(d, lease, "B2")
        await finish(d, await claim_one(d, wid, run_id=fork_id), "C2")
        done = await eventually(lambda: (v := d.status(fork_id))["status"] == "completed" and v)
        assert done["result"] == "C2" and done["budget"]["usage"]["transitions"] == 3
        exported = d.export(src)
        assert exported["forks"] == [{"run_id": fork_id, "step_id": "a"}]
        assert exported["input"] == {"x": 1} and exported["result"] == "C"
        assert d.export(fork_id)["forked_from"] == {"run_id": src, "step_id": "a"}
        # The fork is a run like any other: it lists, with its own summary.
        listed = {r["run_id"] for r in d.list_runs(workflow="flow")[0]}
        assert {src, fork_id} <= listed


async def test_cancel_journals_its_reason_and_shows_it_in_the_status(tmp_path: Path) -> None:
    async with Daemon.open(str(tmp_path / "data"), clock=ManualClock(wall_ms=T0),
                           config=CONFIG) as d:
        await register(d)
        run_id, _ = await d.start_run("flow")
        await d.cancel(run_id, "duplicate of ticket 41")
        view = d.status(run_id)
        assert view["status"] == "cancelled"
        assert view["error"]["message"] == "duplicate of ticket 41"
        last = d.journal(run_id)[-1]
        assert last["type"] == "run_cancelled"
        assert last["error"]["message"] == "duplicate of ticket 41"
        other, _ = await d.start_run("flow")
        await d.cancel(other)
        assert d.status(other)["error"]["message"] == "cancelled"
