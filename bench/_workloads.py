"""The workloads of `python -m bench` (PEERS.md A-D, durability; E timers, F leases).

Each workload is an async function of a `Setup` (bench._setups): the client,
the PIDs of the processes to watch, and the daemon's counters. They return one
dict, the JSON line's fields after ``engine``/``transport``/``workload``.
Any wrong or lost result raises `BenchFailure`.
"""

from __future__ import annotations

import inspect
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

import stepd
from bench._procs import RssSampler, SyncCounter, cpu_snapshot, rss_bytes, rss_detail_mb
from bench.sdk import pct, seq

if TYPE_CHECKING:
    from bench._setups import Setup

B_CONCURRENCY: int | None = None
"""The worker's concurrency for A-D: None is `stepd.Worker`'s own default, what a user gets
(``--worker-concurrency`` or ``--tuned`` set a number: 128 before issue 16)."""


def sdk_concurrency() -> int:
    """`stepd.Worker`'s default concurrency (what ``stepd.Worker(url)`` runs with)."""
    default = inspect.signature(stepd.Worker).parameters["concurrency"].default
    return int(default)

INFLIGHT = 100
"""At most this many start requests (then result waits) in flight in B, E and F."""


class BenchFailure(Exception):
    """A wrong or lost result, or a broken guarantee: the run fails (exit status 1)."""


# --------------------------------------------------------------------------- workflows


HOLD = stepd.Workflow("hold", version="bench.v1").then("hold", id="h", input="${input}")
"""F: one step whose body holds its lease for ``input["s"]`` seconds, heartbeating (SDK)."""


def workflows() -> list[stepd.Workflow]:
    return [seq(1), seq(3), seq(20), HOLD]


async def add(ctx: stepd.StepContext, input: dict[str, int]) -> int:
    return input["acc"] + input["i"]


async def hold(ctx: stepd.StepContext, input: dict[str, Any]) -> Any:
    # The worker heartbeats every heartbeat_ms (1 s in F) while this sleeps.
    await anyio.sleep(float(input["s"]))
    return input["v"]


def bodies() -> dict[str, Callable[..., Any]]:
    return {"add": add, "hold": hold}


def expected(n: int) -> int:
    return n * (n - 1) // 2


_SESSION = uuid.uuid4().hex[:12]
_counter = 0


def fresh_key(tag: str) -> str:
    """A fresh idempotency key per workflow started (the run id is the daemon's, also fresh)."""
    global _counter
    _counter += 1
    return f"bench-{_SESSION}-{tag}-{_counter}"


async def run_seq(s: Setup, n: int) -> float:
    """Start seq(n), wait for its result, check it; seconds from start request to result."""
    wf = SEQ[n]
    t = time.perf_counter()
    run = await s.client.start(wf, idempotency_key=fresh_key(f"seq{n}"))
    result = await run.result(timeout=120)
    took = time.perf_counter() - t
    if result != expected(n):
        raise BenchFailure(f"{s.transport}: run {run.run_id} of seq({n}) returned {result!r}, "
                           f"not {expected(n)}")
    return took


SEQ = {1: seq(1), 3: seq(3), 20: seq(20)}


async def warm_up(s: Setup) -> None:
    """PEERS.md: 3 one-step and 2 twenty-step workflows, not counted."""
    for _ in range(3):
        await run_seq(s, 1)
    for _ in range(2):
        await run_seq(s, 20)


def ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


# --------------------------------------------------------------------------- A


async def workload_a(s: Setup, runs: int = 20, one_step_runs: int = 20) -> dict[str, Any]:
    cpu0 = cpu_snapshot(s.pids)
    walls = [await run_seq(s, 20) for _ in range(runs)]
    cpu1 = cpu_snapshot(s.pids)
    per_step = [w / 20 for w in walls]
    e2e = [await run_seq(s, 1) for _ in range(one_step_runs)]
    return {
        "per_step_ms_median": ms(statistics.median(per_step)),
        "per_step_ms_p95": ms(pct(per_step, 0.95)),
        "wf1_e2e_ms_median": ms(statistics.median(e2e)),
        "wf1_e2e_ms_p95": ms(pct(e2e, 0.95)),
        "runs": runs, "steps_per_wf": 20, "wf1_runs": one_step_runs,
        # CPU per step of each process over the seq(20) runs: the work, which moves far less
        # with the machine's load than the wall time does.
        "cpu_ms_per_step": {k: round((cpu1[k] - cpu0[k]) / (runs * 20) * 1000, 3)
                            for k in s.pids},
    }


