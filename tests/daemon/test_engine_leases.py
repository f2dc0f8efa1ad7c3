"""Leases through the engine: expiry, revival, recovery, the 409s, routing.

PROTOCOL.md "Expiry and recovery", "The four rejections", "Unservable" and
"Horizontal scaling", under a virtual clock (lease TTL 30 s, heartbeat 10 s,
recovery window 5 s: the defaults).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from stepd.actors import ManualClock
from stepd.actors.daemon import Daemon, DaemonConfig
from stepd.sansio.errors import AlreadyApplied, Fenced, NotFound, NotStarted, RunTerminal
from stepd.sansio.lease import Op

from .helpers import claim_one, eventually, finish, writer_held

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


def one(name: str = "one", **task: Any) -> dict[str, Any]:
    return {"name": name, "steps": [{"id": "t", "kind": "task", "body": "t", **task}]}


async def worker(engine: Daemon, *defs: dict[str, Any], name: str = "w") -> str:
    return str((await engine.register_worker(name=name, definitions=list(defs)))["worker_id"])


def journal_types(engine: Daemon, run_id: str) -> list[str]:
    return [e["type"] for e in engine.journal(run_id)]


async def settle_time(clock: ManualClock, seconds: float) -> None:
    """Advance virtual time and let the actors react (bounded real wait)."""
    clock.advance(seconds)
    await anyio.sleep(0.03)


async def test_a_heartbeat_inside_the_recovery_window_revives_the_lease(engine: Daemon, clock: ManualClock) -> None:
    wid = await worker(engine, one())
    run_id, _ = await engine.start_run("one")
    lease = await claim_one(engine, wid)
    await engine.lease_call(lease["lease_id"], Op.STARTED, {})
    await settle_time(clock, 29.9)
    assert await engine.lease_call(lease["lease_id"], Op.HEARTBEAT, {"progress": 1}) == {"lease_ttl_ms": 30_000}
    await settle_time(clock, 30.0)  # expired: orphaned
    await eventually(lambda: "step_orphaned" in journal_types(engine, run_id))
    await settle_time(clock, 4.9)  # inside the 5 s window
    await engine.lease_call(lease["lease_id"], Op.HEARTBEAT, {})
    await eventually(lambda: "step_revived" in journal_types(engine, run_id))
    await engine.lease_call(lease["lease_id"], Op.COMPLETE, {"output": "ok"})
    await eventually(lambda: engine.status(run_id)["status"] == "completed")
    assert "step_recovered" not in journal_types(engine, run_id)


async def test_at_least_once_recovery_reoffers_a_new_attempt_and_fences_the_old(engine: Daemon, clock: ManualClock) -> None:
    wid = await worker(engine, one())
    run_id, _ = await engine.start_run("one")
    old = await claim_one(engine, wid)
    await engine.lease_call(old["lease_id"], Op.STARTED, {})
    await settle_time(clock, 30.0)
    await settle_time(clock, 5.0)
    new = await claim_one(engine, wid)
    assert new["attempt"] == 2 and new["fence"] == old["fence"] + 1
    with pytest.raises(Fenced):
        await engine.lease_call(old["lease_id"], Op.COMPLETE, {"output": "late"})
    with pytest.raises(Fenced):
        await engine.lease_call(old["lease_id"], Op.HEARTBEAT, {})
    await finish(engine, new, "fresh")
    view = await eventually(lambda: (v := engine.status(run_id))["status"] == "completed" and v)
    assert view["result"] == "fresh"


async def test_at_least_once_with_no_attempts_left_fails_lease_lost(engine: Daemon, clock: ManualClock) -> None:
    wid = await worker(engine, one(retry={"max_attempts": 1}))
    run_id, _ = await engine.start_run("one")
    await claim_one(engine, wid)
    await settle_time(clock, 30.0)
    await settle_time(clock, 5.0)
    view = await eventually(lambda: (v := engine.status(run_id))["status"] == "failed" and v)
    assert view["error"]["reason"] == "lease_lost"


async def test_at_most_once_started_is_never_rerun(engine: Daemon, clock: ManualClock) -> None:
    wid = await worker(engine, one(delivery="at_most_once", retry={"max_attempts": 5}))
    run_id, _ = await engine.start_run("one")
    lease = await claim_one(engine, wid)
    await engine.lease_call(lease["lease_id"], Op.STARTED, {})
    await settle_time(clock, 30.0)
    await settle_time(clock, 5.0)
    view = await eventually(lambda: (v := engine.status(run_id))["status"] == "failed" and v)
    assert view["error"]["reason"] == "lease_lost"
    assert await engine.claim(wid, max=5) == []


async def test_at_most_once_never_started_is_reoffered_same_attempt(engine: Daemon, clock: ManualClock) -> None:
    wid = await worker(engine, one(delivery="at_most_once", retry={"max_attempts": 1}))
    _run_id, _ = await engine.start_run("one")
    first = await claim_one(engine, wid)
    await settle_time(clock, 30.0)
    await settle_time(clock, 5.0)
    again = await claim_one(engine, wid)
    assert again["attempt"] == 1 and again["fence"] == first["fence"] + 1
    with pytest.raises(Fenced):
        await engine.lease_call(first["lease_id"], Op.STARTED, {})


async def test_the_four_rejections_and_their_precedence(engine: Daemon) -> None:
    wid = await worker(engine, one(), one("amo", delivery="at_most_once"))
    # already_applied: a repeated complete
    run_id, _ = await engine.start_run("one")
    lease = await claim_one(engine, wid, run_id=run_id)
    await finish(engine, lease, 1)
    with pytest.raises(AlreadyApplied):
        await engine.lease_call(lease["lease_id"], Op.COMPLETE, {"output": 1})
    with pytest.raises(AlreadyApplied):  # wins over run_terminal: the run is over too
        await engine.lease_call(lease["lease_id"], Op.FAIL, {"error_class": "fatal"})
    # not_started: complete of an at_most_once attempt without started
    amo, _ = await engine.start_run("amo")
    lease = await claim_one(engine, wid, run_id=amo)
    with pytest.raises(NotStarted):
        await engine.lease_call(lease["lease_id"], Op.COMPLETE, {"output": 1})
    # run_terminal beats not_started
    await engine.cancel(amo)
    with pytest.raises(RunTerminal):
        await engine.lease_call(lease["lease_id"], Op.COMPLETE, {"output": 1})
    with pytest.raises(RunTerminal):
        await engine.lease_call(lease["lease_id"], Op.HEARTBEAT, {})
    with pytest.raises(NotFound):
        await engine.lease_call("l_unknown", Op.HEARTBEAT, {})


async def test_unservable_goes_to_another_worker_and_never_back(engine: Daemon) -> None:
    old = await worker(engine, one(), name="old")
    run_id, _ = await engine.start_run("one")
    lease = await claim_one(engine, old)
    await engine.lease_call(lease["lease_id"], Op.FAIL, {"error_class": "unservable", "message": "no body"})
    assert await engine.claim(old, max=1) == []
    new = await worker(engine, one(), name="new")
    again = await claim_one(engine, new)
    assert again["attempt"] == 1  # no retry budget spent
    await finish(engine, again, "ok")
    await eventually(lambda: engine.status(run_id)["status"] == "completed")
    assert "step_unservable" in journal_types(engine, run_id)


async def test_a_run_restricted_claim_takes_only_that_run(engine: Daemon) -> None:
    wid = await worker(engine, one())
    a, _ = await engine.start_run("one")
    b, _ = await engine.start_run("one")
    lease = await claim_one(engine, wid, run_id=b)
    assert lease["run_id"] == b
    lease = await claim_one(engine, wid)
    assert lease["run_id"] == a


async def test_a_waiting_claim_is_woken_by_a_new_run(engine: Daemon) -> None:
    wid = await worker(engine, one())
    got: list[Any] = []

    async def claimer() -> None:
        got.extend(await engine.claim(wid, max=1, wait_ms=10_000))

    async with anyio.create_task_group() as tg:
        tg.start_soon(claimer)
        await eventually(lambda: True)
        await anyio.sleep(0.02)
        assert got == []
        with anyio.fail_after(5):
            await engine.start_run("one")
    assert len(got) == 1


async def test_each_attempt_goes_to_exactly_one_of_four_racing_workers(engine: Daemon) -> None:
    defn = {"name": "fan", "steps": [{"id": "f", "kind": "for_each", "items": "${input}", "body": "b"}]}
    workers = [await worker(engine, defn, name=f"w{i}") for i in range(4)]
    runs = [(await engine.start_run("fan", list(range(25))))[0] for _ in range(4)]
    seen: list[tuple[str, int]] = []

    async def race(wid: str) -> None:
        while True:
            leases = await engine.claim(wid, max=3, wait_ms=20)
            if not leases:
                if all(engine.status(r)["status"] == "completed" for r in runs):
                    return
                continue
            for lease in leases:
                seen.append((lease["run_id"], lease["item_index"]))
                await finish(engine, lease, lease["input"])

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            for wid in workers:
                tg.start_soon(race, wid)
    assert len(seen) == len(set(seen)) == 100
    assert [engine.status(r)["result"] for r in runs] == [list(range(25))] * 4


async def test_rebuilding_lease_actors_again_and_again_cannot_keep_a_dead_workers_lease(
        engine: Daemon, clock: ManualClock) -> None:
    # A /leases kill rebuilds every lease actor from a new child spec. Each
    # rebuild used to grant a full TTL from now, so kills less than a TTL apart
    # kept a SIGKILLed worker's lease alive forever (examples/chaos.py).
    wid = await worker(engine, one())
    run_id, _ = await engine.start_run("one")
    lease = await claim_one(engine, wid)
    await engine.lease_call(lease["lease_id"], Op.STARTED, {})  # its last call
    for gap in (20.0, 5.0):  # rebuilt at 20 s and at 25 s after its last call
        await settle_time(clock, gap)
        await engine.kill("/leases")
        await eventually(lambda: engine.live_leases() == 1, what="the lease actor rebuilt")
    await settle_time(clock, 6.0)  # 31 s after its last call: past the 30 s TTL
    await eventually(lambda: "step_orphaned" in journal_types(engine, run_id),
                     what="the dead worker's lease orphaned 30 s after its last call")


async def test_a_restart_keeps_live_leases_alive_for_a_full_ttl(tmp_path: Path) -> None:
    clock = ManualClock(wall_ms=T0)
    path = str(tmp_path / "data")
    async with Daemon.open(path, clock=clock) as engine:
        wid = await worker(engine, one())
        run_id, _ = await engine.start_run("one")
        lease = await claim_one(engine, wid)
        await engine.lease_call(lease["lease_id"], Op.STARTED, {})
    clock.advance(3600)  # the daemon was down for an hour
    async with Daemon.open(path, clock=clock) as engine:
        await settle_time(clock, 29.0)
        await engine.lease_call(lease["lease_id"], Op.HEARTBEAT, {})
        await engine.lease_call(lease["lease_id"], Op.COMPLETE, {"output": "survived"})
        view = await eventually(lambda: (v := engine.status(run_id))["status"] == "completed" and v)
        assert view["result"] == "survived"
        assert "step_orphaned" not in journal_types(engine, run_id)


async def test_a_released_lease_is_queued_again_at_once_same_attempt(engine: Daemon) -> None:
    wid = await worker(engine, one())
    run_id, _ = await engine.start_run("one")
    first = await claim_one(engine, wid)
    engine.release(first["lease_id"])
    again = await claim_one(engine, wid)  # no TTL to wait out
    assert again["attempt"] == 1 and again["fence"] == first["fence"] + 1
    with pytest.raises(Fenced):
        await engine.lease_call(first["lease_id"], Op.STARTED, {})
    await engine.lease_call(again["lease_id"], Op.STARTED, {})
    engine.release(again["lease_id"])  # started: release leaves it alone
    await engine.lease_call(again["lease_id"], Op.COMPLETE, {"output": 1})
    await eventually(lambda: engine.status(run_id)["status"] == "completed")
    recovered = [e for e in engine.journal(run_id) if e["type"] == "step_recovered"]
    assert [e.get("released") for e in recovered] == [True]


async def test_metrics_hooks_count_runs_and_sample_schedule_to_start(engine: Daemon) -> None:
    wid = await worker(engine, one())
    _run_id, _ = await engine.start_run("one")
    assert engine.stats.status_counts.get("running") == 1
    await finish(engine, await claim_one(engine, wid), 1)
    await eventually(lambda: engine.stats.status_counts.get("completed") == 1)
    assert engine.stats.status_counts.get("running") == 0
    assert len(engine.stats.schedule_to_start) == 1 and engine.stats.schedule_to_start[0] >= 0
    seen = [w["last_heartbeat_at"] for w in await engine.workers()]
    assert seen == [T0]


async def test_killing_a_lease_actor_does_not_extend_its_lease(engine: Daemon, clock: ManualClock) -> None:
    wid = await worker(engine, one())
    run_id, _ = await engine.start_run("one")
    lease = await claim_one(engine, wid)
    await engine.lease_call(lease["lease_id"], Op.STARTED, {})
    for _ in range(4):  # killed every 10 s: a fresh TTL each time would never expire
        await settle_time(clock, 10.0)
        if "step_recovered" in journal_types(engine, run_id):
            break
        try:
            await engine.kill(f"/leases/{lease['lease_id']}")
        except NotFound:
            break  # recovered already: its actor ended, the journal entry is on its way
        # Let the supervisor's restart finish before time moves on.
        await eventually(lambda: engine.system.find(f"/leases/{lease['lease_id']}") is not None)
        await anyio.sleep(0.02)
    await eventually(lambda: "step_recovered" in journal_types(engine, run_id))


async def test_a_lease_offered_just_before_its_supervisor_restarts_is_still_served(engine: Daemon) -> None:
    """A fresh-clone CI run failed a run with lease_lost in the kill test: its leases got 404.

    An offer is written behind. If the leases supervisor restarts before that
    write commits, the lease's actor is gone and its record not yet there:
    the worker's calls must wait for the record rather than get a 404 (which
    makes a worker drop the lease and lets it expire).
    """
    wid = await worker(engine, one())
    run_id, _ = await engine.start_run("one")
    async with writer_held(engine) as tg:  # the offer queues behind the held write
        lease = await claim_one(engine, wid)
        assert engine.storage.get("leases", lease["lease_id"]) is None  # not on record yet
        await engine.kill("/leases")
        answers: list[Any] = []

        async def call() -> None:
            answers.append(await engine.lease_call(lease["lease_id"], Op.STARTED, {}))
            answers.append(await engine.lease_call(lease["lease_id"], Op.COMPLETE, {"output": 7}))

        tg.start_soon(call)
        await anyio.sleep(0.05)  # the calls wait (the old code answered 404 at once)
    assert len(answers) == 2
    view = await eventually(lambda: (v := engine.status(run_id))["status"] == "completed" and v)
    assert view["result"] == 7
