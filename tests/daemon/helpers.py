"""Drive an engine in-process the way a worker would: claim, started, complete."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.abc

from stepd.actors.daemon import Daemon
from stepd.sansio.lease import LeaseRecord, Op

Body = Callable[[dict[str, Any]], Any]


def slot_record(run_id: str, fence: int, status: str = "running",
                state: Any = None) -> dict[str, Any]:
    """A run record with one slot ("s") at `fence`: the keys the listing's index and
    the lease guard read, and a state (for the store-level tests of run writes)."""
    return {"run_id": run_id, "workflow": "wf", "status": status, "version": "v1",
            "hash": "h", "idempotency_key": None, "created_at": 1, "updated_at": 2,
            "fences": {"s": fence}, "state": state}


def slot_lease(run_id: str, lease_id: str, fence: int, status: str = "offered"
               ) -> dict[str, Any]:
    """The lease record of slot "s" of `slot_record`'s run, at `fence`."""
    return dict(LeaseRecord(lease_id=lease_id, run_id=run_id, step_id="s", item_index=None,
                            fence=fence, attempt=1, worker_id="w_1", worker_name="w",
                            delivery="at_least_once", offered_at=1).to_dict(), status=status)


def seq_definition(name: str, n: int) -> dict[str, Any]:
    """PEERS.md's seq(n): n no-op steps, each adding its index to an accumulator."""
    return {
        "name": name,
        "steps": [{"id": f"s{i}", "kind": "task", "body": "add", "input": {"i": i, "acc": "${state.acc}" if i else 0}}
                  for i in range(n)],
    }


async def run_worker(engine: Daemon, worker_id: str, bodies: dict[str, Body], stop: anyio.Event, *,
                     max_claim: int = 8) -> int:
    """Claim and run bodies until `stop` is set; returns how many leases it completed."""
    done = 0
    while not stop.is_set():
        leases = await engine.claim(worker_id, max=max_claim, wait_ms=50)
        for lease in leases:
            await engine.lease_call(lease["lease_id"], Op.STARTED, {})
            fn = bodies[lease["body"]]
            try:
                out = fn(lease)
            except Exception as exc:  # a body failure is reported, as a worker would
                await engine.lease_call(lease["lease_id"], Op.FAIL,
                                        {"error_class": "fatal", "message": str(exc)})
                continue
            patch = None
            if isinstance(out, tuple):
                out, patch = out
            await engine.lease_call(lease["lease_id"], Op.COMPLETE, {"output": out, "state_patch": patch})
            done += 1
    return done


async def eventually(check: Callable[[], Any], *, timeout: float = 10.0, what: str = "") -> Any:
    """Poll `check` until it returns something truthy (bounded: fails after `timeout`).

    Used where a real thread (the storage writer) is involved, so "every task
    is blocked" does not mean "done".
    """
    with anyio.fail_after(timeout):
        while True:
            value = check()
            if value:
                return value
            await anyio.sleep(0.002)


def run_actor_alive(engine: Daemon, run_id: str) -> bool:
    try:
        return bool(engine.system.resolve(f"/runs/{run_id}").alive)
    except LookupError:
        return False


async def claim_one(engine: Daemon, worker_id: str, *, run_id: str | None = None,
                    timeout: float = 5.0) -> dict[str, Any]:
    with anyio.fail_after(timeout):
        while True:
            leases = await engine.claim(worker_id, max=1, wait_ms=100, run_id=run_id)
            if leases:
                return leases[0]


async def finish(engine: Daemon, lease: dict[str, Any], output: Any = None,
                 patch: dict[str, Any] | None = None) -> None:
    await engine.lease_call(lease["lease_id"], Op.STARTED, {})
    await engine.lease_call(lease["lease_id"], Op.COMPLETE, {"output": output, "state_patch": patch})


@asynccontextmanager
async def writer_held(engine: Daemon) -> AsyncIterator[anyio.abc.TaskGroup]:
    """Hold the storage writer thread for the block; yield a task group for work that writes.

    Every write submitted inside the block queues behind the held one and
    commits once the block is left, which puts a test in the gap between a
    write being made and it being on record (deferred offers, a run's next
    transition). The group's tasks are awaited on the way out.
    """
    holding, gate = threading.Event(), threading.Event()

    def held(txn: Any) -> None:
        holding.set()
        gate.wait(10)

    storage = engine.storage
    storage.commit_on_loop = False  # held on the loop, it would hold the loop itself
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(storage.write, held)
            await eventually(holding.is_set, what="the writer held")
            try:
                yield tg
            finally:
                gate.set()
    finally:
        storage.commit_on_loop = True