# --------------------------------------------------------------------------- B + D


async def gather_limited(items: list[Any], fn: Callable[[Any], Awaitable[Any]],
                         limit: int) -> list[Any]:
    """fn(item) for every item, at most `limit` at once; results in item order."""
    out: list[Any] = [None] * len(items)
    sem = anyio.Semaphore(limit)

    async def one(i: int, item: Any) -> None:
        try:
            out[i] = await fn(item)
        finally:
            sem.release()

    async with anyio.create_task_group() as tg:
        for i, item in enumerate(items):
            await sem.acquire()
            tg.start_soon(one, i, item)
    return out


async def workload_b(s: Setup, workflows_n: int = 1000, steps: int = 3
                     ) -> tuple[dict[str, Any], dict[str, Any]]:
    """B (throughput) and D (peak RSS during B, sampled every 50 ms)."""
    wf = SEQ[steps]
    want = expected(steps)

    async def start(_: int) -> Any:
        return await s.client.start(wf, idempotency_key=fresh_key("b"))

    async def wait(run: Any) -> Any:
        result = await run.result(timeout=300)
        if result != want:
            raise BenchFailure(f"{s.transport}: B run {run.run_id} returned {result!r}, not {want}")
        return result

    with RssSampler(s.pids, 0.05) as rss:
        cpu0 = cpu_snapshot(s.pids)
        t0 = time.perf_counter()
        runs = await gather_limited(list(range(workflows_n)), start, INFLIGHT)
        t_started = time.perf_counter()
        await gather_limited(runs, wait, INFLIGHT)
        t1 = time.perf_counter()
        cpu1 = cpu_snapshot(s.pids)
    if len({r.run_id for r in runs}) != workflows_n:
        raise BenchFailure(f"{s.transport}: B started {len({r.run_id for r in runs})} distinct runs, "
                           f"not {workflows_n}")
    total = t1 - t0
    b = {
        "workflows": workflows_n, "steps_per_wf": steps,
        "total_s": round(total, 3),
        "wf_per_s": round(workflows_n / total, 1),
        "steps_per_s": round(workflows_n * steps / total, 1),
        "cpu_s": {k: round(cpu1[k] - cpu0[k], 2) for k in s.pids},
        "cpu_pct_of_wall": {k: round((cpu1[k] - cpu0[k]) / total * 100, 1) for k in s.pids},
        "start_phase_s": round(t_started - t0, 3),
        "worker_concurrency": s.worker_concurrency, "max_in_flight": INFLIGHT,
    }
    d = {"peak_rss_mb": rss.peak_mb(), "samples": rss.samples, "interval_ms": 50, "during": "B",
         "rss_detail_mb_after": {k: rss_detail_mb(pid) for k, pid in s.pids.items()}}
    return b, d


# --------------------------------------------------------------------------- C


async def workload_c(s: Setup, settle_s: float = 5.0, window_s: float = 30.0) -> dict[str, Any]:
    roles = {k: v for k, v in s.pids.items() if k != "client"}
    await anyio.sleep(settle_s)
    cpu0 = cpu_snapshot(roles)
    t0 = time.perf_counter()
    await anyio.sleep(window_s)
    cpu1 = cpu_snapshot(roles)
    dt = time.perf_counter() - t0
    return {
        "seconds": round(dt, 1), "settle_s": settle_s,
        "cpu_pct": {k: round((cpu1[k] - cpu0[k]) / dt * 100, 3) for k in roles},
        "resolution_cpu_s": 0.01,
    }


