"""Opening: tables, schema version, double open, use after fork, closed storage."""

from __future__ import annotations

import logging
import os
import threading
import time
import warnings
from pathlib import Path

import anyio
import lmdb
import pytest

from stepd.storage import (
    SCHEMA_VERSION,
    TABLES,
    AlreadyOpen,
    SchemaMismatch,
    Storage,
    StorageClosed,
    UsedAfterFork,
    WriteTxn,
    encode,
)
from stepd.storage._env import Gate


def put_txn(txn: WriteTxn, key: str, value: object) -> None:
    txn.put("runs", key, value)


def _set_schema(path: Path, version: object) -> None:
    env = lmdb.open(str(path), max_dbs=32)
    try:
        meta = env.open_db(b"meta")
        with env.begin(write=True) as txn:
            txn.put(b"schema_version", encode(version), db=meta)
    finally:
        env.close()


async def test_tables_and_schema_version_created(tmp_path: Path) -> None:
    async with Storage.open(tmp_path / "db", extra_tables=("idx_a", "idx_b")) as storage:
        assert storage.tables == (*TABLES, "idx_a", "idx_b")
        assert storage.get("meta", b"schema_version") == SCHEMA_VERSION
    env = lmdb.open(str(tmp_path / "db"), max_dbs=32, readonly=True)
    try:
        with env.begin() as txn:
            names = {key.decode() for key, _ in txn.cursor()}
    finally:
        env.close()
    assert names == {*TABLES, "idx_a", "idx_b"}


async def test_newer_schema_is_refused(tmp_path: Path) -> None:
    async with Storage.open(tmp_path / "db"):
        pass
    _set_schema(tmp_path / "db", SCHEMA_VERSION + 1)
    with pytest.raises(SchemaMismatch, match="newer stepd"):
        async with Storage.open(tmp_path / "db"):
            pass
    _set_schema(tmp_path / "db", "garbage")
    with pytest.raises(SchemaMismatch, match="no migration"):
        async with Storage.open(tmp_path / "db"):
            pass
    _set_schema(tmp_path / "db", SCHEMA_VERSION)
    async with Storage.open(tmp_path / "db"):  # and the refusals released the directory
        pass


async def test_double_open_refused(tmp_path: Path) -> None:
    (tmp_path / "link").symlink_to(tmp_path / "db", target_is_directory=False)
    async with Storage.open(tmp_path / "db"):
        with pytest.raises(AlreadyOpen, match="already open"):
            async with Storage.open(tmp_path / "db"):
                pass
        with pytest.raises(AlreadyOpen):  # the same directory by another name
            async with Storage.open(tmp_path / "link"):
                pass
    async with Storage.open(tmp_path / "link"):  # free again once closed
        pass


async def test_open_over_a_raw_lmdb_handle_refused(tmp_path: Path) -> None:
    # py-lmdb's own guard (by file identity) maps to AlreadyOpen too.
    async with Storage.open(tmp_path / "db"):
        pass
    env = lmdb.open(str(tmp_path / "db"), max_dbs=32)
    try:
        with pytest.raises(AlreadyOpen):
            async with Storage.open(tmp_path / "db"):
                pass
    finally:
        env.close()


async def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="bad table name"):
        async with Storage.open(tmp_path / "db", extra_tables=("Bad Name",)):
            pass
    with pytest.raises(ValueError, match="duplicate"):
        async with Storage.open(tmp_path / "db", extra_tables=("runs",)):
            pass
    with pytest.raises(ValueError, match="map_size"):
        async with Storage.open(tmp_path / "db", map_size=1 << 20, max_map_size=1 << 16):
            pass


async def test_closed_storage_refuses_everything(tmp_path: Path) -> None:
    async with Storage.open(tmp_path / "db") as storage:
        await storage.write(put_txn, "k", 1)
    with pytest.raises(StorageClosed):
        await storage.write(put_txn, "k", 2)
    with pytest.raises(StorageClosed):
        storage.write_deferred(put_txn, "k", 2)
    with pytest.raises(StorageClosed):
        storage.get("runs", "k")
    with pytest.raises(StorageClosed):
        storage.scan("runs")


async def test_nosync_logs_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="stepd.storage"):
        async with Storage.open(tmp_path / "db", sync=False) as storage:
            await storage.write(put_txn, "k", 1)
    assert any("UNSAFE" in r.getMessage() for r in caplog.records)


async def test_use_after_fork_refused(tmp_path: Path) -> None:
    async with Storage.open(tmp_path / "db") as storage:
        await storage.write(put_txn, "k", 1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # 3.12+: fork with threads
            pid = os.fork()
        if pid == 0:  # the child: report through the exit code only, never return
            code = 0
            try:
                try:
                    storage.get("runs", "k")
                    code |= 1
                except UsedAfterFork:
                    pass
                try:
                    storage.write_deferred(put_txn, "k", 2)
                    code |= 2
                except UsedAfterFork:
                    pass
                # the awaited write refuses before its first await (no loop needed)
                write = storage.write(put_txn, "k", 2)
                try:
                    write.send(None)
                    code |= 8
                except UsedAfterFork:
                    pass
                finally:
                    write.close()
            except BaseException:  # noqa: BLE001 - reported through the exit code
                code |= 4
            os._exit(code)
        _, status = await anyio.to_thread.run_sync(os.waitpid, pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "the child could use the storage"
        assert storage.get("runs", "k") == 1  # the parent is unaffected
        await storage.write(put_txn, "k", 3)


def test_gate_resize_waits_for_readers_and_readers_may_nest() -> None:
    # The map is resized (exclusive) only while no read transaction is open;
    # a reader that nests a read while a resize waits must not deadlock.
    gate = Gate()
    reader_in = threading.Event()
    nested_done = threading.Event()
    resize_may_finish = threading.Event()
    order: list[str] = []

    def reader() -> None:
        with gate.shared():
            reader_in.set()
            time.sleep(0.05)  # the resizer is now waiting
            with gate.shared():  # nested: must not wait behind the resizer
                order.append("nested read")
            nested_done.set()
            resize_may_finish.wait(5)
            order.append("reader out")

    def resizer() -> None:
        assert reader_in.wait(5)
        with gate.exclusive():
            order.append("resize")

    threads = [threading.Thread(target=reader), threading.Thread(target=resizer)]
    for t in threads:
        t.start()
    assert nested_done.wait(5), "a nested read deadlocked behind a waiting resize"
    resize_may_finish.set()
    for t in threads:
        t.join(5)
    assert order == ["nested read", "reader out", "resize"]
