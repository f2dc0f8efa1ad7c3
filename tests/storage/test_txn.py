"""The txn objects: get/put/delete, raw bytes, scans, the journal helpers."""

from __future__ import annotations

from pathlib import Path

import pytest

from stepd.storage import (
    ReadTxn,
    Storage,
    UnknownTable,
    WriteTxn,
    journal_key,
    last_journal_seq_txn,
    u64be,
)

from .test_codec import VALUES


def put_txn(txn: WriteTxn, table: str, key: bytes | str, value: object) -> None:
    txn.put(table, key, value)


def put_many_txn(txn: WriteTxn, table: str, items: list[tuple[bytes, object]]) -> None:
    for key, value in items:
        txn.put(table, key, value)


async def test_every_value_type_round_trips(tmp_path: Path) -> None:
    items = [(u64be(i), v) for i, v in enumerate(VALUES)]
    async with Storage.open(tmp_path / "db") as storage:
        await storage.write(put_many_txn, "runs", items)
        for key, value in items:
            assert storage.get("runs", key) == value
    async with Storage.open(tmp_path / "db") as storage:  # and from disk
        assert storage.scan("runs") == items


async def test_raw_bytes_and_str_keys(tmp_path: Path) -> None:
    def write_txn(txn: WriteTxn) -> tuple[bool, bool]:
        txn.put_raw("audit", "clé", b"\x00raw\xff")
        first = txn.put("runs", "r", 1, overwrite=False)
        second = txn.put("runs", "r", 2, overwrite=False)
        return first, second

    async with Storage.open(tmp_path / "db") as storage:
        assert await storage.write(write_txn) == (True, False)
        assert storage.get_raw("audit", "clé".encode()) == b"\x00raw\xff"
        assert storage.get("runs", b"r") == 1
        assert storage.get("runs", "missing") is None
        assert storage.read(ReadTxn.exists, "runs", "r")
        assert not storage.read(ReadTxn.exists, "runs", "missing")


async def test_delete(tmp_path: Path) -> None:
    def delete_txn(txn: WriteTxn, key: str) -> bool:
        return txn.delete("runs", key)

    async with Storage.open(tmp_path / "db") as storage:
        await storage.write(put_txn, "runs", "k", None)
        assert storage.read(ReadTxn.exists, "runs", "k")  # a stored None is present
        assert storage.get("runs", "k") is None
        assert await storage.write(delete_txn, "k") is True
        assert await storage.write(delete_txn, "k") is False
        assert not storage.read(ReadTxn.exists, "runs", "k")


async def test_scan_prefix_range_reverse_limit(tmp_path: Path) -> None:
    keys = [b"a", b"b1", b"b2", b"b3", b"b\xff", b"c", b"c1"]
    async with Storage.open(tmp_path / "db") as storage:
        items: list[tuple[bytes, object]] = [(k, k.decode("latin-1")) for k in keys]
        await storage.write(put_many_txn, "signals", items)

        def ks(**kw: object) -> list[bytes]:
            return [k for k, _ in storage.scan("signals", **kw)]  # type: ignore[arg-type]

        assert ks() == keys
        assert ks(prefix=b"b") == [b"b1", b"b2", b"b3", b"b\xff"]
        assert ks(prefix="b", reverse=True) == [b"b\xff", b"b3", b"b2", b"b1"]
        assert ks(start=b"b2", stop=b"c") == [b"b2", b"b3", b"b\xff"]
        assert ks(start=b"b2", stop=b"c", reverse=True) == [b"b\xff", b"b3", b"b2"]
        assert ks(start=b"b25") == [b"b3", b"b\xff", b"c", b"c1"]
        assert ks(stop=b"b2") == [b"a", b"b1"]
        assert ks(stop=b"zzz", reverse=True) == list(reversed(keys))
        assert ks(stop=b"b2", reverse=True) == [b"b1", b"a"]
        assert ks(prefix=b"b", start=b"b2", limit=2) == [b"b2", b"b3"]
        assert ks(prefix=b"b", reverse=True, limit=1) == [b"b\xff"]
        assert ks(prefix=b"c", start=b"a") == [b"c", b"c1"]  # start below the prefix
        assert ks(prefix=b"x") == []
        assert ks(prefix=b"x", reverse=True) == []
        assert ks(start=b"c", stop=b"b") == []
        assert ks(limit=0) == []
        assert storage.scan("signals", prefix=b"c1") == [(b"c1", "c1")]
        with pytest.raises(ValueError):
            storage.scan("signals", limit=-1)


async def test_journal_in_order(tmp_path: Path) -> None:
    def append_txn(txn: WriteTxn, run_id: str, event: object) -> int:
        seq = last_journal_seq_txn(txn, run_id) + 1
        txn.put("journal", journal_key(run_id, seq), event)
        return seq

    async with Storage.open(tmp_path / "db") as storage:
        # interleave three runs whose ids share prefixes; seqs pass 255 and 65535
        for i in range(300):
            for run_id in ("run", "run-1", "ru"):
                assert await storage.write(append_txn, run_id, {"i": i}) == i + 1
        await storage.write(put_txn, "journal", journal_key("run", 70_000), "far")
        entries = storage.journal("run")
        assert [seq for seq, _ in entries] == [*range(1, 301), 70_000]
        assert entries[0] == (1, {"i": 0}) and entries[-1] == (70_000, "far")
        assert storage.journal("run", after_seq=298) == [(299, {"i": 298}), (300, {"i": 299}),
                                                           (70_000, "far")]
        assert storage.journal("run-1", after_seq=10, limit=2) == [(11, {"i": 10}), (12, {"i": 11})]
        assert storage.journal("nope") == []
        assert storage.read(last_journal_seq_txn, "ru") == 300
        assert storage.read(last_journal_seq_txn, "nope") == 0


async def test_unknown_table(tmp_path: Path) -> None:
    async with Storage.open(tmp_path / "db", extra_tables=("idx_runs_by_status",)) as storage:
        assert storage.tables[-1] == "idx_runs_by_status"
        await storage.write(put_txn, "idx_runs_by_status", b"pending\x00r1", b"")
        with pytest.raises(UnknownTable, match="idx_nope"):
            storage.get("idx_nope", b"k")
        with pytest.raises(KeyError):  # UnknownTable is a KeyError too
            await storage.write(put_txn, "idx_nope", b"k", 1)


async def test_txn_is_invalid_after_its_function(tmp_path: Path) -> None:
    kept: list[ReadTxn] = []

    def keep_txn(txn: ReadTxn) -> None:
        kept.append(txn)

    async with Storage.open(tmp_path / "db") as storage:
        storage.read(keep_txn)
        await storage.write(keep_txn)
        for txn in kept:
            with pytest.raises(RuntimeError, match="after its function returned"):
                txn.get("runs", b"k")


async def test_count(tmp_path: Path) -> None:
    async with Storage.open(tmp_path / "db") as storage:
        items: list[tuple[bytes, object]] = [(u64be(i), i) for i in range(42)]
        await storage.write(put_many_txn, "workers", items)
        assert storage.read(ReadTxn.count, "workers") == 42
