"""The lease guard's memo (actors/daemon/store.py `_GUARD_MEMO`): a shortcut, never a source.

The guard (STYLE.md rule 16) judges a worker call from the durable run record.
The memo keeps what the guard needs of the record this process last wrote,
with that record's exact bytes, so the guard need not decode the whole record
on every `complete`. These tests use a real LMDB storage with the daemon's
tables and show that the guard follows the stored bytes whenever they differ
from the memo, and that the memo stays bounded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from stepd.actors.daemon import store
from stepd.sansio.errors import Fenced, RunTerminal
from stepd.sansio.lease import Op
from stepd.storage import Storage, WriteTxn, encode

from .helpers import slot_lease, slot_record

RUN = "r_01MEMO"
LEASE = "l_01MEMO"


def _record(fence: int, status: str = "running", pad: str = "", run_id: str = RUN
            ) -> dict[str, Any]:
    return slot_record(run_id, fence, status, {"pad": pad})


def _lease(fence: int) -> dict[str, Any]:
    return slot_lease(RUN, LEASE, fence)


def _write(record: dict[str, Any], *, guarded: bool = False) -> store.RunWrite:
    return store.RunWrite(run_id=record["run_id"], record=record, journal=[],
                          status_old=record["status"],
                          guard=store.LeaseGuard(LEASE, Op.COMPLETE) if guarded else None)


def _behind_its_back(txn: WriteTxn, record: dict[str, Any]) -> None:
    """A record this process did not write through `apply_txn` (another process, an
    earlier daemon): only the stored bytes change."""
    txn.put_raw(store.RUNS, RUN, encode(record))


@pytest.fixture
def memo() -> Any:
    store._GUARD_MEMO.clear()
    yield store._GUARD_MEMO
    store._GUARD_MEMO.clear()


async def test_the_guard_follows_the_stored_bytes_when_they_differ_from_the_memo(
    tmp_path: Path, memo: dict[str, Any],
) -> None:
    async with Storage.open(tmp_path / "db", extra_tables=store.EXTRA_TABLES) as storage:
        await storage.write(lambda txn: txn.put(store.LEASES, LEASE, _lease(1)))
        await storage.write(store.apply_txn, _write(_record(fence=1)))
        assert memo[RUN][1] == {"s": 1}  # the memo holds fence 1 for the slot
        # The memo's record is on record: the guarded write passes.
        await storage.write(store.apply_txn, _write(_record(fence=1), guarded=True))
        # A later attempt (fence 2) lands without apply_txn: the memo still says 1.
        await storage.write(_behind_its_back, _record(fence=2))
        assert memo[RUN][1] == {"s": 1}
        with pytest.raises(Fenced):
            await storage.write(store.apply_txn, _write(_record(fence=1), guarded=True))
        # The same for a run that ended behind the memo's back.
        await storage.write(_behind_its_back, _record(fence=1, status="completed"))
        with pytest.raises(RunTerminal):
            await storage.write(store.apply_txn, _write(_record(fence=1), guarded=True))
        # Nothing of the refused writes is on record.
        assert storage.get(store.RUNS, RUN)["status"] == "completed"  # type: ignore[index]


async def test_the_memo_does_not_share_the_machine_s_fences(
    tmp_path: Path, memo: dict[str, Any],
) -> None:
    async with Storage.open(tmp_path / "db", extra_tables=store.EXTRA_TABLES) as storage:
        await storage.write(lambda txn: txn.put(store.LEASES, LEASE, _lease(1)))
        record = _record(fence=1)
        await storage.write(store.apply_txn, _write(record))
        record["fences"]["s"] = 2  # the live machine moves on; nothing is written yet
        assert memo[RUN][1] == {"s": 1}
        await storage.write(store.apply_txn, _write(_record(fence=1), guarded=True))


async def test_the_memo_forgets_ended_runs_and_big_records_and_stays_bounded(
    tmp_path: Path, memo: dict[str, Any],
) -> None:
    async with Storage.open(tmp_path / "db", extra_tables=store.EXTRA_TABLES) as storage:
        await storage.write(store.apply_txn, _write(_record(fence=1)))
        assert RUN in memo
        await storage.write(store.apply_txn, _write(_record(fence=1, status="completed")))
        assert RUN not in memo
        await storage.write(store.apply_txn, _write(_record(fence=1)))
        big = "x" * (store._GUARD_MEMO_ENTRY_BYTES + 1)
        await storage.write(store.apply_txn, _write(_record(fence=1, pad=big)))
        assert RUN not in memo

        # 8 MiB of records added: the memo starts again instead of growing.
        pad = "y" * 60_000
        runs = store._GUARD_MEMO_BYTES // 60_000 + 20

        def many(txn: WriteTxn) -> None:
            for i in range(runs):
                store.apply_txn(txn, _write(_record(fence=1, pad=pad, run_id=f"r_{i:06d}")))

        await storage.write(many)
        assert 0 < len(memo) < runs
        assert sum(len(entry[0]) for entry in memo.values()) <= store._GUARD_MEMO_BYTES + 70_000


async def test_a_deferred_write_is_remembered_with_the_fences_its_bytes_hold(
    tmp_path: Path, memo: dict[str, Any],
) -> None:
    """A deferred write is encoded when it is queued, but its record shares `fences`
    with the live machine, which may move on (a retry's new fence) before the
    writer puts it. The memo must pair the bytes with the fences they hold."""
    async with Storage.open(tmp_path / "db", extra_tables=store.EXTRA_TABLES) as storage:
        await storage.write(lambda txn: txn.put(store.LEASES, LEASE, _lease(1)))
        record = _record(fence=1)
        storage.write_deferred(store.apply_txn, store.deferred(_write(record)))
        record["fences"]["s"] = 2  # the machine moved on before any batch took the write
        await storage.write(store.barrier_txn)
        assert memo[RUN][1] == {"s": 1}
        # On record the slot is at fence 1: a call on the fence-1 lease passes the guard.
        await storage.write(store.apply_txn, _write(_record(fence=1), guarded=True))
