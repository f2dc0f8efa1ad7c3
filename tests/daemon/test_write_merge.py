"""A run's deferred write taken into its next write (`RunWrites._take_behind`, `store.merge`).

Under load a queued slot's offer is written behind, and the worker's `complete`
arrives before the writer thread took the offer: the run actor takes the offer
back (`Storage.withdraw`) and writes it first inside the `complete`'s write. What
is on record afterwards must be what the two writes in a row would have left,
also when the `complete`'s own part is refused by the durable guard or cannot be
written. Real LMDB storage, the daemon's tables; the daemon itself for the path.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest

from stepd.actors import ManualClock
from stepd.actors.daemon import Daemon, DaemonConfig, store
from stepd.sansio.errors import Fenced
from stepd.sansio.lease import Op
from stepd.storage import Storage, WriteTxn

from .helpers import claim_one, eventually, slot_lease, slot_record, writer_held

WAIT_S = 10.0  # a bound, not a sleep: each wait returns as soon as its event is set
RUN = "r_01MERGE"
LEASE = "l_01MERGE"


def _record(fence: int, status: str = "running", state: Any = None) -> dict[str, Any]:
    return slot_record(RUN, fence, status, state)


def _lease(fence: int, status: str = "offered") -> dict[str, Any]:
    return slot_lease(RUN, LEASE, fence, status)


def _entry(seq: int, kind: str) -> dict[str, Any]:
    return {"seq": seq, "type": kind, "at": seq}


def _offer(fence: int) -> store.RunWrite:
    """A deferred offer, as `_write_behind` queues it (its record encoded, fences kept)."""
    return store.deferred(store.RunWrite(
        run_id=RUN, record=_record(fence), journal=[_entry(2, "step_offered")],
        status_old="running", leases=[_lease(fence)]))


def _complete(fence: int, output: Any = "done") -> store.RunWrite:
    return store.RunWrite(
        run_id=RUN, record=_record(fence, "completed", "done"),
        journal=[_entry(3, "step_completed"), _entry(4, "run_completed")],
        status_old="running", leases=[dict(_lease(fence, "completed"), output=output)],
        guard=store.LeaseGuard(LEASE, Op.COMPLETE))


def _on_record(storage: Storage) -> tuple[Any, list[str], Any]:
    journal = [e["type"] for _, e in storage.journal(RUN)]  # type: ignore[index]
    return storage.get(store.RUNS, RUN), journal, storage.get(store.LEASES, LEASE)


def _statuses(storage: Storage) -> list[Any]:
    """The statuses the run summaries index holds."""
    return [s["status"] for _, s in storage.scan(store.RUN_SUMMARIES)]  # type: ignore[index]


@pytest.fixture
async def storage(tmp_path: Path) -> AsyncIterator[Storage]:
    async with Storage.open(tmp_path / "db", extra_tables=store.EXTRA_TABLES) as s:
        # The run as created, before its slot was offered: fence 0, no lease on record.
        await s.write(store.apply_txn, store.RunWrite(
            run_id=RUN, record=_record(0), journal=[_entry(1, "run_started")], create=True,
            active_new=True))
        yield s


async def test_a_merged_write_leaves_what_the_two_writes_in_a_row_leave(storage: Storage) -> None:
    # The guard judges on the offer's fence and lease record, which are not on
    # record yet: judged from the durable record alone, this complete is fenced.
    assert await storage.write(store.apply_txn, store.merge(_offer(1), _complete(1))) is None
    record, journal, lease = _on_record(storage)
    assert record["status"] == "completed" and record["state"] == "done"
    assert journal == ["run_started", "step_offered", "step_completed", "run_completed"]
    assert lease["status"] == "completed"
    # The indexes moved from where the offer found them (running) to completed.
    assert _statuses(storage) == ["completed"]


def test_merge_keeps_every_other_field_of_the_newer_write() -> None:
    # `merge` copies the newer write field by field (not `dataclasses.replace`): a
    # field added to `RunWrite` must come along without a change to `merge`.
    import dataclasses

    old = store.RunWrite("r", {"status": "running"}, [{"seq": 1}], due_old=5, active_old=True,
                         status_old="pending", leases=[{"lease_id": "a"}], fences_then={})
    new = store.RunWrite(
        "r", {"status": "running", "seq": 2}, [{"seq": 2}], record_raw=b"x", due_old=6,
        due_new=7, active_old=False, active_new=True, status_old="running", dispatch_key="k",
        leases=[{"lease_id": "b"}], lease_status=[("b", "completed", 3)], inbox_done=[b"i"],
        fences_then={"s": 1},
    )
    merged = store.merge(old, new)
    assert merged == dataclasses.replace(
        new, journal=[{"seq": 1}, {"seq": 2}], due_old=5, active_old=True,
        status_old="pending", leases=[{"lease_id": "a"}, {"lease_id": "b"}], merged=old)
    assert merged is not new and new.journal == [{"seq": 2}] and new.merged is None


async def test_a_refused_merged_write_still_writes_the_offer_it_took_in(storage: Storage) -> None:
    # The offer is fence 2; the complete carries a lease of fence 1: stale.
    stale = _complete(1)
    stale.leases = []
    offer = _offer(2)
    offer.leases = [dict(_lease(2), lease_id="l_other")]
    await storage.write(lambda txn: txn.put(store.LEASES, LEASE, _lease(1)))
    done = await storage.write(store.apply_txn, store.merge(offer, stale))
    assert isinstance(done, store.Refused) and isinstance(done.exc, Fenced)
    record, journal, _ = _on_record(storage)
    assert record["status"] == "running" and record["fences"] == {"s": 2}  # the offer alone
    assert journal == ["run_started", "step_offered"]
    assert storage.get(store.LEASES, "l_other")["fence"] == 2  # type: ignore[index]


async def test_a_merged_write_that_cannot_be_written_still_writes_the_offer(
        storage: Storage) -> None:
    # The complete's lease record cannot be encoded (a 71-bit integer): its part fails
    # after its record and journal were put, in a savepoint; the offer it took in
    # stands, and nothing else.
    done = await storage.write(store.apply_txn, store.merge(_offer(1), _complete(1, 2**70)))
    assert isinstance(done, store.Refused) and isinstance(done.exc, OverflowError)
    record, journal, lease = _on_record(storage)
    assert record["status"] == "running" and record["fences"] == {"s": 1}
    assert journal == ["run_started", "step_offered"]
    assert lease["status"] == "offered"
    assert _statuses(storage) == ["running"]


async def test_a_savepoint_rolls_back_its_writes_and_their_log(storage: Storage) -> None:
    logged: list[int] = []

    def inner(txn: WriteTxn) -> None:
        txn.put(store.RUNS, "b", 2)
        raise ValueError("no")

    def outer(txn: WriteTxn) -> None:
        txn.put(store.RUNS, "a", 1)
        with pytest.raises(ValueError, match="no"):
            txn.savepoint(inner)
        txn.put(store.RUNS, "c", 3)
        logged.append(len(txn._log or ()))  # what the write-ahead log gets of this request

    await storage.write(outer)
    assert [storage.get(store.RUNS, k) for k in "abc"] == [1, None, 3]
    assert logged == [2]


async def test_withdraw_takes_back_only_what_no_batch_took(storage: Storage) -> None:
    kept = storage.write_deferred(lambda txn: txn.put(store.RUNS, "kept", 1))
    taken_back = storage.write_deferred(lambda txn: txn.put(store.RUNS, "taken_back", 1))
    assert storage.withdraw(taken_back) is True
    await storage.write(store.barrier_txn)  # both went by in a batch
    assert storage.get(store.RUNS, "kept") == 1
    assert storage.get(store.RUNS, "taken_back") is None
    assert storage.withdraw(kept) is False  # committed: too late


async def test_withdraw_refuses_a_write_in_the_batch_the_thread_holds(storage: Storage) -> None:
    entered, release = threading.Event(), threading.Event()

    def hold(txn: WriteTxn) -> None:
        entered.set()
        release.wait(WAIT_S)

    storage.commit_on_loop = False  # the held request must hold the thread, not the loop
    try:
        async with anyio.create_task_group() as tg:
            # Staged in one loop turn: handed over together, taken as one batch.
            first = storage.write_deferred(lambda txn: txn.put(store.RUNS, "first", 1))
            tg.start_soon(storage.write, hold)
            assert await anyio.to_thread.run_sync(entered.wait, WAIT_S)
            try:
                assert storage.withdraw(first) is False  # it ran already, in that batch
            finally:
                release.set()
    finally:
        storage.commit_on_loop = True
    assert storage.get(store.RUNS, "first") == 1


# --------------------------------------------------------------------------- the daemon's path


@pytest.fixture
async def engine(tmp_path: Path) -> AsyncIterator[Daemon]:
    config = DaemonConfig(worker_expiry_ms=0)
    async with Daemon.open(str(tmp_path / "data"), clock=ManualClock(wall_ms=1_700_000_000_000),
                           config=config) as e:
        yield e


async def test_a_queued_offer_rides_the_complete_that_follows_it(engine: Daemon) -> None:
    wid = str((await engine.register_worker(name="w", definitions=[
        {"name": "one", "steps": [{"id": "t", "kind": "task", "body": "t"}]}]))["worker_id"])
    run_id, _ = await engine.start_run("one")
    merged = engine.stats.writes_merged
    async with writer_held(engine) as tg:  # the offer queues behind the held write
        lease = await claim_one(engine, wid)
        assert engine.storage.get("leases", lease["lease_id"]) is None  # not on record yet

        async def call() -> None:
            await engine.lease_call(lease["lease_id"], Op.STARTED, {})
            await engine.lease_call(lease["lease_id"], Op.COMPLETE, {"output": 7})

        tg.start_soon(call)
        # The complete took in the deferred write before it (the `started`, written
        # behind, itself queued behind the offer) while the writer still holds.
        await eventually(lambda: engine.stats.writes_merged == merged + 1,
                         what="the complete's write taking the one before it in")
    view = await eventually(lambda: (v := engine.status(run_id))["status"] == "completed" and v)
    assert view["result"] == 7
    assert engine.stats.writes_merged == merged + 1
    journal = engine.journal(run_id)
    assert [e["seq"] for e in journal] == list(range(1, len(journal) + 1))
    assert [e["type"] for e in journal].count("step_offered") == 1
    assert engine.storage.get("leases", lease["lease_id"])["status"] == "completed"  # type: ignore[index]
