"""Close the engine in the middle of 100 concurrent runs, reopen it, finish them.

The results must be exactly those of an uninterrupted execution: nothing
acknowledged is lost, nothing is applied twice. Leases that were out when the
engine closed expire under the virtual clock and their attempts are retried.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio

from stepd.actors import ManualClock
from stepd.actors.daemon import Daemon, DaemonConfig
from stepd.sansio.errors import Conflict
from stepd.sansio.lease import Op

N = 100
MIXED = {
    "name": "mixed",
    "steps": [
        {"id": "double", "kind": "task", "body": "double", "input": "${input}"},
        {"id": "nap", "kind": "sleep", "duration_ms": 1000},
        {"id": "fan", "kind": "for_each", "items": "${steps.double.parts}", "body": "square",
         "into": "squares", "max_parallel": 2},
        {"id": "sum", "kind": "task", "body": "sum", "input": "${state.squares}"},
    ],
}


def body(lease: dict[str, Any]) -> Any:
    x = lease["input"]
    if lease["body"] == "double":
        return {"parts": [x, x + 1, x + 2]}
    if lease["body"] == "square":
        return x * x
    return sum(x)


def expected(i: int) -> int:
    return i * i + (i + 1) ** 2 + (i + 2) ** 2


async def drive(engine: Daemon, clock: ManualClock, worker_id: str, until: Any,
                done: list[int] | None = None) -> None:
    """Work as a worker would; move virtual time only when there is nothing to do.

    Work takes no virtual time, so leases never expire under a busy worker;
    idle turns advance the clock so sleeps end and stranded leases expire.
    """
    done = done if done is not None else [0]
    try:
        with anyio.fail_after(60):
            while not until():
                leases = await engine.claim(worker_id, max=16)
                if not leases:
                    clock.advance(0.5)
                    await anyio.sleep(0.002)
                    continue
                for lease in leases:
                    try:
                        await engine.lease_call(lease["lease_id"], Op.STARTED, {})
                        await engine.lease_call(lease["lease_id"], Op.COMPLETE, {"output": body(lease)})
                    except Conflict:
                        continue  # a worker told any of the four abandons the lease
                    done[0] += 1
    except TimeoutError:
        stuck = [r for r in engine.list_runs(limit=1000)[0] if r["status"] != "completed"]
        raise AssertionError(
            f"{len(stuck)} runs not completed, e.g. {stuck[:1]}: "
            f"{engine.journal(stuck[0]['run_id'])[-4:] if stuck else ''}"
        ) from None


async def test_reopen_mid_flight_finishes_every_run_with_the_same_results(tmp_path: Path) -> None:
    clock = ManualClock(wall_ms=1_700_000_000_000)
    config = DaemonConfig(lease_ttl_ms=2_000, heartbeat_ms=500, recovery_window_ms=1_000)
    path = str(tmp_path / "data")
    async with Daemon.open(path, clock=clock, config=config) as engine:
        reg = await engine.register_worker(name="w1", definitions=[MIXED])
        ids = [(await engine.start_run("mixed", i, idempotency_key=f"k{i}"))[0] for i in range(N)]
        # About half the work (500 steps in all), then stop.
        done = [0]
        await drive(engine, clock, reg["worker_id"], lambda: done[0] >= N * 2 + N // 2, done)
        # Leases claimed but never completed: held by nobody after the close.
        leftover = await engine.claim(reg["worker_id"], max=5)  # held by nobody after the close
        assert len(leftover) <= 5

    async with Daemon.open(path, clock=clock, config=config) as engine:
        # The same keys give back the same runs: nothing was created twice.
        again = [(await engine.start_run("mixed", i, idempotency_key=f"k{i}")) for i in range(N)]
        assert [r for r, _ in again] == ids and not any(created for _, created in again)
        reg = await engine.register_worker(name="w2", definitions=[MIXED])

        def all_done() -> bool:
            return all(engine.status(r)["status"] in ("completed", "failed") for r in ids)

        await drive(engine, clock, reg["worker_id"], all_done)
        views = [engine.status(r) for r in ids]
        assert [v["status"] for v in views] == ["completed"] * N
        assert [v["result"] for v in views] == [expected(i) for i in range(N)]
        for r in ids:
            journal = engine.journal(r)
            completed = [(e["step_id"], e.get("item_index")) for e in journal if e["type"] == "step_completed"
                         and "fence" in e]
            assert len(completed) == len(set(completed)), f"{r}: a slot completed twice"
            assert [e["seq"] for e in journal] == list(range(1, len(journal) + 1))
        print(f"\n{N} runs finished across a reopen; {len(leftover)} stranded leases recovered")


async def test_the_same_workload_uninterrupted_gives_the_same_results(tmp_path: Path) -> None:
    clock = ManualClock(wall_ms=1_700_000_000_000)
    async with Daemon.open(str(tmp_path / "data"), clock=clock) as engine:
        reg = await engine.register_worker(name="w", definitions=[MIXED])
        ids = [(await engine.start_run("mixed", i))[0] for i in range(N)]
        await drive(engine, clock, reg["worker_id"],
                    lambda: all(engine.status(r)["status"] == "completed" for r in ids))
        assert [engine.status(r)["result"] for r in ids] == [expected(i) for i in range(N)]
