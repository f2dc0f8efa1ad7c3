"""Retention in a real daemon (real LMDB) on a virtual clock: what a pruned run leaves
behind (nothing), what is kept (runs in progress, recent ends, young idempotency keys),
and the slices."""

from __future__ import annotations

from pathlib import Path

import anyio

from stepd.actors import ManualClock
from stepd.actors.daemon import Daemon, retention, tables
from stepd.actors.daemon.services import DaemonConfig
from stepd.sansio.lease import Op
from stepd.storage import journal_prefix

from ..daemon.helpers import eventually, seq_definition

T0 = 1_700_000_040_000
HOUR_MS = 3_600_000


async def finish(engine: Daemon, worker_id: str, run_id: str) -> None:
    with anyio.fail_after(10):
        while engine.status(run_id)["status"] != "completed":
            # wait_ms=0: a held claim would wait on the virtual clock, which stands still.
            for lease in await engine.claim(worker_id, max=8, wait_ms=0):
                await engine.lease_call(lease["lease_id"], Op.STARTED, {})
                await engine.lease_call(lease["lease_id"], Op.COMPLETE, {"output": 1})
            await anyio.sleep(0.002)


def traces(engine: Daemon, run_id: str) -> dict[str, int]:
    """Every row anywhere that still names `run_id` (by key or, for leases, by value)."""
    st = engine.storage
    found = {
        "runs": int(st.get(tables.RUNS, run_id) is not None),
        "summaries": int(st.get(tables.RUN_SUMMARIES, run_id) is not None),
        "journal": len(st.scan(tables.JOURNAL, prefix=journal_prefix(run_id))),
        "leases": sum(1 for _, v in st.scan(tables.LEASES) if v.get("run_id") == run_id),
        "keys": sum(1 for _, v in st.scan(tables.DISPATCH_KEYS) if v.get("run_id") == run_id),
    }
    for table in (tables.IDX_RUNS_CREATED, tables.IDX_RUNS_STATUS, tables.IDX_RUNS_WORKFLOW,
                  tables.IDX_RUNS_WF_STATUS, tables.IDX_RUNS_CORRELATION):
        found[table] = sum(1 for k, _ in st.scan(table) if k.endswith(run_id.encode()))
    return found


async def setup(engine: Daemon) -> tuple[str, list[str]]:
    reg = await engine.register_worker(
        name="w", definitions=[seq_definition("seq", 1), seq_definition("idle", 1)])
    wid = reg["worker_id"]
    done = []
    for i in range(3):
        run_id, _ = await engine.start_run("seq", None, idempotency_key=f"k{i}",
                                           correlation={"c": i})
        await finish(engine, wid, run_id)
        done.append(run_id)
    return wid, done


async def test_the_sweep_deletes_old_finished_runs_and_everything_only_theirs(
        tmp_path: Path) -> None:
    clock = ManualClock(wall_ms=T0)
    config = DaemonConfig(retention_ms=HOUR_MS, idempotency_retention_ms=3 * HOUR_MS)
    async with Daemon.open(str(tmp_path / "d"), clock=clock, config=config) as engine:
        wid, old = await setup(engine)
        running, _ = await engine.start_run("idle", None)  # nobody serves it later: kept
        assert all(v for v in traces(engine, old[0]).values() if v is not None)
        clock.advance(2 * 3600.0)
        # The worker of 2 h ago has expired; a new one finishes a run now.
        wid = (await engine.register_worker(name="w2", definitions=[seq_definition("seq", 1)]))[
            "worker_id"]
        recent, _ = await engine.start_run("seq", None)
        await finish(engine, wid, recent)  # ended just now: kept
        clock.advance(retention.SWEEP_EVERY_S)
        await eventually(lambda: engine.stats.runs_pruned == 3, what="3 runs pruned")
        for run_id in old:
            left = traces(engine, run_id)
            assert left == {k: (1 if k == "keys" else 0) for k in left}, left
        for run_id in (running, recent):
            assert engine.storage.get(tables.RUNS, run_id) is not None
        listed = {r["run_id"] for r in engine.list_runs(limit=100)[0]}
        assert listed == {running, recent}
        assert engine.stats.status_counts.get("completed") == 1
        # A retried start inside the key's retention still answers the pruned run.
        assert await engine.start_run("seq", None, idempotency_key="k0") == (old[0], False)
        clock.advance(2 * 3600.0)  # now past the keys' own retention
        await eventually(lambda: engine.storage.scan(tables.DISPATCH_KEYS) == [],
                         what="the old keys swept")


async def test_prune_goes_in_slices_and_says_when_more_is_left(tmp_path: Path) -> None:
    clock = ManualClock(wall_ms=T0)
    async with Daemon.open(str(tmp_path / "d"), clock=clock) as engine:
        _wid, old = await setup(engine)
        before = clock.time_ms() + 1
        assert await engine.prune_runs(before, limit=2) == {"deleted": 2, "more": True}
        assert await engine.prune_runs(before) == {"deleted": 1, "more": False}
        assert await engine.prune_runs(before) == {"deleted": 0, "more": False}
        for run_id in old:
            assert not any(traces(engine, run_id).values())
        assert engine.data_dir_bytes() > 0


async def test_a_slice_examines_a_bounded_number_of_entries(tmp_path: Path) -> None:
    clock = ManualClock(wall_ms=T0)
    async with Daemon.open(str(tmp_path / "d"), clock=clock) as engine:
        await setup(engine)
        for _ in range(5):
            await engine.start_run("idle", None)  # running: examined, not deleted
        clock.advance(10.0)

        cursor = None
        seen = []
        while True:
            done = await engine.storage.write(retention.prune_txn, clock.time_ms(), 0, cursor,
                                              10, 2)
            seen.append(done.deleted)
            cursor = done.cursor
            if cursor is None:
                break
        assert sum(seen) == 3 and len(seen) >= 4  # 8 entries, 2 per slice
