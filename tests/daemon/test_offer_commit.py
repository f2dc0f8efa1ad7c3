"""An offer rides the commit that made its slot runnable (actors/daemon/run_offers.py).

A step's complete and the next step's offer are one write of the run: the
worker is handed the next lease only once that write is on record, and a
session that took the slot before the commit gets it back when the commit
does not land. Real LMDB, real actors; a worker of concurrency 1 (one credit
at a time), so a slot whose credit went missing would stall the run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stepd.actors.daemon import Daemon, DaemonConfig, store
from stepd.sansio.lease import Op
from stepd.storage import CommitFailed

from ..actors._helpers import settle
from .helpers import eventually, writer_held


def _seq(n: int) -> dict[str, Any]:
    """bench's seq(n): each step's input takes the previous step's output."""
    return {"name": "seq", "steps": [
        {"id": f"s{i}", "kind": "task", "body": "add",
         "input": {"i": i, "acc": f"${{steps.s{i - 1}}}" if i else 0}} for i in range(n)]}


class _Worker:
    """A push connection of concurrency 1 that checks each lease is on record when pushed."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        self.leases: list[dict[str, Any]] = []
        self.on_record: list[bool] = []

    def lease(self, lease: dict[str, Any]) -> bool:
        raw = self.daemon.storage.get(store.LEASES, lease["lease_id"])
        self.on_record.append(isinstance(raw, dict) and raw.get("status") == "offered")
        self.leases.append(lease)
        return True

    def cancel(self, lease_id: str, reason: str) -> None:
        pass

    def close(self, reason: str) -> None:
        pass


async def _attached(daemon: Daemon, n: int) -> tuple[_Worker, Any]:
    wid = (await daemon.register_worker(name="w", definitions=[_seq(n)]))[
        "worker_id"]
    worker = _Worker(daemon)
    conn = await daemon.attach(wid, worker)
    conn.grant(1)
    return worker, conn


async def _complete(daemon: Daemon, conn: Any, lease: dict[str, Any]) -> None:
    conn.grant(1)  # the body is done: its slot is free again, before the call, as the SDK does
    await daemon.lease_call(lease["lease_id"], Op.COMPLETE,
                            {"output": lease["input"]["i"], "started": True})


async def _settled(daemon: Daemon) -> None:
    """Every write so far on record (the first offer is written behind)."""
    await daemon.storage.write(store.barrier_txn)


async def _queued(daemon: Daemon) -> None:
    """The complete's write waits behind the held one (no sleep: the writer's own count)."""
    await eventually(lambda: daemon.storage.statistics().queued >= 1,
                     what="the complete's write queued behind the held one")


async def _status(daemon: Daemon, run_id: str) -> str:
    return str(daemon.status(run_id)["status"])


async def test_each_step_writes_its_run_once_and_pushes_only_leases_on_record(
        tmp_path: Path) -> None:
    n = 6
    async with Daemon.open(str(tmp_path / "data"), config=DaemonConfig()) as daemon:
        worker, conn = await _attached(daemon, n)
        run_id, _ = await daemon.start_run("seq")
        await eventually(lambda: worker.leases, what="the first lease")
        await _settled(daemon)
        before = daemon.storage.statistics()
        for i in range(n):
            await eventually(lambda i=i: len(worker.leases) > i, what=f"lease {i}")
            await _complete(daemon, conn, worker.leases[i])
        after = daemon.storage.statistics()
        assert await _status(daemon, run_id) == "completed"
        # The first step is offered right after the start's own commit, written
        # behind (`RunOffers._offer_now`); every later one rode its commit.
        assert worker.on_record[1:] == [True] * (n - 1)
        # One write per step: its complete, holding the next step's offer (the
        # `started` rode in the complete). Before, each offer was a second write.
        assert after.requests - before.requests == n
        assert after.deferred_requests - before.deferred_requests == 0
        conn.detach()


async def test_a_lease_offered_ahead_is_pushed_only_after_its_commit(tmp_path: Path) -> None:
    async with Daemon.open(str(tmp_path / "data"), config=DaemonConfig()) as daemon:
        worker, conn = await _attached(daemon, 3)
        run_id, _ = await daemon.start_run("seq")
        await eventually(lambda: worker.leases, what="the first lease")
        async with writer_held(daemon) as tg:
            tg.start_soon(_complete, daemon, conn, worker.leases[0])
            await _queued(daemon)  # the run took the slot and waits for its commit
            assert len(worker.leases) == 1  # nothing of the next step before it is on record
        await eventually(lambda: len(worker.leases) == 2, what="the second lease")
        assert worker.on_record[1] is True
        await _complete(daemon, conn, worker.leases[1])
        await eventually(lambda: len(worker.leases) == 3, what="the third lease")
        await _complete(daemon, conn, worker.leases[2])
        assert await _status(daemon, run_id) == "completed"
        conn.detach()


async def test_a_slot_taken_for_a_commit_that_fails_goes_back_to_its_session(
        tmp_path: Path) -> None:
    async with Daemon.open(str(tmp_path / "data"), config=DaemonConfig()) as daemon:
        worker, conn = await _attached(daemon, 2)
        run_id, _ = await daemon.start_run("seq")
        await eventually(lambda: worker.leases, what="the first lease")
        await _settled(daemon)  # the next batch is the complete's own
        daemon.storage._inject_commit_failure(CommitFailed("injected"))
        # The complete's commit fails: nothing of it is on record, and the run's
        # actor crashes and rebuilds from storage; the lease asks the call of
        # its next incarnation, which applies it. The one credit the session
        # took for the offer made ahead came back with the slot, so that second
        # commit's offer still finds this worker of concurrency 1.
        await _complete(daemon, conn, worker.leases[0])
        assert daemon.storage.statistics().failed_commits == 1
        await eventually(lambda: len(worker.leases) == 2, what="the second lease")
        assert worker.on_record[1] is True
        await _complete(daemon, conn, worker.leases[1])
        assert await _status(daemon, run_id) == "completed"
        conn.detach()


async def test_a_run_killed_during_the_commit_still_hands_over_the_lease_on_record(
        tmp_path: Path) -> None:
    async with Daemon.open(str(tmp_path / "data"), config=DaemonConfig()) as daemon:
        worker, conn = await _attached(daemon, 2)
        run_id, _ = await daemon.start_run("seq")
        await eventually(lambda: worker.leases, what="the first lease")
        async with writer_held(daemon) as tg:
            tg.start_soon(_complete, daemon, conn, worker.leases[0])
            await _queued(daemon)  # the run waits for the commit holding the offer
            tg.start_soon(daemon.kill, f"/runs/{run_id}")  # lands when that wait ends
            await settle()  # the kill is waiting too
        await eventually(lambda: len(worker.leases) == 2, what="the second lease")
        assert worker.on_record[1] is True
        await _complete(daemon, conn, worker.leases[1])
        assert await _status(daemon, run_id) == "completed"
        conn.detach()
