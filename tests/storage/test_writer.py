"""The group-commit writer: batching, ordering, isolation, failures, deferred
writes, one thread, MVCC, map growth.

These are the writer thread's: every storage here is opened with
``commit_on_loop=False``, since a request that holds the writer (`Holder`)
would hold the event loop instead if its batch ran there. The loop's own
path (the default while the thread is idle) is tests/storage/test_commit_on_loop.py.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import FrozenInstanceError
from pathlib import Path
from typing import Any

import anyio
import pytest

from stepd.storage import (
    CommitFailed,
    ReadTxn,
    Storage,
    StorageClosed,
    StorageFull,
    WriteTxn,
    u64be,
)

WAIT_S = 10.0  # a bound for every blocking wait, so a broken test fails instead of hanging


def open_storage(path: Any, **kwargs: Any) -> Any:
    """`Storage.open` with every batch on the writer thread (the module docstring)."""
    return Storage.open(path, commit_on_loop=False, **kwargs)


def put_txn(txn: WriteTxn, key: str, value: object) -> None:
    txn.put("runs", key, value)


def noop_txn(txn: WriteTxn) -> None:
    pass


class Holder:
    """Holds the writer thread inside a request until released.

    While it is held, later requests pile up in the queue; once released, the
    writer takes them all as one batch. The waits are bounded, so a failing
    test cannot hang the writer (and the storage's close) forever.
    """

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.released = threading.Event()

    def hold_txn(self, txn: WriteTxn) -> None:
        self.entered.set()
        self.released.wait(WAIT_S)

    async def wait_entered(self) -> None:
        assert await anyio.to_thread.run_sync(self.entered.wait, WAIT_S)


async def outcome(results: dict[str, Any], name: str, aw: Callable[[], Awaitable[Any]]) -> None:
    """Store ``("ok", value)`` or ``("err", exc)`` under ``name``."""
    try:
        results[name] = ("ok", await aw())
    except Exception as exc:  # noqa: BLE001 - the outcome is what the test inspects
        results[name] = ("err", exc)


async def wait_queued(storage: Storage, n: int) -> None:
    """Wait until ``n`` requests wait in the writer thread's own queue.

    Requests submitted from the loop are handed to the writer once per loop
    iteration; a test that releases a held writer must wait for that handover.
    """
    with anyio.fail_after(WAIT_S):
        while storage._writer.statistics().queued < n:
            await anyio.sleep(0.001)


async def run_as_one_batch(
    storage: Storage,
    requests: dict[str, tuple[Callable[..., Any], tuple[Any, ...]]],
    while_held: Callable[[], object] = lambda: None,
) -> dict[str, Any]:
    """Submit ``requests`` (in order) while the writer is held, so they form one batch.

    ``while_held`` runs once the holding batch has started, before the
    requests are submitted.
    """
    holder = Holder()
    results: dict[str, Any] = {}
    async with anyio.create_task_group() as tg:
        tg.start_soon(storage.write, holder.hold_txn)
        await holder.wait_entered()
        while_held()
        for name, (fn, args) in requests.items():
            # start one at a time, so submission order is the dict's order
            tg.start_soon(outcome, results, name, lambda fn=fn, args=args: storage.write(fn, *args))
            await anyio.wait_all_tasks_blocked()
        await wait_queued(storage, len(requests))
        before = storage.statistics()
        holder.released.set()
    after = storage.statistics()
    assert after.batches - before.batches <= 2  # the hold's batch (if not counted yet) and ours
    assert after.max_batch_size >= len(requests)
    return results


# The 200 writes are started in one synchronous burst on purpose (so they batch);
# in asyncio's debug mode each task captures its creation stack, and on a busy
# machine the burst alone can hold the loop past the guard's threshold.
@pytest.mark.loop_block_ok
async def test_concurrent_writes_are_batched_and_all_acknowledged(tmp_path: Path) -> None:
    async with open_storage(tmp_path / "db") as storage:
        before = storage.statistics()
        async with anyio.create_task_group() as tg:
            for i in range(200):
                tg.start_soon(storage.write, put_txn, f"k{i}", i)
        stats = storage.statistics()
        commits = stats.commits - before.commits
        assert stats.requests - before.requests == 200
        assert commits <= 50, f"{commits} commits for 200 concurrent writes: not batched"
        assert stats.batches - before.batches == commits
        assert stats.max_batch_size > 1
        assert [storage.get("runs", f"k{i}") for i in range(200)] == list(range(200))
        with pytest.raises(FrozenInstanceError):
            stats.commits = 0  # type: ignore[misc]


async def test_requests_apply_in_submission_order_within_a_batch(tmp_path: Path) -> None:
    def incr_txn(txn: WriteTxn) -> object:
        seen = txn.get("runs", "n")
        assert isinstance(seen, int)
        txn.put("runs", "n", seen + 1)
        return seen

    async with open_storage(tmp_path / "db") as storage:
        results = await run_as_one_batch(
            storage,
            {
                "first": (put_txn, ("n", 1)),
                "second": (incr_txn, ()),
                "third": (incr_txn, ()),
            },
        )
        assert results == {"first": ("ok", None), "second": ("ok", 1), "third": ("ok", 2)}
        assert storage.get("runs", "n") == 3


async def test_a_raising_request_rolls_back_alone(tmp_path: Path) -> None:
    def put_then_raise_txn(txn: WriteTxn) -> None:
        txn.put("runs", "b", "from the failing request")
        raise ValueError("conflict")

    def read_b_txn(txn: WriteTxn) -> object:
        txn.put("runs", "c", 3)
        return txn.get("runs", "b")

    async with open_storage(tmp_path / "db") as storage:
        before = storage.statistics()
        results = await run_as_one_batch(
            storage,
            {
                "a": (put_txn, ("a", 1)),
                "b": (put_then_raise_txn, ()),
                "c": (read_b_txn, ()),
            },
        )
        assert results["a"] == ("ok", None)
        assert results["b"][0] == "err" and isinstance(results["b"][1], ValueError)
        assert results["c"] == ("ok", None)  # b's write was rolled back before c ran
        assert storage.get("runs", "a") == 1
        assert storage.get("runs", "b") is None
        assert storage.get("runs", "c") == 3
        stats = storage.statistics()
        assert stats.failed_requests - before.failed_requests == 1
        assert stats.failed_commits == 0


async def test_a_commit_failure_fails_every_caller_of_the_batch(tmp_path: Path) -> None:
    def raise_txn(txn: WriteTxn) -> None:
        txn.put("runs", "b", 2)
        raise ValueError("its own error")

    cause = OSError(5, "injected I/O error")
    async with open_storage(tmp_path / "db") as storage:
        results = await run_as_one_batch(
            storage,
            {"a": (put_txn, ("a", 1)), "b": (raise_txn, ()), "c": (put_txn, ("c", 3))},
            # the next batch to start is the one of a, b and c
            while_held=lambda: storage._inject_commit_failure(cause),
        )
        for name, (kind, exc) in results.items():
            assert kind == "err" and isinstance(exc, CommitFailed), name
            assert exc.__cause__ is cause
        assert len({id(exc) for _, exc in results.values()}) == 3  # one error per caller
        assert storage.scan("runs") == []  # nothing of the batch is visible
        assert storage.statistics().failed_commits == 1
        await storage.write(put_txn, "after", 1)  # and the storage goes on
        assert storage.scan("runs") == [(b"after", 1)]


def append_txn(txn: WriteTxn, item: str) -> list[object]:
    items = txn.get("runs", "log") or []
    assert isinstance(items, list)
    items.append(item)
    txn.put("runs", "log", items)
    return items


async def test_deferred_writes_are_ordered_with_awaited_ones(tmp_path: Path) -> None:
    async with open_storage(tmp_path / "db", deferred_flush_ms=60_000) as storage:
        storage.write_deferred(append_txn, "d1")
        assert await storage.write(append_txn, "w2") == ["d1", "w2"]
        storage.write_deferred(append_txn, "d3")
        storage.write_deferred(append_txn, "d4")
        assert await storage.write(append_txn, "w5") == ["d1", "w2", "d3", "d4", "w5"]
        storage.write_deferred(append_txn, "d6")
    async with open_storage(tmp_path / "db") as storage:
        assert storage.get("runs", "log") == ["d1", "w2", "d3", "d4", "w5", "d6"]


async def test_deferred_writes_wait_for_the_next_awaited_write(tmp_path: Path) -> None:
    async with open_storage(tmp_path / "db", deferred_flush_ms=60_000) as storage:
        before = storage.statistics()
        storage.write_deferred(put_txn, "d", 1)
        await anyio.sleep(0.05)
        assert storage.get("runs", "d") is None  # still queued: nobody is waiting for it
        assert storage.statistics().queued == 1
        await storage.write(put_txn, "w", 2)
        assert storage.get("runs", "d") == 1
        assert storage.statistics().commits - before.commits == 1  # committed together


async def test_a_burst_of_deferred_writes_is_flushed_by_one_commit(tmp_path: Path) -> None:
    async with open_storage(tmp_path / "db", deferred_flush_ms=50) as storage:
        before = storage.statistics()
        started = time.monotonic()
        for i in range(100):
            storage.write_deferred(put_txn, f"d{i}", i)
        with anyio.fail_after(WAIT_S):
            while storage.get("runs", "d99") is None:
                await anyio.sleep(0.002)
        elapsed = time.monotonic() - started
        # The writer counts a commit just after it, so a reader may see the data first.
        with anyio.fail_after(WAIT_S):
            while storage.statistics().commits == before.commits:
                await anyio.sleep(0.002)
        stats = storage.statistics()
        assert stats.commits - before.commits == 1
        assert stats.deferred_requests - before.deferred_requests == 100
        assert elapsed >= 0.045  # it did wait for an awaited write to join
        assert [v for _, v in storage.scan("runs")] == sorted(range(100), key=lambda i: f"d{i}")


async def test_the_writer_wakes_for_submissions_racing_its_timed_waits(tmp_path: Path) -> None:
    # A 1 ms flush delay keeps the writer in short timed waits while other threads
    # queue deferred writes and the loop awaited ones: a wake-up landing just as a
    # wait times out must neither be lost (a write left queued) nor released twice.
    per_thread = 300
    async with open_storage(tmp_path / "db", deferred_flush_ms=1) as storage:
        before = storage.statistics()

        def submit_from_thread(n: int) -> None:
            for i in range(per_thread):
                storage.write_deferred(put_txn, f"t{n}-{i}", i)
                if i % 7 == 0:
                    time.sleep(0.0005)  # land some submissions inside a timed wait

        async with anyio.create_task_group() as tg:
            for n in range(3):
                tg.start_soon(anyio.to_thread.run_sync, submit_from_thread, n)
            for i in range(100):
                await storage.write(put_txn, f"w{i}", i)
        await storage.write(noop_txn)  # everything queued before it is on record
        stats = storage.statistics()
        assert stats.requests - before.requests == 3 * per_thread + 101
        assert stats.failed_requests == before.failed_requests
        assert stats.queued == 0
        for n in range(3):
            assert storage.get("runs", f"t{n}-{per_thread - 1}") == per_thread - 1
        assert len(storage.scan("runs")) == 3 * per_thread + 100


async def test_the_flush_deadline_follows_the_given_clock(tmp_path: Path) -> None:
    now = [1000.0]
    async with open_storage(tmp_path / "db", deferred_flush_ms=10, clock=lambda: now[0]) as storage:
        storage.write_deferred(put_txn, "d", 1)
        await anyio.sleep(0.1)  # ten flush delays of real time, none of clock time
        assert storage.get("runs", "d") is None
        now[0] += 0.011
        with anyio.fail_after(WAIT_S):
            while storage.get("runs", "d") is None:
                await anyio.sleep(0.002)


async def test_deferred_writes_are_flushed_on_close(tmp_path: Path) -> None:
    async with open_storage(tmp_path / "db", deferred_flush_ms=60_000) as storage:
        storage.write_deferred(put_txn, "d", 1)
    async with open_storage(tmp_path / "db") as storage:
        assert storage.get("runs", "d") == 1


def boom_txn(txn: WriteTxn) -> None:
    txn.put("runs", "boom", 1)
    raise ZeroDivisionError("deferred failure")


async def test_deferred_errors_go_to_the_callback_on_the_loop_thread(tmp_path: Path) -> None:
    errors: list[tuple[BaseException, int]] = []

    def on_error(exc: BaseException) -> None:
        errors.append((exc, threading.get_ident()))

    async with open_storage(tmp_path / "db", on_deferred_error=on_error) as storage:
        storage.write_deferred(boom_txn)
        storage.write_deferred(put_txn, "ok", 1)
        await storage.write(put_txn, "w", 2)
        assert [(type(e), tid) for e, tid in errors] == [(ZeroDivisionError, threading.get_ident())]
        assert storage.get("runs", "boom") is None
        assert storage.get("runs", "ok") == 1
        assert storage.get("runs", "w") == 2


async def test_deferred_errors_fail_the_storage_context_by_default(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    reached_end = False
    with (
        caplog.at_level(logging.ERROR, logger="stepd.storage"),
        pytest.raises(ZeroDivisionError, match="deferred failure"),
        anyio.fail_after(WAIT_S),
    ):
        async with open_storage(tmp_path / "db", deferred_flush_ms=1) as storage:
            storage.write_deferred(boom_txn)
            await anyio.sleep(WAIT_S * 2)  # cancelled by the failure
            reached_end = True
    assert not reached_end
    assert any("deferred storage write failed" in r.getMessage() for r in caplog.records)


async def test_a_raising_callback_fails_the_storage_context(tmp_path: Path) -> None:
    def on_error(exc: BaseException) -> None:
        raise RuntimeError("the callback broke") from exc

    with pytest.raises(RuntimeError, match="callback broke"):
        with anyio.fail_after(WAIT_S):
            async with open_storage(tmp_path / "db", on_deferred_error=on_error) as storage:
                storage.write_deferred(boom_txn)
                await anyio.sleep(WAIT_S * 2)


async def test_a_cancelled_write_still_commits(tmp_path: Path) -> None:
    async with open_storage(tmp_path / "db") as storage:
        holder = Holder()
        async with anyio.create_task_group() as tg:
            tg.start_soon(storage.write, holder.hold_txn)
            await holder.wait_entered()
            with anyio.CancelScope() as scope:
                scope.cancel()
                await storage.write(put_txn, "k", 1)  # submitted, then cancelled waiting
            holder.released.set()
        await storage.write(noop_txn)
        assert storage.get("runs", "k") == 1


async def test_writes_run_on_one_thread_which_is_not_the_loops(tmp_path: Path) -> None:
    threads: set[int] = set()

    def record_txn(txn: WriteTxn, i: int) -> None:
        threads.add(threading.get_ident())
        txn.put("runs", u64be(i), i)

    async with open_storage(tmp_path / "db") as storage:
        for round_ in range(20):
            async with anyio.create_task_group() as tg:
                for i in range(10):
                    tg.start_soon(storage.write, record_txn, round_ * 10 + i)
        storage.write_deferred(record_txn, 1000)
        await storage.write(record_txn, 1001)
        assert storage.statistics().batches >= 20
        assert threads == {storage.writer_thread_id}
        assert threading.get_ident() not in threads


async def test_reads_never_see_a_half_applied_batch(tmp_path: Path) -> None:
    half = threading.Event()
    go = threading.Event()

    def put_signal_wait_txn(txn: WriteTxn) -> None:
        txn.put("runs", "b", 2)
        half.set()  # a is applied, b is applied, c is not: the batch is half done
        go.wait(WAIT_S)

    def read_all_txn(txn: ReadTxn) -> list[object]:
        return [txn.get("runs", k) for k in ("a", "b", "c")]

    async with open_storage(tmp_path / "db") as storage:
        requests: dict[str, tuple[Callable[..., Any], tuple[Any, ...]]] = {
            "a": (put_txn, ("a", 1)),
            "b": (put_signal_wait_txn, ()),
            "c": (put_txn, ("c", 3)),
        }
        async with anyio.create_task_group() as tg:
            tg.start_soon(run_as_one_batch, storage, requests)
            assert await anyio.to_thread.run_sync(half.wait, WAIT_S)
            assert storage.read(read_all_txn) == [None, None, None]  # on the loop thread
            assert await anyio.to_thread.run_sync(storage.read, read_all_txn) == [None] * 3
            go.set()
        assert storage.read(read_all_txn) == [1, 2, 3]


async def test_map_grows_under_many_writers(tmp_path: Path) -> None:
    acked: list[str] = []
    stop_reading = anyio.Event()

    async def writer(w: int) -> None:
        for i in range(40):
            key = f"w{w:02d}-{i:03d}"
            await storage.write(put_txn, key, {"w": w, "i": i, "pad": b"\x5a" * 1000})
            acked.append(key)

    async def reader() -> None:  # reads interleave with the resizes
        while not stop_reading.is_set():
            storage.scan("runs", limit=3, reverse=True)
            await anyio.sleep(0.001)

    async with open_storage(tmp_path / "db", map_size=64 << 10, max_map_size=64 << 20) as storage:
        async with anyio.create_task_group() as outer:
            outer.start_soon(reader)
            async with anyio.create_task_group() as tg:
                for w in range(32):
                    tg.start_soon(writer, w)
            stop_reading.set()
        stats = storage.statistics()
        assert stats.map_growths >= 3, stats
        assert stats.map_size >= 1 << 20
        assert len(acked) == 32 * 40
        assert all(storage.get("runs", k) is not None for k in acked)
    async with open_storage(tmp_path / "db", map_size=64 << 10) as storage:
        assert storage.read(ReadTxn.count, "runs") == len(acked)


async def test_storage_full_beyond_the_maximum_loses_no_acknowledged_write(tmp_path: Path) -> None:
    acked: list[str] = []
    full: list[StorageFull] = []

    async def writer(w: int) -> None:
        for i in range(1000):
            key = f"w{w:02d}-{i:04d}"
            try:
                await storage.write(put_txn, key, b"\xa5" * 2000)
            except StorageFull as exc:
                full.append(exc)
                return
            acked.append(key)

    async with open_storage(tmp_path / "db", map_size=64 << 10, max_map_size=256 << 10) as storage:
        async with anyio.create_task_group() as tg:
            for w in range(16):
                tg.start_soon(writer, w)
        stats = storage.statistics()
        assert len(full) == 16 and "max_map_size" in str(full[0])
        assert acked, "nothing was acknowledged before the map was full"
        assert stats.map_size == 256 << 10 and stats.map_growths == 2
        assert all(storage.get("runs", k) is not None for k in acked)
    async with open_storage(tmp_path / "db", map_size=64 << 10, max_map_size=256 << 10) as storage:
        stored = {k.decode() for k, _ in storage.scan("runs")}
        assert set(acked) <= stored
        assert len(stored) == len(acked)  # and nothing that failed was stored


class WriterDies(BaseException):
    """Not an Exception: it escapes the request isolation and kills the writer."""


async def test_a_dead_writer_fails_its_callers_and_the_context(tmp_path: Path) -> None:
    def die_txn(txn: WriteTxn) -> None:
        raise WriterDies

    with pytest.raises(StorageClosed, match="writer thread died") as info:
        with anyio.fail_after(WAIT_S):
            async with open_storage(tmp_path / "db") as storage:
                with pytest.raises(StorageClosed):
                    await storage.write(die_txn)
                with pytest.raises(StorageClosed):
                    await storage.write(noop_txn)
                await anyio.sleep(WAIT_S * 2)  # cancelled: the context fails loudly
    assert isinstance(info.value.__cause__, WriterDies)


async def test_settled_says_whether_every_write_is_on_record(tmp_path: Path) -> None:
    """`Storage.settled`: what lets a reader skip a barrier when nothing is pending."""
    async with open_storage(str(tmp_path / "s")) as storage:
        assert storage.settled()

        def put(txn: Any, key: str) -> None:
            txn.put("runs", key, {"k": key})

        storage.write_deferred(put, "a")
        assert not storage.settled()
        await storage.write(put, "b")  # ordered after "a": both committed and delivered
        assert storage.settled()
        assert storage.get("runs", "a") == {"k": "a"}
