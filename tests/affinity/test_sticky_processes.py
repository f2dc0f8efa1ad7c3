"""Sticky execution across real processes (AFFINITY.md "Sticky execution"; docs/affinity.md).

A real ``stepd serve`` process and real worker processes (`_sticky_worker`),
over the WebSocket and over HTTP long-poll: sticky hits, eviction by capacity,
a replacement process taking over a worker id, a build mismatch, the holder
lost, a corrupted cache entry. Each checks the counts the workers API (and
``/metrics``) shows and that the run's result is exactly what it is with the
cache off.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import httpx
import pytest

import stepd
from tests.sdk.conftest import eventually, unique
from tests.transport.conftest import DaemonProcess

from ._sticky_procs import StickyProcess, sticky_of
from ._sticky_worker import workflows

pytestmark = [pytest.mark.timeout(120), pytest.mark.parametrize("transport", ["websocket", "http"])]


def counts(client: stepd.Client, worker_id: str) -> dict[str, int]:
    s = sticky_of(client, worker_id)
    assert s is not None
    return {k: s[k] for k in ("hit", "miss", "eviction", "forced_cold_replay")}


def waiting(client: stepd.Client, run: Any) -> bool:
    return client.status(run).status == "waiting"


def finish(client: stepd.Client, run: Any, payload: Any = "go!") -> Any:
    eventually(lambda: waiting(client, run), what="the run to wait for its signal")
    client.signal(run, "go", payload)
    return client.result(run, timeout=60)


@pytest.fixture(scope="module")
def references() -> dict[tuple[str, str], tuple[Any, Any]]:
    """`reference`'s answers, kept for the module: (transport, kind) -> (result, state).

    What a run of ``<prefix>-<kind>`` returns with the cache off does not depend on the
    prefix (`_sticky_worker.grow` reports step ids and state keys, never the workflow's
    name), so one cache-off run per transport and kind serves every test; each test
    still runs its own prefix's workflow with the cache on and compares."""
    return {}


def reference(client: stepd.Client, workers: Callable[..., StickyProcess], url: str,
              prefix: str, transport: str, kind: str,
              references: dict[tuple[str, str], tuple[Any, Any]]) -> tuple[Any, Any]:
    """The result and state of the same workflow with the cache off."""
    if (transport, kind) in references:
        return references[transport, kind]
    w = workers(url, prefix, transport=transport, capacity=0)
    run = client.start(f"{prefix}-{kind}", {"x": 1})
    result = finish(client, run) if kind == "paused" else client.result(run, timeout=60)
    assert sticky_of(client, w.worker_id) is None  # sticky off: nothing reported
    w.stop()
    references[transport, kind] = result, client.status(run).state
    return references[transport, kind]


def test_sticky_hits_and_the_result_is_the_same_as_without(
        daemon: DaemonProcess, client: stepd.Client, workers: Callable[..., StickyProcess],
        transport: str,
        references: dict[tuple[str, str], tuple[Any, Any]]) -> None:
    prefix = unique()
    off = reference(client, workers, daemon.url, prefix, transport, "chain", references)
    w = workers(daemon.url, prefix, transport=transport, capacity=8)
    run = client.start(f"{prefix}-chain", {"x": 1})
    on = client.result(run, timeout=60), client.status(run).state
    assert on == off
    assert on[0]["seen_steps"] == ["s0", "s1", "s2", "s3"]
    assert eventually(lambda: counts(client, w.worker_id) == {
        "hit": 4, "miss": 1, "eviction": 0, "forced_cold_replay": 0}, what="the counts")
    metrics = httpx.get(f"{daemon.url}/metrics", trust_env=False).text
    assert f'stepd_worker_sticky_cache{{worker_id="{w.worker_id}",event="hit"}} 4' in metrics
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPD_")}
    table = subprocess.run([sys.executable, "-m", "stepd", "workers", "--url", daemon.url],
                           capture_output=True, text=True, timeout=60, check=True,
                           env={**env, "COLUMNS": "300"}).stdout
    (row,) = [line for line in table.splitlines() if w.worker_id in line]
    assert "4/1/0/0" in row, table


def test_eviction_by_capacity_forces_cold_replays(
        daemon: DaemonProcess, client: stepd.Client, workers: Callable[..., StickyProcess],
        transport: str,
        references: dict[tuple[str, str], tuple[Any, Any]]) -> None:
    prefix = unique()
    off = reference(client, workers, daemon.url, prefix, transport, "paused", references)
    w = workers(daemon.url, prefix, transport=transport, capacity=1)
    a = client.start(f"{prefix}-paused", {"x": 1})
    eventually(lambda: waiting(client, a))
    b = client.start(f"{prefix}-paused", {"x": 1})
    eventually(lambda: waiting(client, b))
    # b's history pushed a's out of the one-entry cache.
    assert eventually(lambda: counts(client, w.worker_id)["eviction"] == 1)
    assert (finish(client, a), client.status(a).state) == off
    assert (finish(client, b), client.status(b).state) == off
    # a: s1 cold (evicted), s2 hit; b: s1 cold (a evicted it), s2 hit.
    assert eventually(lambda: counts(client, w.worker_id) == {
        "hit": 2, "miss": 2, "eviction": 3, "forced_cold_replay": 2}, what="the counts")


