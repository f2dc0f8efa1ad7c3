"""Run actors under a virtual clock: timers, passivation, kills, children, cancel.

Real LMDB, real actors on asyncio and trio; time is a ManualClock, so a
one-hour sleep takes a millisecond.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from stepd.actors import ManualClock
from stepd.actors.daemon import Daemon, DaemonConfig, SignalRefused
from stepd.actors.daemon.messages import Due, TimerIndexChanged
from stepd.sansio.errors import NotFound, RunTerminal

from .helpers import claim_one, eventually, finish, run_actor_alive, writer_held

T0 = 1_700_000_000_000


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(wall_ms=T0)


@pytest.fixture
async def engine(tmp_path: Path, clock: ManualClock) -> AsyncIterator[Daemon]:
    # These tests jump the clock by hours while their worker makes no call (a
    # real one long-polls all along): workers are never forgotten here.
    config = DaemonConfig(worker_expiry_ms=0)
    async with Daemon.open(str(tmp_path / "data"), clock=clock, config=config) as e:
        yield e


async def register(engine: Daemon, *defs: dict[str, Any]) -> str:
    reg = await engine.register_worker(name="w", definitions=list(defs))
    return str(reg["worker_id"])


def status(engine: Daemon, run_id: str) -> str:
    return str(engine.status(run_id)["status"])


SLEEPY = {"name": "sleepy", "steps": [
    {"id": "a", "kind": "task", "body": "a"},
    {"id": "nap", "kind": "sleep", "duration_ms": 3_600_000},
    {"id": "b", "kind": "task", "body": "b"},
]}


async def test_a_sleep_passivates_and_fires_at_the_virtual_time(engine: Daemon, clock: ManualClock) -> None:
    wid = await register(engine, SLEEPY)
    run_id, _ = await engine.start_run("sleepy")
    await finish(engine, await claim_one(engine, wid), "A")
    await eventually(lambda: status(engine, run_id) == "sleeping")
    await eventually(lambda: not run_actor_alive(engine, run_id), what="passivated")
    clock.advance(3599.999)
    await anyio.sleep(0.05)
    assert status(engine, run_id) == "sleeping"
    assert await engine.claim(wid, max=1) == []
    clock.advance(0.001)
    lease = await claim_one(engine, wid)
    assert lease["step_id"] == "b"
    await finish(engine, lease, "B")
    done = await eventually(lambda: (v := engine.status(run_id))["status"] == "completed" and v)
    assert done["result"] == "B"
    fired = [e for e in engine.journal(run_id) if e["type"] == "timer_fired"]
    assert [(e["timer"], e["at"] - e["due_at"]) for e in fired] == [("sleep", 0)]
    assert fired[0]["due_at"] == T0 + 3_600_000


WAITER = {"name": "approve", "steps": [
    {"id": "gate", "kind": "wait", "event": "approved", "timeout_ms": 60_000, "into": "approval"},
    {"id": "send", "kind": "task", "body": "send", "input": "${state.approval}"},
], "budgets": {"max_state_bytes": 100}}


async def test_a_signal_reactivates_a_passivated_run(engine: Daemon) -> None:
    wid = await register(engine, WAITER)
    run_id, _ = await engine.start_run("approve")
    await eventually(lambda: status(engine, run_id) == "waiting")
    await eventually(lambda: not run_actor_alive(engine, run_id))
    with pytest.raises(SignalRefused) as refused:
        await engine.signal(run_id, "approved", {"note": "x" * 200})
    assert refused.value.budget == "max_state_bytes"
    assert status(engine, run_id) == "waiting"
    await engine.signal(run_id, "approved", {"by": "ann"})
    lease = await claim_one(engine, wid)
    assert lease["input"] == {"by": "ann"}
    await finish(engine, lease, "sent")
    await eventually(lambda: status(engine, run_id) == "completed")
    types = [e["type"] for e in engine.journal(run_id)]
    assert "signal_rejected" in types and types.count("signal_received") == 1


async def test_a_wait_times_out_at_the_virtual_time(engine: Daemon, clock: ManualClock) -> None:
    await register(engine, WAITER)
    run_id, _ = await engine.start_run("approve")
    await eventually(lambda: not run_actor_alive(engine, run_id))
    clock.advance(59.999)
    await anyio.sleep(0.05)
    assert status(engine, run_id) == "waiting"
    clock.advance(0.001)
    view = await eventually(lambda: (v := engine.status(run_id))["status"] == "failed" and v)
    assert view["error"]["reason"] == "wait_timeout"
    with pytest.raises(RunTerminal):
        await engine.signal(run_id, "approved", {})


async def test_a_killed_run_actor_continues_from_storage(engine: Daemon) -> None:
    defn = {"name": "three", "steps": [{"id": f"s{i}", "kind": "task", "body": "b"} for i in range(3)]}
    wid = await register(engine, defn)
    run_id, _ = await engine.start_run("three")
    await finish(engine, await claim_one(engine, wid), 1, {"x": 1})
    lease = await claim_one(engine, wid)
    await engine.kill(f"/runs/{run_id}")
    await finish(engine, lease, 2)  # the lease survives its run actor's death
    await engine.kill(f"/runs/{run_id}")
    await finish(engine, await claim_one(engine, wid), 3)
    view = await eventually(lambda: (v := engine.status(run_id))["status"] == "completed" and v)
    assert view["result"] == 3 and view["state"] == {"x": 1}
    assert [e["type"] for e in engine.journal(run_id)].count("step_completed") == 3


async def test_children_run_and_report_to_a_passivated_parent(engine: Daemon) -> None:
    child = {"name": "child", "steps": [{"id": "c", "kind": "task", "body": "c"}]}
    parent = {"name": "parent", "steps": [
        {"id": "kids", "kind": "start_workflows", "workflow": "child", "items": "${input}", "into": "out"},
    ]}
    wid = await register(engine, child, parent)
    run_id, _ = await engine.start_run("parent", [1, 2, 3])
    await eventually(lambda: not run_actor_alive(engine, run_id), what="the parent passivates")
    for _ in range(3):
        lease = await claim_one(engine, wid)
        await finish(engine, lease, lease["input"] * 10)
    view = await eventually(lambda: (v := engine.status(run_id))["status"] == "completed" and v)
    assert view["state"]["out"] == [10, 20, 30]
    kids = [r for r in engine.list_runs(workflow="child")[0]]
    assert sorted(r["parent_run_id"] for r in kids) == [run_id] * 3


async def test_cancel_ends_the_run_and_its_children(engine: Daemon) -> None:
    child = {"name": "child", "steps": [{"id": "c", "kind": "task", "body": "c"}]}
    parent = {"name": "parent", "steps": [
        {"id": "kids", "kind": "start_workflows", "workflow": "child", "items": [1, 2]},
    ]}
    wid = await register(engine, child, parent)
    run_id, _ = await engine.start_run("parent")
    lease = await claim_one(engine, wid)
    await engine.cancel(run_id, "stop")
    await eventually(lambda: all(r["status"] == "cancelled" for r in engine.list_runs()[0]))
    with pytest.raises(RunTerminal):
        await finish(engine, lease, 1)
    with pytest.raises(RunTerminal):
        await engine.cancel(run_id)


async def test_unknown_runs_are_not_found(engine: Daemon) -> None:
    with pytest.raises(NotFound):
        engine.status("r_nope")
    with pytest.raises(NotFound):
        await engine.signal("r_nope", "x", 1)


async def test_grandchildren_started_by_a_child_run_get_actors(engine: Daemon) -> None:
    leaf = {"name": "leaf", "steps": [{"id": "l", "kind": "task", "body": "l"}]}
    mid = {"name": "mid", "steps": [
        {"id": "kids", "kind": "start_workflows", "workflow": "leaf", "items": "${input}"}]}
    top = {"name": "top", "steps": [
        {"id": "t", "kind": "task", "body": "t"},
        {"id": "kids", "kind": "start_workflows", "workflow": "mid", "items": [[1, 2], [3]]}]}
    wid = await register(engine, leaf, mid, top)
    run_id, _ = await engine.start_run("top")
    await finish(engine, await claim_one(engine, wid), "go")  # mid and leaf runs start now
    for _ in range(3):
        lease = await claim_one(engine, wid)
        assert lease["body"] == "l"
        await finish(engine, lease, lease["input"] * 10)
    view = await eventually(lambda: (v := engine.status(run_id))["status"] == "completed" and v)
    assert view["result"] == [[10, 20], [30]]


async def test_a_thousand_passivated_sleepers_all_wake(engine: Daemon, clock: ManualClock) -> None:
    nap = {"name": "nap", "steps": [{"id": "z", "kind": "sleep", "duration_ms": 60_000}]}
    await register(engine, nap)
    ids = [(await engine.start_run("nap"))[0] for _ in range(1000)]
    # Bounds generous for a loaded 2-core machine (a bound, not a timing assertion).
    await eventually(lambda: engine.stats.status_counts.get("sleeping") == 1000, timeout=60)
    await eventually(lambda: not any(run_actor_alive(engine, r) for r in ids[:50]), timeout=60)
    clock.advance(60)
    with anyio.fail_after(90):
        while engine.stats.status_counts.get("completed", 0) < 1000:
            clock.advance(0.05)  # lets the timer actor's settle re-checks come round
            await anyio.sleep(0.01)
    # (the counters move as transitions are made; the records once committed)
    await eventually(lambda: all(engine.status(r)["status"] == "completed" for r in ids),
                     timeout=60)
    assert engine.storage.scan("timers") == []


GATED_NAP = {"name": "gated_nap", "steps": [
    {"id": "gate", "kind": "wait", "event": "go", "timeout_ms": 3_600_000},
    {"id": "nap", "kind": "sleep", "duration_ms": 100},
    {"id": "b", "kind": "task", "body": "b"},
]}


async def test_a_sweep_between_a_runs_write_and_its_commit_does_not_lose_its_timer(
        engine: Daemon, clock: ManualClock) -> None:
    """The CI failure of 2026-11-30 (examples/research.py, "still sleeping after 30 s").

    A signal moves a passivated run from a one-hour wait to a 100 ms sleep. If
    the timer actor sweeps while that write is still uncommitted, it sees only
    the wait's entry and sleeps towards it; the run then passivates. Nothing
    may depend on the sweep's timing: the run must still wake at 100 ms.
    """
    wid = await register(engine, GATED_NAP)
    run_id, _ = await engine.start_run("gated_nap")
    await eventually(lambda: not run_actor_alive(engine, run_id), what="passivated, waiting")
    timers = engine.system.resolve("/timers")
    before = engine.storage.statistics().commits
    async with writer_held(engine) as tg:
        tg.start_soon(engine.signal, run_id, "go", {})
        await eventually(lambda: engine.storage.statistics().queued >= 1, what="the signal's write queued")
        # The sweep, while the signal's transition is written but not committed.
        timers.tell_nowait(Due())
        await timers.ask(TimerIndexChanged(2**62))  # served after the sweep (a no-op hint)
    assert engine.storage.statistics().commits > before
    await eventually(lambda: status(engine, run_id) == "sleeping")
    await eventually(lambda: not run_actor_alive(engine, run_id), what="passivated, sleeping")
    clock.advance(0.1)
    lease = await claim_one(engine, wid)
    assert lease["step_id"] == "b"