# --------------------------------------------------------------------------- durability


async def workload_durability(s: Setup, runs: int, log_dir: Path) -> dict[str, Any]:
    """fsync-family calls of the daemon (strace) during `runs` 1-step then `runs` 20-step workflows."""
    why = SyncCounter.available()
    if why is not None:
        return {"error": why}
    phases: dict[int, dict[str, Any]] = {}
    for n in (1, 20):
        counter = SyncCounter(s.daemon_pid, log_dir / f"strace-{s.transport}-{n}.txt")
        try:
            await anyio.to_thread.run_sync(counter.start)
        except RuntimeError as exc:
            return {"error": f"strace: {exc}"}
        try:
            await anyio.sleep(0.2)
            c0 = await s.commits()
            t0 = time.perf_counter()
            for _ in range(runs):
                await run_seq(s, n)
            wall = time.perf_counter() - t0
            await anyio.sleep(0.2)
            c1 = await s.commits()
        finally:
            calls = await anyio.to_thread.run_sync(counter.stop)
        phases[n] = {"sync_calls": sum(calls.values()), "by_syscall": {k: v for k, v in calls.items() if v},
                     "storage_commits": c1 - c0, "wall_s": round(wall, 2)}
    extra = runs * 19
    sync_per_extra = (phases[20]["sync_calls"] - phases[1]["sync_calls"]) / extra
    commits_per_extra = (phases[20]["storage_commits"] - phases[1]["storage_commits"]) / extra
    # Every acknowledged batch is one commit; every commit must be synced.
    ok = all(p["sync_calls"] >= p["storage_commits"] > 0 for p in phases.values())
    return {
        "sync_per_extra_step": round(sync_per_extra, 3),
        "commits_per_extra_step": round(commits_per_extra, 3),
        "runs_per_phase": runs,
        "phase_1step": phases[1], "phase_20step": phases[20],
        "syncs_per_commit": round((phases[1]["sync_calls"] + phases[20]["sync_calls"])
                                  / max(1, phases[1]["storage_commits"] + phases[20]["storage_commits"]), 3),
        "every_commit_synced": ok,
        "commit_counter": s.commit_counter_name,
    }


# --------------------------------------------------------------------------- E


@dataclass
class _Versions:
    """E's sleep definitions: a new version every `period` s, sleeping until `wake_at`.

    A definition's sleep is a fixed duration, so to make every run's sleep end
    at one known moment the bench registers a new version of the one-step
    sleep workflow every `period` seconds while it starts runs, each sleeping
    ``wake_at - now``: a run's sleep then ends between `wake_at` and `wake_at`
    plus `period` plus its start's latency.
    """

    s: Setup
    wake_at_ms: int
    period: float
    prefix: str = "e"
    worker_id: str | None = None
    current: str | None = None
    since: float = 0.0
    registered: int = 0
    durations_ms: list[int] = field(default_factory=list)

    lock: anyio.Lock = field(default_factory=anyio.Lock)

    async def version(self) -> str:
        """The version to start now: registers a new one when the current one is `period` old.

        One registration at a time: while one is in flight, callers keep the current version.
        """
        stale = self.current is None or time.perf_counter() - self.since >= self.period
        if not stale or (self.lock.locked() and self.current is not None):
            return self.current  # type: ignore[return-value]
        async with self.lock:
            if self.current is not None and time.perf_counter() - self.since < self.period:
                return self.current
            duration = max(0, self.wake_at_ms - int(time.time() * 1000))
            name = f"{self.prefix}{self.registered}"
            wf = stepd.Workflow("sleeper", version=name).sleep(duration, id="z")
            self.worker_id = await self.s.register_definitions([wf.to_json()], self.worker_id)
            self.current, self.since = name, time.perf_counter()
            self.registered += 1
            self.durations_ms.append(duration)
        return self.current


