"""Workload G: what sticky execution saves (docs/affinity.md "Sticky execution").

A 50-step workflow whose state grows by 2 KB per step, run with the worker's
sticky cache off, then on, each on a fresh ``stepd serve`` (over the WebSocket
or HTTP long-poll). Per mode it measures:

* ``lease_bytes_mean`` / ``lease_bytes_max``: the lease as the worker receives
  it, encoded as the transport carries it (msgpack on the WebSocket, JSON over
  HTTP), before the SDK rebuilds the history from its cache;
* ``daemon_cpu_ms_per_step``: the ``stepd serve`` process's CPU (utime + stime)
  over the runs, per step;
* ``wall_ms_per_step``;
* the worker's cache counts (on).

and checks that every run's result and final state are identical in both modes
(``results_identical``; a difference fails the bench). The worker runs in the
bench process (a `stepd.Worker` whose ``accept`` meters each lease), so the
daemon's CPU is its own. Not over ``embedded``: there the daemon's CPU cannot be
told apart from the worker's.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import anyio
import msgpack

import stepd
from bench._procs import cpu_seconds, start_daemon

STATE_BYTES = 2048


def grow(ctx: stepd.StepContext, input: Any, steps: dict[str, Any]) -> dict[str, Any]:
    """Adds 2 KB of state; returns what it saw, so a wrong history changes the result."""
    ctx.patch_state(**{f"k{ctx.step_id}": ctx.step_id[-1] * STATE_BYTES})
    return {"i": len(steps), "state_keys": len(ctx.state), "input": input}


def workflow(steps: int) -> stepd.Workflow:
    wf = stepd.Workflow("grow", version="bench.g")
    for i in range(steps):
        wf = wf.then(grow, id=f"s{i:02d}")
    return wf


class MeteredWorker(stepd.Worker):
    """A worker that counts the encoded size of each lease it receives."""

    def __init__(self, *args: Any, encode: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._encode = encode
        self.lease_sizes: list[int] = []

    def accept(self, lease: dict[str, Any]) -> None:
        self.lease_sizes.append(len(self._encode(lease)))
        super().accept(lease)


async def _mode(transport: str, sticky: bool, tmp: Path, runs: int, steps: int
                ) -> tuple[dict[str, Any], list[Any]]:
    data = tmp / f"G-{transport}-{'on' if sticky else 'off'}"
    data.parent.mkdir(parents=True, exist_ok=True)
    daemon, url = await anyio.to_thread.run_sync(
        lambda: start_daemon(data, tmp, [], name=f"daemon-G-{transport}"))
    encode = msgpack.packb if transport == "websocket" \
        else (lambda lease: json.dumps(lease, separators=(",", ":")).encode())
    results: list[Any] = []
    try:
        worker = MeteredWorker(url, concurrency=1, build_id="bench-g", transport=transport,
                               encode=encode, sticky_cache_capacity=64 if sticky else 0)
        worker.register(workflow(steps))
        async with stepd.AsyncClient(url, trust_env=False, timeout=60) as client, \
                anyio.create_task_group() as tg:
            await tg.start(worker.run)
            # Warm-up: one run, not measured.
            run = await client.start("grow", {"warm": True})
            await client.result(run, timeout=120)
            worker.lease_sizes.clear()
            cpu0, t0 = cpu_seconds(daemon.pid), time.perf_counter()
            for i in range(runs):
                run = await client.start("grow", {"run": i})
                result = await client.result(run, timeout=120)
                status = await client.status(run)
                results.append((result, status.state))
            wall = time.perf_counter() - t0
            cpu = cpu_seconds(daemon.pid) - cpu0
            worker.stop()
        sizes = worker.lease_sizes
        n = runs * steps
        fields: dict[str, Any] = {
            "sticky": sticky, "runs": runs, "steps": steps, "leases": len(sizes),
            "lease_bytes_mean": round(sum(sizes) / len(sizes)),
            "lease_bytes_max": max(sizes),
            "daemon_cpu_ms_per_step": round(cpu * 1000 / n, 3),
            "wall_ms_per_step": round(wall * 1000 / n, 3),
        }
        if worker.sticky_cache is not None:
            fields["cache"] = worker.sticky_cache.stats.as_dict()
        return fields, results
    finally:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(daemon.stop)


async def workload_g(transport: str, tmp: Path, runs: int = 10, steps: int = 50,
                     rounds: int = 2) -> dict[str, Any]:
    """Sticky off and on, taking turns `rounds` times (each on a fresh daemon, so that a
    machine busy at one moment does not favour one mode); the medians of the figures,
    each round's, and whether every result is identical."""
    per: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    results: dict[str, list[Any]] = {"off": [], "on": []}
    for i in range(rounds):
        for mode in (("off", "on") if i % 2 == 0 else ("on", "off")):
            fields, got = await _mode(transport, mode == "on", tmp / f"r{i}", runs, steps)
            per[mode].append(fields)
            results[mode].append(got)
    out: dict[str, Any] = {"rounds": rounds}
    for mode, rows in per.items():
        med = {k: statistics.median(r[k] for r in rows)
               for k in ("lease_bytes_mean", "lease_bytes_max", "daemon_cpu_ms_per_step",
                         "wall_ms_per_step")}
        out[mode] = {**rows[-1], **med, "per_round": [
            {k: r[k] for k in ("daemon_cpu_ms_per_step", "wall_ms_per_step")} for r in rows]}
    off, on = out["off"], out["on"]
    out["lease_bytes_ratio"] = round(on["lease_bytes_mean"] / off["lease_bytes_mean"], 4)
    out["daemon_cpu_ratio"] = round(on["daemon_cpu_ms_per_step"]
                                    / max(off["daemon_cpu_ms_per_step"], 1e-9), 3)
    out["results_identical"] = all(r == results["off"][0]
                                   for r in results["off"] + results["on"])
    return out
