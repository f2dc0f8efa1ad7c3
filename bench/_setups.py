"""The three ways `python -m bench` runs stepd, behind one `Setup`, as a user writes them.

* ``embedded``: ``async with stepd.embedded(dir)`` in this process, on this
  process's event loop (``asyncio.run``'s unless ``--client-loop uvloop``), with
  ``stepd.Worker(client)`` and a `stepd.AsyncClient` on the same loop: one process.
* ``websocket`` / ``http``: ``python -m stepd serve`` (a subprocess, free
  loopback port, its defaults), a worker subprocess (``python -m bench._worker``:
  ``stepd.Worker(url)``, its transport forced, ``serve()``), and this process as
  the client (`stepd.AsyncClient`, HTTP/1.1 keep-alive).

The worker's concurrency is the SDK's default unless the bench is given one
(``--worker-concurrency``, ``--tuned``): issue 16 asks for the figures a user
gets without knobs.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import httpx

import stepd
from bench import _otlp
from bench._http import LeanHttp
from bench._procs import start_daemon, start_workers
from bench._workloads import B_CONCURRENCY, bodies, sdk_concurrency, workflows
from stepd import _wire


@dataclass
class Setup:
    transport: str
    client: stepd.AsyncClient
    pids: dict[str, int]
    """role -> PID for CPU and RSS: daemon, worker, client; or process (embedded)."""
    daemon_pid: int
    commits: Callable[[], Awaitable[int]]
    """The storage's commit counter (synced commits so far)."""
    commit_counter_name: str
    count: Callable[[str], Awaitable[int]]
    """Runs of a status (the daemon's counters, as ``stepd_runs`` reports them)."""
    live_leases: Callable[[], Awaitable[int]]
    active_run_actors: Callable[[], Awaitable[int]]
    register_definitions: Callable[[list[dict[str, Any]], str | None], Awaitable[str]]
    """Register definitions (as a worker that never takes work); returns the worker id."""
    start_raw: Callable[[str, str | None, Any, str], Awaitable[str]]
    """start(workflow, version, input, idempotency_key) -> run id, by the cheapest path
    (E's population: in process, or `bench._http.LeanHttp` rather than httpx)."""
    export_stats: Callable[[], Awaitable[dict[str, int]]]
    """The daemon's span export counts (``stepd_otel_export``), {} when export is off."""
    worker_concurrency: int = 0
    """The concurrency the worker(s) run with (the SDK's default unless a number was given)."""


def _runs_actors(tree: dict[str, Any]) -> int:
    for child in tree.get("children") or ():
        if child.get("path") == "/runs":
            return len(child.get("children") or ())
    return -1


async def _register(client: stepd.AsyncClient, defs: list[dict[str, Any]], worker_id: str | None) -> str:
    body: dict[str, Any] = {"name": "bench-definitions", "protocol_version": "1.0",
                            "concurrency": 1, "definitions": defs}
    if worker_id is not None:
        body["worker_id"] = worker_id
    answer = await client._backend.send(_wire.register(body))
    return str(answer["worker_id"])


@asynccontextmanager
async def embedded(data: Path, *, concurrency: int | None = B_CONCURRENCY, worker: bool = True,
                   **options: Any) -> AsyncIterator[Setup]:
    async with stepd.embedded(data, **options) as daemon:
        client = stepd.AsyncClient(daemon)
        core = daemon.daemon

        async def commits() -> int:
            return int(core.storage.statistics().commits)

        async def count(status: str) -> int:
            return int(core.stats.status_counts.get(status, 0))

        async def live_leases() -> int:
            return core.live_leases()

        async def active_run_actors() -> int:
            return _runs_actors(core.actors())

        async def register(defs: list[dict[str, Any]], worker_id: str | None) -> str:
            return await _register(client, defs, worker_id)

        async def start_raw(workflow: str, version: str | None, input: Any, key: str) -> str:
            return (await client.start(workflow, input, version=version, idempotency_key=key)).run_id

        async def export_stats() -> dict[str, int]:
            trace = core.services.trace
            return {} if trace is None else dataclasses.asdict(trace.statistics())

        pid = os.getpid()
        pids = {"process": pid}
        child = _otlp.export_child(pid)
        if child is not None:
            pids["otel_export"] = child
        setup = Setup("embedded", client, pids, pid, commits,
                      "storage.statistics().commits", count, live_leases, active_run_actors,
                      register, start_raw, export_stats,
                      sdk_concurrency() if concurrency is None else concurrency)
        async with anyio.create_task_group() as tg:
            w = None
            if worker:
                # As a user writes it: stepd.Worker(client), its concurrency the SDK's default
                # unless the bench was told a number.
                knobs = {} if concurrency is None else {"concurrency": concurrency}
                w = stepd.Worker(client, name="bench-embedded", **knobs)
                w.register(*workflows(), bodies=bodies())
                await tg.start(w.run)
                if w.transport != "inprocess":
                    raise SystemExit(f"bench: the embedded worker runs over {w.transport}")
            try:
                yield setup
            finally:
                if w is not None:
                    w.stop()
        await client.aclose()


