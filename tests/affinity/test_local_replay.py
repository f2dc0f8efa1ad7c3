"""Cross-worker scenarios of local steps, with real worker processes and a real daemon,
on both transports (tests/affinity/scenarios.toml).

* local step replay: a worker SIGKILLed after its local body ran but before
  the parent's ``complete`` committed runs again elsewhere (parent and local
  body, with the same idempotency key); one SIGKILLed after the commit (and a
  daemon SIGKILLed and restarted on the same data) never has the local body
  called again: the recorded terminal event is read;
* mixed-version fleets: a 1.17 worker beside a 1.20 worker on one workflow;
* workflows with none of the settings behave as before.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.reliability.conftest import DaemonProcess, kill9, stop_daemon

from ._worker_proc import expected
from .conftest import Fleet, events_of, result, start_fast_daemon, start_runs

pytestmark = pytest.mark.timeout(120)

TRANSPORTS = ["websocket", "http"]
WORKFLOW = "aff-local"


def completed_by(events: list[dict[str, object]], step: str) -> list[dict[str, object]]:
    return [e for e in events if e["type"] == "step_completed" and e.get("step_id") == step]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_worker_killed_before_the_parent_complete_commits_runs_the_local_body_again(
        transport: str, fleet: Fleet, fast_daemon: DaemonProcess) -> None:
    url = fast_daemon.url
    a, _ = fleet.start("a", url, transport=transport, extra=("--local", "--block", "norm"))
    [run] = start_runs(url, WORKFLOW, [4])
    fleet.wait_line(lambda p, t: p is a and t == f"blocked {run}", "norm blocked in a")
    a.kill9()  # the local body ran; the parent's complete was never sent
    _, b_id = fleet.start("b", url, transport=transport, extra=("--local",))
    answer = result(url, run)
    assert answer["status"] == "completed" and answer["result"] == expected(4)
    norm = fleet.body_files(run, "norm")
    assert len(norm) == 2 and norm[0][0] != norm[1][0]  # once in each process
    assert {key for _, key in norm} == {f"{run}/norm"}  # the same idempotency key
    events = events_of(url, run)
    [done] = completed_by(events, "norm")
    assert done["execution_mode"] == "local" and done["worker_id"] == b_id
    assert len(completed_by(events, "prep")) == 1
    assert [e["type"] for e in events].count("step_orphaned") >= 1


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_worker_killed_after_the_parent_complete_committed_never_calls_the_local_body_again(
        transport: str, fleet: Fleet, tmp_path: Path) -> None:
    data = tmp_path / "data"
    daemon = start_fast_daemon(data)
    try:
        a, a_id = fleet.start("a", daemon.url, transport=transport,
                              extra=("--local", "--block", "tally"))
        [run] = start_runs(daemon.url, WORKFLOW, [7])
        # tally's lease exists only once prep's complete (with norm) committed.
        fleet.wait_line(lambda p, t: p is a and t == f"blocked {run}", "tally blocked in a")
        a.kill9()
        kill9(daemon)  # and the daemon: recovery reads the journaled local step
        daemon = start_fast_daemon(data)
        _, b_id = fleet.start("b", daemon.url, transport=transport, extra=("--local",))
        answer = result(daemon.url, run)
        assert answer["status"] == "completed" and answer["result"] == expected(7)
        assert len(fleet.body_files(run, "norm")) == 1  # never called again
        assert len(fleet.body_files(run, "tally")) == 2
        events = events_of(daemon.url, run)
        [done] = completed_by(events, "norm")
        assert done["execution_mode"] == "local" and done["worker_id"] == a_id
        [tally] = completed_by(events, "tally")
        assert tally["worker_id"] == b_id
    finally:
        fleet.stop_all()
        stop_daemon(daemon)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_1_17_worker_beside_a_1_20_worker_on_the_same_workflow(
        transport: str, fleet: Fleet, fast_daemon: DaemonProcess) -> None:
    url = fast_daemon.url
    other = "http" if transport == "websocket" else "websocket"
    # Bodies take 50 ms and each worker runs two at once: both get prep steps.
    _, old_id = fleet.start("old", url, transport=transport,
                            extra=("--protocol", "1.17", "--slow-ms", "50"))
    _, new_id = fleet.start("new", url, transport=other,
                            extra=("--protocol", "1.20", "--local", "--slow-ms", "50"))
    ns = list(range(10))
    runs = start_runs(url, WORKFLOW, ns)
    paths = {"local": 0, "leased": 0}
    for n, run in zip(ns, runs):
        answer = result(url, run)
        assert answer["status"] == "completed" and answer["result"] == expected(n)
        events = events_of(url, run)
        [prep] = completed_by(events, "prep")
        [norm] = completed_by(events, "norm")
        offered_norm = [e for e in events if e["type"] == "step_offered"
                        and e["step_id"] == "norm"]
        if prep["worker_id"] == new_id:
            # The 1.20 worker ran norm locally, under prep's lease.
            assert norm["execution_mode"] == "local" and norm["lease_id"] == prep["lease_id"]
            assert not offered_norm
            paths["local"] += 1
        else:
            # The 1.17 worker's lease carried no plan: norm went out as a lease.
            assert prep["worker_id"] == old_id
            assert "execution_mode" not in norm and len(offered_norm) == 1
            paths["leased"] += 1
    assert paths["local"] >= 1 and paths["leased"] >= 1, paths
    workers = {w["worker_id"]: w for w in _workers(url)}
    assert workers[old_id]["protocol_version"] == "1.17"
    assert workers[old_id]["capabilities"] == [] and workers[old_id]["manifest"] is None
    assert workers[new_id]["protocol_version"] == "1.20"
    assert workers[new_id]["capabilities"] == ["local_steps"]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_workflow_with_none_of_the_settings_runs_as_before(
        transport: str, fleet: Fleet, fast_daemon: DaemonProcess) -> None:
    """The same plain workflow, once on a 1.0 worker (as before affinity existed) and once
    on a 1.20 worker with local steps enabled: the same results and the same journal."""
    url = fast_daemon.url
    shapes = []
    for protocol, extra in (("1.0", ()), ("1.20", ("--local",))):
        name = f"aff-plain-{protocol}"
        proc, _ = fleet.start(f"w{protocol}", url, transport=transport, workflow="plain",
                              extra=("--protocol", protocol, "--workflow-name", name, *extra))
        runs = start_runs(url, name, [1, 2])
        for n, run in zip([1, 2], runs):
            answer = result(url, run)
            assert answer["status"] == "completed" and answer["result"] == expected(n)
        events = events_of(url, runs[0])
        assert not [e for e in events if "execution_mode" in e]
        shapes.append([(e["type"], e.get("step_id")) for e in events])
        proc.stop()
    assert shapes[0] == shapes[1]


def _workers(url: str) -> list[dict[str, object]]:
    with httpx.Client(base_url=url, trust_env=False, timeout=10) as c:
        r = c.get("/v1/api/workers")
        assert r.status_code == 200, r.text
        return list(r.json()["workers"])
