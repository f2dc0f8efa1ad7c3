"""The write-ahead log (storage/_wal.py): one synced append per batch, LMDB unsynced.

Real LMDB files, real processes killed with SIGKILL, real OS errors. A power
cut itself (unsynced pages dropped or torn) is the campaign's lazyfs test:
tests/campaign/test_lazyfs.py::test_the_write_ahead_log_survives_torn_cuts_amid_commits.
Here the parts: what a clean close leaves, what a killed writer leaves and
how it comes back (even with LMDB's meta pages destroyed), how the log ends
at a torn or aborted record, the lock between processes, the way back to
LMDB's own sync, and a log that cannot be written.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import anyio
import anyio.to_thread
import msgpack
import pytest

from stepd.storage import CommitFailed, Storage, StorageError, WriteTxn
from stepd.storage import _env as env_module
from stepd.storage import _wal as wal_module
from tests.storage._wal_child import value

ROOT = Path(__file__).resolve().parents[2]
WAIT_S = 30.0


def put_txn(txn: WriteTxn, key: str, v: object) -> None:
    txn.put("runs", key, v)


async def _kill_while_writing(data: Path, at_least: int) -> int:
    return await anyio.to_thread.run_sync(_run_and_kill, data, at_least)


def _run_and_kill(data: Path, at_least: int) -> int:
    """Run the writing child until it acknowledged ``at_least`` batches, SIGKILL it;
    return the last batch it acknowledged."""
    proc = subprocess.Popen([sys.executable, "-m", "tests.storage._wal_child", str(data), "write"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    acknowledged = -1
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + WAIT_S
        while acknowledged < at_least and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            acknowledged = int(line)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=WAIT_S)
    for line in out.splitlines():  # acknowledged before the kill landed
        acknowledged = int(line)
    assert acknowledged >= at_least, err
    return acknowledged


async def _check_all_there(data: Path, acknowledged: int) -> None:
    async with Storage.open(data, map_size=1 << 20) as storage:
        rows = {k.decode(): v for k, v in storage.scan("runs")}
    last = int(str(rows["k00"]).split(".")[0])
    assert last >= acknowledged
    assert all(rows[f"k{j:02d}"] == value(last, "." * 2000) for j in range(8))
    for i in range(last + 1):
        assert rows[f"n{i:06d}"] == value(i), i
    assert len(rows) == 8 + last + 1


def _pending(data: Path) -> wal_module.Pending | None:
    fd = wal_module.lock(str(data))
    try:
        return wal_module.recover_files(str(data), fd)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- a run


async def test_each_batch_is_one_log_append_and_a_clean_close_leaves_nothing_to_replay(
    tmp_path: Path,
) -> None:
    data = tmp_path / "db"
    async with Storage.open(data) as storage:
        for i in range(5):
            await storage.write(put_txn, f"k{i}", i)
        await storage.write(lambda txn: None)  # writes nothing: no append, no sync
        stats = storage.statistics()
        assert stats.commits == 6 and stats.log_appends == 5
        assert stats.checkpoints == 1  # the one the open starts the log with
    assert (data / "wal").exists()
    assert _pending(data) is None
    async with Storage.open(data) as storage:
        assert [storage.get("runs", f"k{i}") for i in range(5)] == list(range(5))


async def test_checkpoints_come_every_so_many_commits(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wal_module, "CHECKPOINT_COMMITS", 64)  # 1,024 by default: a slow test
    async with Storage.open(tmp_path / "db") as storage:
        for i in range(64 * 2 + 1):
            await storage.write(put_txn, f"k{i}", i)
        stats = storage.statistics()
    assert stats.log_appends == 64 * 2 + 1
    assert stats.checkpoints == 3  # at open, then after each CHECKPOINT_COMMITS


async def test_checkpoints_come_every_so_many_bytes_of_records_not_of_pages(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bytes that bound an interval are the records' own: each record also starts
    on a page of its own, and that padding must not make small commits checkpoint
    often (a sequential step's record is ~2.5 KB: a page each would checkpoint every
    64 steps, and each checkpoint syncs LMDB's file)."""
    monkeypatch.setattr(wal_module, "CHECKPOINT_BYTES", 64 << 10)
    async with Storage.open(tmp_path / "db") as storage:
        for i in range(40):  # 40 pages of log (160 KiB), a few KiB of records
            await storage.write(put_txn, f"small{i}", i)
        assert storage.statistics().checkpoints == 1  # the open's only
        big = "." * 10_000
        for i in range(6):  # 60 KB more: not yet 64 KiB
            await storage.write(put_txn, f"big{i}", big)
        assert storage.statistics().checkpoints == 1
        await storage.write(put_txn, "big6", big)  # over: due at the next batch
        await storage.write(put_txn, "next", 0)
        assert storage.statistics().checkpoints == 2


