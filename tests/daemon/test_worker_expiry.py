"""Workers are forgotten when idle (the hardening issue, defect 9), on a virtual clock.

515 registered workers once stayed listed forever, 2 of them connected. A
worker with no connection, no claim in flight and no live lease for
`worker_expiry_ms` is now removed from the registry; journals keep its id,
and a worker that comes back registers anew.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest

from stepd.actors import ManualClock
from stepd.actors.daemon import Daemon, DaemonConfig
from stepd.sansio.errors import NotFound

from .helpers import claim_one, finish


class _Outbox:
    """A push connection that takes whatever it is given (the session's `Outbox`)."""

    def __init__(self) -> None:
        self.leases: list[dict[str, Any]] = []

    def lease(self, lease: dict[str, Any]) -> bool:
        self.leases.append(lease)
        return True

    def cancel(self, lease_id: str, reason: str) -> None:
        pass

    def close(self, reason: str) -> None:
        pass


FLOW = {"name": "flow", "steps": [{"id": "a", "kind": "task", "body": "a"},
                                  {"id": "b", "kind": "task", "body": "b"}]}


async def test_idle_workers_are_forgotten_busy_ones_kept(tmp_path: Path) -> None:
    clock = ManualClock(wall_ms=1_700_000_000_000)
    # Leases outlive the test's clock jumps (a holder that stops heartbeating
    # loses its lease, and then it is idle like any other).
    config = DaemonConfig(worker_expiry_ms=60_000, lease_ttl_ms=3_600_000)
    async with Daemon.open(str(tmp_path / "data"), clock=clock, config=config) as engine:
        idle = (await engine.register_worker(name="idle", definitions=[FLOW]))["worker_id"]
        holder = (await engine.register_worker(name="holder", definitions=[FLOW]))["worker_id"]
        pusher = (await engine.register_worker(name="pusher", definitions=[FLOW]))["worker_id"]
        many = [(await engine.register_worker(definitions=[FLOW]))["worker_id"] for _ in range(20)]
        done_run, _ = await engine.start_run("flow")
        await finish(engine, await claim_one(engine, idle), "by idle")  # journaled as idle's
        held_run, _ = await engine.start_run("flow")
        await claim_one(engine, holder, run_id=held_run)  # a live lease, never completed
        conn = await engine.attach(pusher, _Outbox())
        try:
            clock.advance(59)
            await anyio.sleep(0.01)
            assert len(await engine.workers()) == 23  # not yet
            clock.advance(30)  # past the expiry of the idle ones

            async def listed() -> set[str]:
                return {w["worker_id"] for w in await engine.workers()}

            for _ in range(500):  # bounded: each session's own timer forgets its worker
                if len(await listed()) == 2:
                    break
                await anyio.sleep(0.01)
            assert await listed() == {holder, pusher}, [(w["name"], w.get("connected"), w.get("leases")) for w in await engine.workers()]
            assert not set(many) & await listed()
        finally:
            conn.detach()
        journal = engine.journal(done_run)
        assert idle in {e.get("worker_id") for e in journal}  # the journal keeps the id
        with pytest.raises(NotFound):
            await engine.claim(idle, max=1)
        back = (await engine.register_worker(name="idle", definitions=[FLOW]))["worker_id"]
        assert back != idle
        assert back in {w["worker_id"] for w in await engine.workers()}


async def test_zero_never_forgets(tmp_path: Path) -> None:
    clock = ManualClock(wall_ms=1_700_000_000_000)
    config = DaemonConfig(worker_expiry_ms=0)
    async with Daemon.open(str(tmp_path / "data"), clock=clock, config=config) as engine:
        wid = (await engine.register_worker(definitions=[FLOW]))["worker_id"]
        clock.advance(10 * 86_400)
        await anyio.sleep(0.05)
        assert [w["worker_id"] for w in await engine.workers()] == [wid]