async def workload_e(s: Setup, runs: int, margin_s: float = 2.0, probe: int = 500) -> dict[str, Any]:
    """E: `runs` one-step workflows asleep in a durable timer, then woken at one moment."""
    rss0 = rss_bytes(s.daemon_pid)
    detail0 = rss_detail_mb(s.daemon_pid)
    done0 = await s.count("completed")
    # Probe the start rate (`probe` starts of a 0 ms sleep; they complete at once, not counted).
    probe_versions = _Versions(s, 0, 3600, prefix="probe")
    t = time.perf_counter()

    async def start_probe(_: int) -> Any:
        return await s.start_raw("sleeper", await probe_versions.version(), None,
                                 fresh_key("e-probe"))

    await gather_limited(list(range(probe)), start_probe, INFLIGHT)
    rate = probe / (time.perf_counter() - t)
    while await s.count("completed") < done0 + probe:
        await anyio.sleep(0.05)
    done0 += probe
    # The moment every sleep ends: the start phase at 95 % of the probed rate (the probe,
    # on a cold daemon, is the slower), plus `margin_s` (to measure the sleeping runs' RSS).
    wake_at = time.time() + runs / (rate * 0.95) + margin_s
    versions = _Versions(s, int(wake_at * 1000), 0.05, worker_id=probe_versions.worker_id)
    late = 0

    async def start(_: int) -> Any:
        nonlocal late
        run_id = await s.start_raw("sleeper", await versions.version(), None, fresh_key("e"))
        if time.time() >= wake_at:
            late += 1
        return run_id

    t0 = time.perf_counter()
    ids = await gather_limited(list(range(runs)), start, INFLIGHT)
    start_s = time.perf_counter() - t0
    if len(set(ids)) != runs:
        raise BenchFailure(f"{s.transport}: E started {len(set(ids))} distinct runs, not {runs}")
    del ids
    asleep_at = time.time()
    await anyio.sleep(min(1.0, max(0.0, wake_at - time.time() - 0.5)))
    active_actors = await s.active_run_actors()
    rss_asleep = rss_bytes(s.daemon_pid)
    detail_asleep = rss_detail_mb(s.daemon_pid)
    early = await s.count("completed") - done0
    # Wake: from wake_at until every run has completed (the sleep is its only step).
    await anyio.sleep(max(0.0, wake_at - time.time()))
    cpu0 = cpu_snapshot({"daemon": s.daemon_pid})
    first = None
    peak = rss_asleep
    while True:
        done = await s.count("completed") - done0
        now = time.time()
        peak = max(peak, rss_bytes(s.daemon_pid))
        if first is None and done > 0:
            first = now - wake_at
        if done >= runs:
            break
        if now - wake_at > 600:
            raise BenchFailure(f"{s.transport}: E: only {done} of {runs} sleepers woke in 600 s")
        await anyio.sleep(0.05)
    woke_all = now - wake_at
    cpu1 = cpu_snapshot({"daemon": s.daemon_pid})
    detail_after = rss_detail_mb(s.daemon_pid)
    return {
        "runs": runs,
        "start_s": round(start_s, 2), "starts_per_s": round(runs / start_s, 1),
        "daemon_rss_mb_before": round(rss0 / 2**20, 1),
        "daemon_rss_mb_asleep": round(rss_asleep / 2**20, 1),
        "rss_bytes_per_sleeping_run": round((rss_asleep - rss0) / runs),
        "daemon_rss_detail_mb_before": detail0,
        "daemon_rss_detail_mb_asleep": detail_asleep,
        "daemon_rss_detail_mb_after_wake": detail_after,
        "active_run_actors_asleep": active_actors,
        "completed_before_wake": early,
        "wake_first_s": round(first, 3) if first is not None else None,
        "wake_all_s": round(woke_all, 3),
        "wakes_per_s": round(runs / woke_all, 1) if woke_all > 0 else None,
        "daemon_cpu_s_during_wake": round(cpu1["daemon"] - cpu0["daemon"], 2),
        "daemon_peak_rss_mb_during_wake": round(peak / 2**20, 1),
        "sleep_versions": versions.registered, "version_period_s": versions.period,
        "late_starts": late,
        "idle_before_wake_s": round(wake_at - asleep_at, 2),
        "probe_starts_per_s": round(rate, 1),
    }