# --------------------------------------------------------------------------- recovery


async def test_a_killed_writer_comes_back_with_every_acknowledged_batch(tmp_path: Path) -> None:
    data = tmp_path / "db"
    acknowledged = await _kill_while_writing(data, at_least=150)  # past two checkpoints, map grown
    pending = _pending(data)
    assert pending is not None and pending.batches  # killed, not closed: a log to replay
    await _check_all_there(data, acknowledged)
    assert _pending(data) is None  # the open checkpointed what it replayed


async def test_recovery_does_not_trust_lmdbs_meta_pages(tmp_path: Path) -> None:
    """What a torn power cut can leave: meta pages naming pages that never reached the
    disk. Here both are destroyed outright; the checkpoint's copies replace them."""
    data = tmp_path / "db"
    acknowledged = await _kill_while_writing(data, at_least=100)
    page = os.sysconf("SC_PAGE_SIZE")
    fd = os.open(data / "data.mdb", os.O_WRONLY)
    try:
        os.pwrite(fd, b"\xa5" * (2 * page), 0)
    finally:
        os.close(fd)
    await _check_all_there(data, acknowledged)


async def test_a_second_kill_during_recovery_loses_nothing(tmp_path: Path) -> None:
    data = tmp_path / "db"
    first = await _kill_while_writing(data, at_least=80)
    second = await _kill_while_writing(data, at_least=first + 80)  # recovered, then killed again
    await _check_all_there(data, second)


# --------------------------------------------------------------------------- the log's end


def _log_of(data: Path) -> tuple[int, int, int]:
    """(descriptor, checkpoint gen, start of the log region) of a closed storage's log."""
    fd = wal_module.lock(str(data))
    checkpoint, start = wal_module._read_checkpoint(fd)
    assert checkpoint is not None
    return fd, checkpoint.gen, start


def _record(gen: int, txnid: int, kind: int, ops: list[tuple[object, ...]]) -> bytes:
    import zlib

    body = msgpack.packb((txnid, kind, ops), use_bin_type=True)
    crc = zlib.crc32(body, zlib.crc32(wal_module._GEN.pack(gen)))
    return wal_module._REC_HEAD.pack(len(body), crc, gen) + body


def _padded(record: bytes) -> bytes:
    return record + b"\0" * (-len(record) % 4096)


async def _closed_storage(data: Path) -> int:
    """A closed storage with one record; its LMDB transaction id."""
    async with Storage.open(data) as storage:
        await storage.write(put_txn, "base", 0)
    env = env_module.lmdb.open(str(data), readonly=True, lock=False)
    try:
        return int(env.info()["last_txnid"])
    finally:
        env.close()


async def test_a_record_cut_short_or_damaged_ends_the_log(tmp_path: Path) -> None:
    data = tmp_path / "db"
    txnid = await _closed_storage(data)
    fd, gen, start = _log_of(data)
    try:
        good = _record(gen, txnid + 1, 0, [(0, "runs", b"a", msgpack.packb(1), True)])
        bad = bytearray(_record(gen, txnid + 2, 0, [(0, "runs", b"b", msgpack.packb(2), True)]))
        bad[-1] ^= 0xFF  # one bit off: the CRC fails
        after = _record(gen, txnid + 3, 0, [(0, "runs", b"c", msgpack.packb(3), True)])
        os.pwrite(fd, _padded(good) + _padded(bytes(bad)) + _padded(after), start)
        batches, end = wal_module._records(fd, start, gen)
        assert [t for t, _ in batches] == [txnid + 1]
        assert end == start + 4096
        os.pwrite(fd, good[: len(good) - 3] + b"\0\0\0", start)  # torn inside the first record
        assert wal_module._records(fd, start, gen)[0] == []
        os.pwrite(fd, _padded(good), start)
        assert wal_module.recover_files(str(data), fd) is not None
    finally:
        os.close(fd)
    async with Storage.open(data) as storage:
        assert storage.get("runs", "a") == 1
        assert storage.get("runs", "b") is None and storage.get("runs", "c") is None


async def test_a_batch_marked_aborted_is_not_replayed(tmp_path: Path) -> None:
    data = tmp_path / "db"
    txnid = await _closed_storage(data)
    fd, gen, start = _log_of(data)
    try:
        records = [
            _record(gen, txnid + 1, 0, [(0, "runs", b"gone", msgpack.packb(1), True)]),
            _record(gen, txnid + 1, 1, []),  # its commit failed after it was logged
            _record(gen, txnid + 1, 0, [(0, "runs", b"kept", msgpack.packb(2), True),
                                        (1, "runs", b"base")]),
        ]
        os.pwrite(fd, b"".join(_padded(r) for r in records), start)
    finally:
        os.close(fd)
    async with Storage.open(data) as storage:
        assert storage.get("runs", "gone") is None
        assert storage.get("runs", "kept") == 2
        assert storage.get("runs", "base") is None  # the delete replayed too