_METRIC = re.compile(r"^(\w+)(\{[^}]*\})?\s+(\S+)$", re.MULTILINE)


@asynccontextmanager
async def network(transport: str, data: Path, log_dir: Path, *,
                  concurrency: int | None = B_CONCURRENCY,
                  workers: int = 1, daemon_args: list[str] = (),  # type: ignore[assignment]
                  tag: str = "") -> AsyncIterator[Setup]:
    daemon, url = await anyio.to_thread.run_sync(
        lambda: start_daemon(data, log_dir, list(daemon_args), name=f"daemon-{transport}{tag}"))
    worker_children: list[Any] = []
    client = None
    metrics_http = None
    lean = None
    try:
        if workers:
            names = [f"worker-{transport}{tag}" + (f"-{i + 1}" if workers > 1 else "")
                     for i in range(workers)]
            worker_children = await anyio.to_thread.run_sync(
                lambda: start_workers(url, transport, concurrency, log_dir, names))
        client = stepd.AsyncClient(url, trust_env=False, timeout=60)
        metrics_http = httpx.AsyncClient(base_url=url, trust_env=False, timeout=60)
        lean = LeanHttp(url, 32)

        async def metrics() -> dict[str, float]:
            answer = await metrics_http.get("/metrics")
            answer.raise_for_status()
            return {m.group(1) + (m.group(2) or ""): float(m.group(3))
                    for m in _METRIC.finditer(answer.text)}

        async def commits() -> int:
            return int((await metrics()).get("stepd_commit_batch_size_count", 0))

        async def count(status: str) -> int:
            return int((await metrics()).get(f'stepd_runs{{status="{status}"}}', 0))

        async def live_leases() -> int:
            return int((await metrics()).get("stepd_live_leases", 0))

        async def active_run_actors() -> int:
            return _runs_actors(await client.actors())

        async def register(defs: list[dict[str, Any]], worker_id: str | None) -> str:
            return await _register(client, defs, worker_id)

        async def start_raw(workflow: str, version: str | None, input: Any, key: str) -> str:
            body = {"workflow": workflow, "input": input, "idempotency_key": key}
            if version is not None:
                body["version"] = version
            return str((await lean.request("POST", "/v1/api/runs", body))["run_id"])

        async def export_stats() -> dict[str, int]:
            prefix = 'stepd_otel_export{what="'
            return {k[len(prefix):-2]: int(v) for k, v in (await metrics()).items()
                    if k.startswith(prefix)}

        pids = {"daemon": daemon.pid}
        for i, child in enumerate(worker_children):
            pids["worker" + (f"-{i + 1}" if workers > 1 else "")] = child.pid
        pids["client"] = os.getpid()
        child = _otlp.export_child(daemon.pid)
        if child is not None:
            pids["otel_export"] = child
        yield Setup(transport, client, pids, daemon.pid, commits,
                    "GET /metrics stepd_commit_batch_size_count", count, live_leases,
                    active_run_actors, register, start_raw, export_stats,
                    sdk_concurrency() if concurrency is None else concurrency)
        for child in (*worker_children, daemon):
            if not child.alive():
                raise SystemExit(f"bench: {child.name} (pid {child.pid}) died during the run:\n"
                                 f"{child.stderr_tail()}")
    finally:
        if client is not None:
            await client.aclose()
        if metrics_http is not None:
            await metrics_http.aclose()
        if lean is not None:
            await lean.aclose()
        with anyio.CancelScope(shield=True):
            for child in (*worker_children, daemon):
                await anyio.to_thread.run_sync(child.stop)
