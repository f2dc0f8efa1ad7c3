"""Schedules in a real daemon (real LMDB) on a virtual clock: fires, overlap policies,
catch-up after downtime, kills of the schedule actor, pause/resume/delete."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest

from stepd.actors import ManualClock
from stepd.actors.daemon import Daemon
from stepd.sansio.errors import Invalid, NotFound
from stepd.sansio.lease import Op
from stepd.sansio.schedule import fire_key

from ..daemon.helpers import eventually, seq_definition

T0 = 1_700_000_040_000  # 22:14:00 UTC: a whole minute
MINUTE = 60.0


def scheduled_runs(engine: Daemon, schedule_id: str) -> list[dict[str, Any]]:
    runs, _ = engine.list_runs(correlation={"schedule_id": schedule_id}, order="asc", limit=1000)
    return runs


async def make(engine: Daemon, **extra: Any) -> dict[str, Any]:
    await engine.register_worker(name="w", definitions=[seq_definition("seq", 1)])
    body = {"cron": "* * * * *", "workflow": "seq", "input": {"x": 1}, **extra}
    return await engine.create_schedule(body)


async def settle(engine: Daemon, schedule_id: str, count: int) -> list[dict[str, Any]]:
    """Wait (bounded) until the schedule has started `count` runs, and its actor is idle."""
    await eventually(lambda: len(scheduled_runs(engine, schedule_id)) >= count,
                     what=f"{count} runs")
    await anyio.sleep(0.05)  # nothing more should come: checked by the caller
    return scheduled_runs(engine, schedule_id)


async def finish_all(engine: Daemon, worker_id: str) -> int:
    """Complete every step on offer (bounded); returns how many."""
    done = 0
    for _ in range(20):
        leases = await engine.claim(worker_id, max=16, wait_ms=0)  # the virtual clock stands still
        if not leases:
            break
        for lease in leases:
            await engine.lease_call(lease["lease_id"], Op.STARTED, {})
            await engine.lease_call(lease["lease_id"], Op.COMPLETE, {"output": 1})
            done += 1
    return done


async def test_each_fire_starts_one_run_under_its_fire_key(tmp_path: Path) -> None:
    clock = ManualClock(wall_ms=T0)
    async with Daemon.open(str(tmp_path / "d"), clock=clock) as engine:
        sched = await make(engine, overlap="allow")
        sid = sched["schedule_id"]
        assert sched["next_fire_at"].startswith("2023-11-14T22:15:00")
        for n in (1, 2, 3):
            clock.advance(MINUTE)
            runs = await settle(engine, sid, n)
            assert len(runs) == n
        keys = [r["idempotency_key"] for r in runs]
        assert keys == [fire_key(sid, T0 + i * 60_000) for i in (1, 2, 3)]
        assert engine.status(runs[0]["run_id"])["input"] == {"x": 1}
        assert engine.schedule(sid)["fires"] == {"started": 3, "skipped": 0, "dropped": 0}


async def test_skip_leaves_out_fires_while_the_previous_run_runs(tmp_path: Path) -> None:
    clock = ManualClock(wall_ms=T0)
    async with Daemon.open(str(tmp_path / "d"), clock=clock) as engine:
        sched = await make(engine)  # skip is the default
        sid = sched["schedule_id"]
        for _ in range(3):
            clock.advance(MINUTE)
            await anyio.sleep(0.02)
        runs = await settle(engine, sid, 1)
        assert len(runs) == 1  # its run never ended: the next two were skipped
        await eventually(lambda: engine.schedule(sid)["fires"]["skipped"] == 2, what="skips")


async def test_buffer_one_starts_the_held_fire_when_the_run_ends(tmp_path: Path) -> None:
    clock = ManualClock(wall_ms=T0)
    async with Daemon.open(str(tmp_path / "d"), clock=clock) as engine:
        reg = await engine.register_worker(name="w", definitions=[seq_definition("seq", 1)])
        sid = (await engine.create_schedule(
            {"cron": "* * * * *", "workflow": "seq", "overlap": "buffer_one"}))["schedule_id"]
        for _ in range(3):
            clock.advance(MINUTE)
            await anyio.sleep(0.02)
        assert len(await settle(engine, sid, 1)) == 1
        await eventually(lambda: engine.schedule(sid)["buffered_fire_at"] is not None,
                         what="a buffered fire")
        view = engine.schedule(sid)
        assert view["fires"]["skipped"] == 1  # the third: one is buffered at most
        assert await finish_all(engine, reg["worker_id"]) == 1
        clock.advance(1.0)  # the buffered fire is looked at again once a second
        runs = await settle(engine, sid, 2)
        assert len(runs) == 2
        assert runs[1]["idempotency_key"] == fire_key(sid, T0 + 2 * 60_000)
        assert engine.schedule(sid)["buffered_fire_at"] is None


async def test_downtime_is_caught_up_inside_the_window_only(tmp_path: Path) -> None:
    path = str(tmp_path / "d")
    clock = ManualClock(wall_ms=T0)
    async with Daemon.open(path, clock=clock) as engine:
        sid = (await make(engine, overlap="allow", catchup_window_ms="5m"))["schedule_id"]
    # Down for 10 minutes: fires at +1..+10 min are missed; +5..+10 are inside the window.
    clock2 = ManualClock(wall_ms=T0 + 10 * 60_000)
    async with Daemon.open(path, clock=clock2) as engine:
        runs = await settle(engine, sid, 6)
        assert [r["idempotency_key"] for r in runs] == [
            fire_key(sid, T0 + m * 60_000) for m in range(5, 11)]
        view = engine.schedule(sid)
        assert view["fires"]["started"] == 6 and view["fires"]["dropped"] == 1
        assert view["next_fire_at"].startswith("2023-11-14T22:25:00")


async def test_a_killed_schedule_actor_neither_doubles_nor_drops(tmp_path: Path) -> None:
    clock = ManualClock(wall_ms=T0)
    async with Daemon.open(str(tmp_path / "d"), clock=clock) as engine:
        sid = (await make(engine, overlap="allow", catchup_window_ms="1h"))["schedule_id"]
        for n in range(1, 7):
            clock.advance(MINUTE)
            if n % 2:
                await engine.kill(f"/schedules/{sid}")  # before or while it fires
            else:
                await settle(engine, sid, n)
        runs = await settle(engine, sid, 6)
        assert [r["idempotency_key"] for r in runs] == [
            fire_key(sid, T0 + m * 60_000) for m in range(1, 7)]
        tree = engine.actors()
        sched = next(c for c in tree["children"] if c["path"] == "/schedules")
        assert [c["path"] for c in sched["children"]] == [f"/schedules/{sid}"]


async def test_pause_resume_delete(tmp_path: Path) -> None:
    clock = ManualClock(wall_ms=T0)
    async with Daemon.open(str(tmp_path / "d"), clock=clock) as engine:
        sid = (await make(engine, overlap="allow"))["schedule_id"]
        paused = await engine.pause_schedule(sid)
        assert paused["paused"] and paused["next_fire_at"] is None
        clock.advance(3 * MINUTE)
        await anyio.sleep(0.05)
        assert scheduled_runs(engine, sid) == []
        resumed = await engine.resume_schedule(sid)  # no catch-up of the paused time
        assert resumed["next_fire_at"].startswith("2023-11-14T22:18:00")
        clock.advance(MINUTE)
        assert len(await settle(engine, sid, 1)) == 1
        await engine.delete_schedule(sid)
        with pytest.raises(NotFound):
            engine.schedule(sid)
        clock.advance(MINUTE)
        await anyio.sleep(0.05)
        assert len(scheduled_runs(engine, sid)) == 1
        assert engine.system.find(f"/schedules/{sid}") is None
        with pytest.raises(NotFound):
            await engine.pause_schedule(sid)


@pytest.mark.parametrize(("body", "field"), [
    ({"cron": "61 * * * *", "workflow": "seq"}, "cron"),
    ({"cron": "* * * *", "workflow": "seq"}, "cron"),
    ({"cron": "* * * * *", "workflow": "seq", "timezone": "Mars/Olympus"}, "timezone"),
    ({"cron": "* * * * *", "workflow": "nope"}, "workflow"),
    ({"cron": "* * * * *", "workflow": "seq", "overlap": "queue"}, "overlap"),
    ({"cron": "* * * * *", "workflow": "seq", "catchup_window_ms": -1}, "catchup_window_ms"),
])
async def test_bad_input_names_the_field_and_writes_nothing(
        tmp_path: Path, body: dict[str, Any], field: str) -> None:
    async with Daemon.open(str(tmp_path / "d"), clock=ManualClock(wall_ms=T0)) as engine:
        await engine.register_worker(name="w", definitions=[seq_definition("seq", 1)])
        with pytest.raises(Invalid) as info:
            await engine.create_schedule(body)
        assert info.value.field == field
        assert engine.list_schedules() == ([], None)