def take_over(daemon: DaemonProcess, client: stepd.Client,
              workers: Callable[..., StickyProcess], transport: str,
              references: dict[tuple[str, str], tuple[Any, Any]], *, kill: bool,
              build_id: str) -> None:
    """A run's first step on one process; another process takes over its worker id (with
    `build_id`) before the next: the delta it gets names a cache it does not hold, so it
    fetches the history once (a forced cold replay), then hits."""
    prefix = unique()
    off = reference(client, workers, daemon.url, prefix, transport, "paused", references)
    first = workers(daemon.url, prefix, transport=transport, capacity=8, build_id="b1")
    run = client.start(f"{prefix}-paused", {"x": 1})
    eventually(lambda: waiting(client, run))
    if kill:
        first.kill()  # SIGKILL: its cache dies with it
    else:
        first.stop()
    second = workers(daemon.url, prefix, transport=transport, capacity=8, build_id=build_id,
                     worker_id=first.worker_id)
    assert second.worker_id == first.worker_id
    assert (finish(client, run), client.status(run).state) == off
    assert eventually(lambda: counts(client, second.worker_id) == {
        "hit": 1, "miss": 0, "eviction": 0, "forced_cold_replay": 1}, what="the counts")


def test_a_replacement_process_with_the_same_worker_id_replays_cold(
        daemon: DaemonProcess, client: stepd.Client, workers: Callable[..., StickyProcess],
        transport: str,
        references: dict[tuple[str, str], tuple[Any, Any]]) -> None:
    take_over(daemon, client, workers, transport, references, kill=True, build_id="b1")


def test_a_build_mismatch_replays_cold(
        daemon: DaemonProcess, client: stepd.Client, workers: Callable[..., StickyProcess],
        transport: str,
        references: dict[tuple[str, str], tuple[Any, Any]]) -> None:
    # s1's delta names the b1 cache: fetched cold; s2's names b2: a hit.
    take_over(daemon, client, workers, transport, references, kill=False, build_id="b2")


def test_holder_lost_the_next_step_goes_to_another_worker_after_sticky_schedule_ms(
        daemon: DaemonProcess, client: stepd.Client, workers: Callable[..., StickyProcess],
        transport: str,
        references: dict[tuple[str, str], tuple[Any, Any]]) -> None:
    prefix = unique()
    off = reference(client, workers, daemon.url, prefix, transport, "paused", references)
    holder = workers(daemon.url, prefix, transport=transport, capacity=8, schedule_ms=300)
    run = client.start(f"{prefix}-paused", {"x": 1})
    eventually(lambda: waiting(client, run))
    holder.kill()
    other = workers(daemon.url, prefix, transport=transport, capacity=8)
    assert (finish(client, run), client.status(run).state) == off
    # The holder was lost: the daemon's lease to the other worker is cold (no history,
    # reason holder_unavailable), it fetches the history (a forced cold replay), then
    # gets deltas.
    assert eventually(lambda: counts(client, other.worker_id) == {
        "hit": 1, "miss": 0, "eviction": 0, "forced_cold_replay": 1}, what="the counts")
    cold = [e for e in client.journal(run) if e["type"] == "step_offered"
            and e.get("step_id") == "s1"]
    assert [e["worker_id"] for e in cold] == [other.worker_id]
    takers = {e.get("worker_id") for e in client.journal(run) if e["type"] == "step_completed"
              and e.get("step_id") in ("s1", "s2")}
    assert takers == {other.worker_id}


def test_a_corrupted_cache_entry_is_caught_by_the_cursor_check(
        daemon: DaemonProcess, client: stepd.Client, workers: Callable[..., StickyProcess],
        transport: str,
        references: dict[tuple[str, str], tuple[Any, Any]]) -> None:
    """The base cursor the lease names does not match the entry: no hit, a cold replay.

    The worker is an SDK `Worker` in this process (on its own thread, over the real
    network) so the test can corrupt its cache between two steps.
    """
    from tests.sdk.conftest import serving

    prefix = unique()
    off = reference(client, workers, daemon.url, prefix, transport, "paused", references)
    worker = stepd.Worker(daemon.url, concurrency=2, build_id="b1", transport=transport,
                          sticky_cache_capacity=8).register(*workflows(prefix))
    with serving(worker):
        run = client.start(f"{prefix}-paused", {"x": 1})
        eventually(lambda: waiting(client, run))
        cache = worker.sticky_cache
        assert cache is not None
        assert cache.set_entry_hash(f"{prefix}-paused", run.run_id, "f" * 64)
        assert (finish(client, run), client.status(run).state) == off
        assert cache.stats.as_dict() == {"hit": 1, "miss": 1, "eviction": 0,
                                         "forced_cold_replay": 1}
