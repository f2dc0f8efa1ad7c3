"""Lazy lease expiry (actors/daemon/lease.py "lazy expiry"): a fresh lease arms no
timer of its own, the timer actor sweeps the live leases by the first one's
deadline, and no live lease is ever left without an expiry, a kill of the
timer actor included (a started lease with neither an actor timer nor a sweep
would stall its run forever). Under a virtual clock: lease TTL 30 s, recovery
window 5 s (the defaults).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from stepd.actors import ManualClock
from stepd.actors.daemon import Daemon, DaemonConfig
from stepd.sansio.lease import Op

from .helpers import claim_one, eventually

T0 = 1_700_000_000_000
TTL_MS = 30_000


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(wall_ms=T0)


@pytest.fixture
async def engine(tmp_path: Path, clock: ManualClock) -> AsyncIterator[Daemon]:
    config = DaemonConfig(worker_expiry_ms=0)  # the clock jumps while workers are silent
    async with Daemon.open(str(tmp_path / "data"), clock=clock, config=config) as e:
        yield e


def one_step() -> dict[str, Any]:
    return {"name": "two", "steps": [{"id": "t", "kind": "task", "body": "t"}]}


def journal_types(engine: Daemon, run_id: str) -> list[str]:
    return [e["type"] for e in engine.journal(run_id)]


async def settle_time(clock: ManualClock, seconds: float) -> None:
    """Advance virtual time and let the actors react (bounded real wait)."""
    clock.advance(seconds)
    await anyio.sleep(0.03)


async def started_leases(engine: Daemon, wid: str, n: int) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for _ in range(n):
        run_id, _ = await engine.start_run("two")
        lease = await claim_one(engine, wid)
        await engine.lease_call(lease["lease_id"], Op.STARTED, {})
        out.append((run_id, lease))
    return out


async def test_a_fresh_lease_asks_for_a_sweep_by_its_deadline_and_expires_at_its_ttl(
        engine: Daemon, clock: ManualClock) -> None:
    wid = str((await engine.register_worker(name="w", definitions=[one_step()]))["worker_id"])
    [(run_id, _lease)] = await started_leases(engine, wid, 1)
    # No timer of its own: the sweep asked for is its own deadline.
    assert engine.services.lease_sweep_at == T0 + TTL_MS
    await settle_time(clock, 29.9)
    assert "step_orphaned" not in journal_types(engine, run_id)
    await settle_time(clock, 0.2)
    await eventually(lambda: "step_orphaned" in journal_types(engine, run_id),
                     what="orphaned at its TTL through the sweep")
    await settle_time(clock, 5.1)  # the recovery window, on the lease's own timer now
    await eventually(lambda: "step_recovered" in journal_types(engine, run_id))


async def test_a_later_lease_shares_the_sweep_and_still_expires_at_its_own_deadline(
        engine: Daemon, clock: ManualClock) -> None:
    wid = str((await engine.register_worker(name="w", definitions=[one_step()]))["worker_id"])
    [(first, _)] = await started_leases(engine, wid, 1)
    await settle_time(clock, 10.0)
    [(second, _)] = await started_leases(engine, wid, 1)
    assert engine.services.lease_sweep_at == T0 + TTL_MS  # no second sweep asked for
    await settle_time(clock, 20.1)  # the first's deadline: the sweep
    await eventually(lambda: "step_orphaned" in journal_types(engine, first))
    assert engine.services.lease_sweep_at is None  # swept: the second armed its own timer
    await settle_time(clock, 9.0)  # 39.1 s: not yet 30 s after the second's offer
    assert "step_orphaned" not in journal_types(engine, second)
    await settle_time(clock, 1.0)
    await eventually(lambda: "step_orphaned" in journal_types(engine, second),
                     what="the second lease orphaned 30 s after its own offer")


async def test_killing_the_timer_actor_leaves_no_lease_without_an_expiry(
        engine: Daemon, clock: ManualClock) -> None:
    wid = str((await engine.register_worker(name="w", definitions=[one_step()]))["worker_id"])
    leases = await started_leases(engine, wid, 3)
    assert engine.services.lease_sweep_at == T0 + TTL_MS
    await engine.kill("/timers")  # the sweep's timer dies with it
    await eventually(lambda: engine.services.lease_sweep_at is None,
                     what="the new incarnation swept at its start")
    await settle_time(clock, 30.1)
    for run_id, _ in leases:
        await eventually(lambda r=run_id: "step_orphaned" in journal_types(engine, r),  # type: ignore[misc]
                         what="every lease orphaned at its TTL")


async def test_a_lease_that_heartbeats_is_not_expired_by_the_sweep(
        engine: Daemon, clock: ManualClock) -> None:
    wid = str((await engine.register_worker(name="w", definitions=[one_step()]))["worker_id"])
    [(run_id, lease)] = await started_leases(engine, wid, 1)
    for _ in range(5):  # 50 s of heartbeats 10 s apart, across the sweep at 30 s
        await settle_time(clock, 10.0)
        await engine.lease_call(lease["lease_id"], Op.HEARTBEAT, {})
    assert "step_orphaned" not in journal_types(engine, run_id)
    await engine.lease_call(lease["lease_id"], Op.COMPLETE, {"output": "ok"})
    await eventually(lambda: engine.status(run_id)["status"] == "completed")