async def test_a_log_that_does_not_follow_lmdb_is_refused(tmp_path: Path) -> None:
    data = tmp_path / "db"
    txnid = await _closed_storage(data)
    fd, gen, start = _log_of(data)
    try:
        os.pwrite(fd, _padded(_record(gen, txnid + 5, 0, [(0, "runs", b"x", b"\x01", True)])),
                  start)
    finally:
        os.close(fd)
    with pytest.raises(wal_module.WalCorrupt, match="does not follow"):
        async with Storage.open(data):
            pass


# --------------------------------------------------------------------------- around it


def _holder(data: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "tests.storage._wal_child", str(data), "hold"],
                            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)


async def test_a_directory_open_in_another_process_is_refused_and_left_alone(
    tmp_path: Path,
) -> None:
    data = tmp_path / "db"
    async with Storage.open(data) as storage:
        await storage.write(put_txn, "before", 1)
    with _holder(data) as proc:
        try:
            assert proc.stdout is not None and proc.stdin is not None
            readline = proc.stdout.readline
            assert (await anyio.to_thread.run_sync(readline)).strip() == "ready"
            with pytest.raises(StorageError, match="locked by another process"):
                async with Storage.open(data):
                    pass
            proc.stdin.close()  # the holder writes on, undisturbed
            assert (await anyio.to_thread.run_sync(readline)).strip() == "wrote"
            assert await anyio.to_thread.run_sync(proc.wait, WAIT_S) == 0
        finally:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(WAIT_S)
    async with Storage.open(data) as storage:
        assert storage.get("runs", "before") == 1 and storage.get("runs", "held") == 1


async def test_lmdbs_own_sync_applies_a_log_left_behind_and_removes_it(tmp_path: Path) -> None:
    data = tmp_path / "db"
    acknowledged = await _kill_while_writing(data, at_least=70)
    async with Storage.open(data, map_size=1 << 20, write_ahead_log=False) as storage:
        assert storage.statistics().log_appends == 0
        await storage.write(put_txn, "after", 1)
    assert not (data / "wal").exists()
    await _check_all_there_with(data, acknowledged, extra=1)


async def _check_all_there_with(data: Path, acknowledged: int, extra: int) -> None:
    async with Storage.open(data, map_size=1 << 20) as storage:
        rows = {k.decode(): v for k, v in storage.scan("runs")}
    last = int(str(rows["k00"]).split(".")[0])
    assert last >= acknowledged
    assert all(rows[f"n{i:06d}"] == value(i) for i in range(last + 1))
    assert len(rows) == 8 + last + 1 + extra


async def _fails_for_good(data: Path, attr: str, name: str, flags: int, *,
                          checkpoint: bool = False) -> None:
    """Swap the log's descriptor ``attr`` for the file ``name`` opened with ``flags`` (a
    real EBADF on the next use): the next write fails, and so does the one after the
    good descriptor is back. Nothing of either is visible, then or after a reopen;
    what was acknowledged before stays."""
    async with Storage.open(data) as storage:
        await storage.write(put_txn, "before", 1)
        wal = storage._writer._wal
        assert wal is not None
        bad = os.open(data / name, flags)
        good = getattr(wal, attr)
        setattr(wal, attr, bad)
        try:
            if checkpoint:
                wal.due = True  # the next batch checkpoints first
            with pytest.raises(CommitFailed):
                await storage.write(put_txn, "lost", 1)
            setattr(wal, attr, good)  # even with a good descriptor back: refused
            with pytest.raises(CommitFailed):
                await storage.write(put_txn, "later", 1)
            assert storage.get("runs", "lost") is None and storage.get("runs", "later") is None
        finally:
            setattr(wal, attr, good)
            os.close(bad)
    async with Storage.open(data) as storage:
        assert storage.get("runs", "before") == 1
        assert storage.get("runs", "lost") is None and storage.get("runs", "later") is None


async def test_a_log_that_cannot_be_written_refuses_every_later_batch(tmp_path: Path) -> None:
    """A failed append (here EBADF: the log's descriptor swapped for a read-only one)
    fails its batch, and every batch after it: after a failed sync nothing may build
    on what the disk holds."""
    await _fails_for_good(tmp_path / "db", "_fd", "wal", os.O_RDONLY)


async def test_a_checkpoint_that_fails_refuses_every_later_batch(tmp_path: Path) -> None:
    """A checkpoint's own failure (here: LMDB's meta pages cannot be read back, EBADF
    on a write-only descriptor) is the log's failure too: the batch that ran it fails,
    and so does every batch after it."""
    await _fails_for_good(tmp_path / "db", "_data_fd", "data.mdb", os.O_WRONLY, checkpoint=True)
