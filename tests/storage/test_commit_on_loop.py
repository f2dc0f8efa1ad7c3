"""Batches on the event loop's thread while the writer thread is idle (`Writer.run_inline`).

The writer thread's own batching is tests/storage/test_writer.py. Here: when a
batch runs on the loop and when it does not, that it is the same group commit
(ordering, isolation, outcomes, durability), and that the thread still takes
whatever other threads queue meanwhile.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import anyio

from stepd.storage import Storage, StorageClosed, WriteTxn
from stepd.storage import _writer as writer_module

WAIT_S = 10.0


def put_txn(txn: WriteTxn, key: str, value: object) -> str:
    txn.put("runs", key, value)
    return key


def thread_of(threads: list[int]) -> Any:
    def txn(t: WriteTxn, key: str) -> None:
        threads.append(threading.get_ident())
        t.put("runs", key, 1)

    return txn


async def test_an_awaited_write_on_an_idle_storage_commits_on_the_loop(tmp_path: Path) -> None:
    threads: list[int] = []
    async with Storage.open(tmp_path / "db") as storage:
        assert await storage.write(put_txn, "a", 1) == "a"
        await storage.write(thread_of(threads), "b")
        stats = storage.statistics()
        assert threads == [threading.get_ident()]  # the loop's thread ran the request
        assert stats.inline_batches == stats.batches == stats.commits == 2
        assert storage.get("runs", "a") == 1 and storage.get("runs", "b") == 1
    async with Storage.open(tmp_path / "db") as storage:  # durable: reopened, it is there
        assert storage.get("runs", "a") == 1


async def test_one_loop_iterations_writes_are_one_batch_on_the_loop(tmp_path: Path) -> None:
    async with Storage.open(tmp_path / "db") as storage:
        async with anyio.create_task_group() as tg:
            for i in range(8):
                tg.start_soon(storage.write, put_txn, f"k{i}", i)
        stats = storage.statistics()
        assert (stats.batches, stats.inline_batches, stats.max_batch_size) == (1, 1, 8)
        assert [storage.get("runs", f"k{i}") for i in range(8)] == list(range(8))


async def test_a_failing_request_fails_alone_on_the_loop_too(tmp_path: Path) -> None:
    def boom(txn: WriteTxn) -> None:
        txn.put("runs", "boom", 1)
        raise ValueError("boom")

    outcomes: dict[str, Any] = {}

    async def run(name: str, fn: Any, *args: Any) -> None:
        try:
            outcomes[name] = await storage.write(fn, *args)
        except ValueError as exc:
            outcomes[name] = exc

    async with Storage.open(tmp_path / "db") as storage:
        async with anyio.create_task_group() as tg:
            tg.start_soon(run, "a", put_txn, "a", 1)
            tg.start_soon(run, "boom", boom)
            tg.start_soon(run, "c", put_txn, "c", 3)
        assert storage.statistics().inline_batches == 1
        assert outcomes["a"] == "a" and outcomes["c"] == "c"
        assert isinstance(outcomes["boom"], ValueError)
        assert storage.get("runs", "boom") is None  # rolled back alone
        assert storage.get("runs", "c") == 3


async def test_deferred_writes_alone_go_to_the_thread(tmp_path: Path) -> None:
    threads: list[int] = []
    async with Storage.open(tmp_path / "db", deferred_flush_ms=1) as storage:
        storage.write_deferred(thread_of(threads), "d")
        with anyio.fail_after(WAIT_S):
            while storage.statistics().commits < 1:
                await anyio.sleep(0.001)
        assert threads == [storage.writer_thread_id]
        assert storage.statistics().inline_batches == 0


async def test_a_busy_writer_thread_keeps_the_next_batch_in_order_on_it(tmp_path: Path) -> None:
    entered, release = threading.Event(), threading.Event()
    threads: list[int] = []

    def hold(txn: WriteTxn) -> None:
        entered.set()
        release.wait(WAIT_S)
        txn.put("runs", "first", 1)

    async with Storage.open(tmp_path / "db") as storage:
        storage.commit_on_loop = False  # the held request must hold the thread, not the loop
        async with anyio.create_task_group() as tg:
            tg.start_soon(storage.write, hold)
            assert await anyio.to_thread.run_sync(entered.wait, WAIT_S)
            storage.commit_on_loop = True
            tg.start_soon(storage.write, thread_of(threads), "second")
            with anyio.fail_after(WAIT_S):  # handed to the busy thread's queue, not run here
                while storage.statistics().queued < 1:
                    await anyio.sleep(0.001)
            release.set()
        assert threads == [storage.writer_thread_id]
        assert storage.statistics().inline_batches == 0


async def test_off_means_every_batch_on_the_thread(tmp_path: Path) -> None:
    threads: list[int] = []
    async with Storage.open(tmp_path / "db", commit_on_loop=False) as storage:
        assert storage.commit_on_loop is False
        for i in range(3):
            await storage.write(thread_of(threads), f"k{i}")
        assert set(threads) == {storage.writer_thread_id}
        assert storage.statistics().inline_batches == 0


async def test_after_a_slow_commit_batches_go_to_the_thread_for_a_while(tmp_path: Path) -> None:
    threads: list[int] = []

    def slow(txn: WriteTxn) -> None:  # a commit slower than INLINE_SLOW_S (a stalling disk)
        time.sleep(writer_module.INLINE_SLOW_S * 1.5)
        txn.put("runs", "slow", 1)

    async with Storage.open(tmp_path / "db") as storage:
        await storage.write(slow)  # on the loop: nothing told it the disk would stall
        assert storage.statistics().inline_batches == 1
        await storage.write(thread_of(threads), "after")
        assert threads == [storage.writer_thread_id]  # backed off: INLINE_BACKOFF_S
        assert storage.statistics().inline_batches == 1
        storage._writer._slow_until = 0.0  # the back-off over (5 s of real time, skipped)
        storage._writer._commit_avg = 0.0
        await storage.write(thread_of(threads), "later")
        assert threads[-1] == threading.get_ident()


async def test_a_write_from_another_thread_during_a_loop_batch_is_taken_by_the_thread(
    tmp_path: Path,
) -> None:
    async with Storage.open(tmp_path / "db") as storage:

        def meanwhile(txn: WriteTxn) -> None:
            # While this batch runs on the loop, another thread queues a write:
            # the sleeping writer thread must be woken for it afterwards.
            t = threading.Thread(target=storage.write_deferred, args=(put_txn, "other", 2))
            t.start()
            t.join(WAIT_S)
            txn.put("runs", "mine", 1)

        await storage.write(meanwhile)
        assert storage.statistics().inline_batches == 1
        with anyio.fail_after(WAIT_S):
            while storage.get("runs", "other") is None:
                await anyio.sleep(0.001)
        assert storage.get("runs", "mine") == 1


async def test_closing_after_loop_batches_drains_and_refuses(tmp_path: Path) -> None:
    async with Storage.open(tmp_path / "db") as storage:
        await storage.write(put_txn, "a", 1)
    try:
        await storage.write(put_txn, "b", 2)
    except StorageClosed:
        pass
    else:  # pragma: no cover - the assertion's message
        raise AssertionError("a closed storage took a write")