# --------------------------------------------------------------------------- F


ORPHAN_EVENTS = ("step_orphaned", "step_recovered", "step_revived", "lease_lost")


async def workload_f(s: Setup, leases: int, hold_s: float, concurrent: bool = False) -> dict[str, Any]:
    """F: `leases` bodies holding their lease `hold_s` s, heartbeating every second.

    Not a failure of the run when leases expire (that is F's figure); a wrong
    result is (BenchFailure).
    """

    async def start(i: int) -> Any:
        return await s.client.start(HOLD, {"s": hold_s, "v": i}, idempotency_key=fresh_key("f"))

    t_first = time.perf_counter()
    runs = await gather_limited(list(range(leases)), start, INFLIGHT)
    started_s = time.perf_counter() - t_first
    # Wait until every lease is live (at most a quarter of the hold).
    deadline = t_first + hold_s / 4
    max_live = 0
    while (live := await s.live_leases()) < leases and time.perf_counter() < deadline:
        max_live = max(max_live, live)
        await anyio.sleep(0.05)
    max_live = max(max_live, live)
    all_live = time.perf_counter()
    # CPU while the leases are held: until the first body could end.
    window_end = t_first + hold_s - 0.5
    roles = {k: v for k, v in s.pids.items() if k != "client"}
    cpu0 = cpu_snapshot(roles)
    w0 = time.perf_counter()
    min_live = leases
    with RssSampler({"daemon": s.daemon_pid}, 0.25) as rss:
        while time.perf_counter() < window_end:
            await anyio.sleep(min(0.5, max(0.0, window_end - time.perf_counter())))
            min_live = min(min_live, await s.live_leases())
    window = time.perf_counter() - w0
    cpu1 = cpu_snapshot(roles)
    unfinished = 0

    async def wait(pair: tuple[int, Any]) -> None:
        nonlocal unfinished
        i, run = pair
        left = t_first + hold_s + 30 - time.perf_counter()
        try:
            result = await run.result(timeout=max(1.0, left))
        except TimeoutError:
            unfinished += 1
            return
        if result != i:
            raise BenchFailure(f"{s.transport}: F run {run.run_id} returned {result!r}, not {i}")

    await gather_limited(list(enumerate(runs)), wait, INFLIGHT)

    async def orphans(run: Any) -> dict[str, int]:
        found: dict[str, int] = {}
        for event in await run.journal():
            if event.get("type") in ORPHAN_EVENTS:
                found[event["type"]] = found.get(event["type"], 0) + 1
        return found

    counts: dict[str, int] = dict.fromkeys(ORPHAN_EVENTS, 0)
    for found in await gather_limited(runs, orphans, INFLIGHT):
        for k, v in found.items():
            counts[k] += v
    cpu = {k: round((cpu1[k] - cpu0[k]) / window * 100, 2) for k in roles} if window > 0 else {}
    workers = [k for k in cpu if k.startswith("worker")]
    if len(workers) > 1:
        cpu["workers_total"] = round(sum(cpu[k] for k in workers), 2)
    return {
        "leases": leases, "hold_s": hold_s, "lease_ttl_ms": 3000, "heartbeat_ms": 1000,
        "alongside_other_transports": concurrent,
        "worker_processes": max(1, len(workers)),
        "all_live": max_live >= leases, "max_live_before_window": max_live,
        "ramp_s": round(all_live - t_first, 2), "start_phase_s": round(started_s, 2),
        "window_s": round(window, 1),
        "min_live_leases_in_window": min_live,
        "cpu_pct": cpu,
        "daemon_peak_rss_mb": rss.peak_mb()["daemon"],
        "spurious_expiries": counts["step_orphaned"],
        "journal_events": counts,
        "unfinished_after_hold_plus_30s": unfinished,
        "ok": counts["step_orphaned"] == 0 and not any(counts.values()) and unfinished == 0
              and max_live >= leases,
    }
