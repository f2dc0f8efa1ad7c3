"""The audit log against a real LMDB storage (asyncio and trio)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest

from stepd.actors.daemon.audit import (
    AUDIT_TABLE,
    AuditAction,
    AuditEntry,
    AuditLog,
    append_txn,
    audit_key,
    parse_cursor,
)
from stepd.sansio.errors import Invalid
from stepd.storage import Storage, WriteTxn, parse_u64be
from stepd.transport.auth import KeyRing, Need, Scope


def entry(
    time_ms: int, action: str = "runs.read", target: str | None = "r_1", **kw: Any
) -> AuditEntry:
    fields: dict[str, Any] = {"key_id": "abcdef012345", "scope": "read", "status": 200}
    fields.update(kw)
    return AuditEntry(time_ms=time_ms, action=action, target=target, **fields)


class FakeClock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


async def flushed(storage: Storage) -> None:
    """Wait until every deferred write so far is committed: an awaited no-op write
    is ordered after them and commits with them (docs/storage.md)."""

    def noop_txn(txn: WriteTxn) -> None:
        pass

    await storage.write(noop_txn)


# --------------------------------------------------------------------------- AuditEntry


def test_entry_to_dict_round_trip() -> None:
    e = AuditEntry(1_700_000_000_123, None, None, "runs.start", None, 401, "unknown_key")
    # An AuditAction is accepted too, and stored as its value.
    action: Any = AuditAction.RUNS_START
    assert AuditEntry(1_700_000_000_123, None, None, action, None, 401, "unknown_key") == e
    d = e.to_dict()
    assert d == {
        "time_ms": 1_700_000_000_123, "key_id": None, "scope": None, "action": "runs.start",
        "target": None, "status": 401, "reason": "unknown_key",
    }  # fmt: skip
    assert AuditEntry.from_dict(d) == e


def test_entry_accepts_a_scope_enum() -> None:
    assert entry(1, scope=Scope.EXECUTE).scope == "execute"


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"action": "runs.claim"}, "action"),
        ({"scope": "root"}, "scope"),
        ({"status": 99}, "status"),
        ({"status": 600}, "status"),
        ({"status": True}, "status"),
        ({"time_ms": -1}, "time_ms"),
    ],
)
def test_entry_refuses_bad_fields(kw: dict[str, Any], field: str) -> None:
    base: dict[str, Any] = {"time_ms": 1, "action": "runs.read", "target": None}
    base.update(kw)
    with pytest.raises(Invalid) as info:
        entry(**base)
    assert info.value.field == field


def test_actions_are_the_specified_twelve_the_consoles_two_and_retry_fork() -> None:
    assert {a.value for a in AuditAction} == {
        "runs.read", "runs.list", "runs.journal", "runs.export", "runs.result", "runs.start",
        "runs.signal", "runs.cancel", "actors.read", "actors.kill", "audit.read", "workers.read",
        "definitions.read", "stats.read",  # GET /v1/api/definitions, /v1/api/stats (docs/console.md)
        "runs.retry", "runs.fork",  # POST /v1/api/runs/{run}/retry, /fork (issue 15)
        "schedules.create", "schedules.list", "schedules.read", "schedules.pause",
        "schedules.resume", "schedules.delete", "runs.prune",  # docs/schedules.md, docs/storage.md
        "daemon.read",  # GET /v1/api/daemon (docs/console.md "Daemon")
    }  # fmt: skip


def test_key_layout_orders_by_time_then_seq() -> None:
    assert audit_key(1, 2) == bytes(7) + b"\x01" + bytes(7) + b"\x02"
    keys = [audit_key(t, s) for t, s in [(5, 9), (5, 10), (6, 0), (1000, 3)]]
    assert keys == sorted(keys)
    assert parse_cursor(audit_key(5, 9).hex()) == audit_key(5, 9)


@pytest.mark.parametrize("cursor", ["", "zz", "00" * 15, "00" * 17, "AB" * 16, "0g" * 16])
def test_bad_cursor(cursor: str) -> None:
    with pytest.raises(Invalid) as info:
        parse_cursor(cursor)
    assert info.value.field == "cursor"


# --------------------------------------------------------------------------- with storage


async def test_record_and_page_newest_first(tmp_path: Path) -> None:
    async with Storage.open(tmp_path) as storage:
        log = AuditLog(storage)
        for t in (100, 200, 200, 300, 150):
            await log.record(entry(t, target=f"r_{t}"))
        await flushed(storage)
        entries, cursor = log.page()
        assert [e.time_ms for e in entries] == [300, 200, 200, 150, 100]
        assert cursor is None
        # Two entries in one millisecond keep their recording order (seq).
        keys = [k for k, _ in storage.scan(AUDIT_TABLE)]
        seqs = [parse_u64be(k[8:]) for k in keys]
        assert seqs == [0, 4, 1, 2, 3]


async def test_paging_with_cursors(tmp_path: Path) -> None:
    async with Storage.open(tmp_path) as storage:
        log = AuditLog(storage)
        for t in range(1, 26):
            await log.record(entry(t))
        await flushed(storage)
        seen: list[int] = []
        cursor: str | None = None
        pages = 0
        while True:
            entries, cursor = log.page(limit=10, before=cursor)
            seen += [e.time_ms for e in entries]
            pages += 1
            if cursor is None:
                break
        assert seen == list(range(25, 0, -1))
        assert pages == 3
        # A page that ends exactly at the oldest entry says there is no more.
        entries, cursor = log.page(limit=25)
        assert len(entries) == 25 and cursor is None
        entries, cursor = log.page(limit=24)
        assert cursor is not None
        assert log.page(limit=5, before=cursor) == ([entry(1)], None)


@pytest.mark.parametrize("limit", [0, -1, 1001, True, 2.0])
async def test_page_refuses_bad_limits(tmp_path: Path, limit: Any) -> None:
    async with Storage.open(tmp_path) as storage:
        with pytest.raises(Invalid) as info:
            AuditLog(storage).page(limit=limit)
        assert info.value.field == "limit"


async def test_record_is_deferred_and_durable_soon(tmp_path: Path) -> None:
    async with Storage.open(tmp_path, deferred_flush_ms=5) as storage:
        log = AuditLog(storage)
        before = storage.statistics()
        await log.record(entry(1))
        # Returned without a commit of its own...
        stats = storage.statistics()
        assert stats.queued == before.queued + 1
        assert stats.commits == before.commits
        # ...and committed by the deferred flush, without any awaited write.
        with anyio.fail_after(5):
            while not log.page()[0]:
                await anyio.sleep(0.005)
        assert log.page()[0] == [entry(1)]
        assert storage.statistics().deferred_requests == before.deferred_requests + 1


async def test_entries_survive_reopen_and_seq_continues(tmp_path: Path) -> None:
    async with Storage.open(tmp_path) as storage:
        log = AuditLog(storage)
        for _ in range(3):
            await log.record(entry(500))
    async with Storage.open(tmp_path) as storage:
        log = AuditLog(storage)
        assert log.next_seq() == 3  # continues after 0, 1, 2
        # The clock stepped back to the same millisecond: no key is reused.
        await log.record(entry(500, target="after-restart"))
        await flushed(storage)
        entries, _ = log.page()
        assert [e.target for e in entries] == ["after-restart", "r_1", "r_1", "r_1"]
        assert storage.read(lambda txn: txn.count(AUDIT_TABLE)) == 4


async def test_append_txn_never_overwrites(tmp_path: Path) -> None:
    async with Storage.open(tmp_path) as storage:
        k1 = await storage.write(append_txn, entry(7, target="first"), 0)
        k2 = await storage.write(append_txn, entry(7, target="second"), 0)  # same key asked
        assert k1 == audit_key(7, 0) and k2 == audit_key(7, 1)
        assert [e.target for e in AuditLog(storage).page()[0]] == ["second", "first"]


async def test_append_txn_inside_a_mutation_commits_or_rolls_back_with_it(tmp_path: Path) -> None:
    """The pattern docs/http-api.md recommends for mutations: entry and change in one txn."""

    class Refused(Exception):
        pass

    def start_run_txn(txn: WriteTxn, run_id: str, e: AuditEntry, seq: int, ok: bool) -> None:
        txn.put("runs", run_id, {"status": "running"})
        append_txn(txn, e, seq)
        if not ok:
            raise Refused

    async with Storage.open(tmp_path) as storage:
        log = AuditLog(storage)
        e = log.new_entry(key_id="k", scope="execute", action=AuditAction.RUNS_START,
                          target="r_ok", status=201)  # fmt: skip
        await storage.write(start_run_txn, "r_ok", e, log.next_seq(), True)
        with pytest.raises(Refused):
            bad = log.new_entry(key_id="k", scope="execute", action="runs.start",
                                target="r_bad", status=201)  # fmt: skip
            await storage.write(start_run_txn, "r_bad", bad, log.next_seq(), False)
        assert [x.target for x in log.page()[0]] == ["r_ok"]
        assert storage.get("runs", "r_bad") is None


async def test_new_entry_uses_the_clock(tmp_path: Path) -> None:
    async with Storage.open(tmp_path) as storage:
        log = AuditLog(storage, clock=FakeClock(1_700_000_000.1234))
        e = log.new_entry(key_id=None, scope=None, action="audit.read", target=None, status=200)
        assert e.time_ms == 1_700_000_000_123


async def test_principal_to_entry_flow(tmp_path: Path) -> None:
    """What a handler does: authorize, act, record who did what with which scope."""
    kr = KeyRing.from_config(execute=["exec-key-0123456789abcdef"])
    p = kr.authorize("Bearer exec-key-0123456789abcdef", Need.READ)
    async with Storage.open(tmp_path) as storage:
        log = AuditLog(storage)
        await log.record(log.new_entry(key_id=p.key_id, scope=p.scope.value,
                                       action=AuditAction.RUNS_RESULT, target="r_9",
                                       status=200))  # fmt: skip
        await flushed(storage)
        (got,), _ = log.page()
        assert got.key_id == p.key_id and got.scope == "execute"
        raw_dump = b"".join(
            k + (storage.get_raw(AUDIT_TABLE, k) or b"") for k, _ in storage.scan(AUDIT_TABLE)
        )
        assert b"exec-key-0123456789abcdef" not in raw_dump


class AwaitOnlyStorage:
    """A storage without write_deferred: record falls back to an awaited write."""

    def __init__(self, inner: Storage) -> None:
        self.inner = inner
        self.writes = 0

    async def write(self, fn: Any, *args: Any) -> Any:
        self.writes += 1
        return await self.inner.write(fn, *args)

    def read(self, fn: Any, *args: Any) -> Any:
        return self.inner.read(fn, *args)


async def test_record_without_write_deferred_awaits_the_write(tmp_path: Path) -> None:
    async with Storage.open(tmp_path) as storage:
        wrapped = AwaitOnlyStorage(storage)
        log = AuditLog(wrapped)
        await log.record(entry(3))
        assert wrapped.writes == 1
        assert log.page()[0] == [entry(3)]  # visible at once: the write was awaited
