"""Defects a hostile or careless client found (the hardening issue), each fixed at the root.

Each test here failed before its fix; they run against a real ``stepd serve``
on 127.0.0.1 with raw HTTP and raw WebSocket clients.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from .conftest import (
    DaemonProcess,
    Worker,
    WsWorker,
    journal_types,
    start_daemon,
    start_run,
    task_def,
    unique,
    wait_result,
    ws_connect,
)


def test_a_worker_cannot_call_on_a_lease_another_worker_holds(daemon: DaemonProcess) -> None:
    """Worker B, over its own registered WebSocket, completes A's lease: 404, nothing applied.

    Before the fix B's complete was accepted and A's own complete then got
    ``already_applied``, which is false. The 404 does not reveal that the lease
    exists (the same answer as an unknown lease id), and A's calls still work.
    """
    name = unique()
    with ws_connect(daemon) as conn_a, ws_connect(daemon) as conn_b, daemon.client() as http:
        a, b = WsWorker(conn_a), WsWorker(conn_b)
        a.request("register", name="a", definitions=[task_def(name, "s")])
        b.request("register", name="b", definitions=[task_def(name, "s")])
        a.send({"op": "credit", "n": 1})
        run_id = start_run(http, name)
        lease = a.wait_for("lease")["lease"]["lease_id"]
        for op, extra in (("started", {}), ("heartbeat", {}), ("complete", {"output": "B"}),
                          ("fail", {"error": {"class": "fatal", "message": "B"}})):
            answer = b.request(op, lease_id=lease, **extra)
            assert answer["op"] == "error" and answer["status"] == 404, (op, answer)
            unknown = b.request(op, lease_id="l_01JDV5Z8Q3X4M6N7P8R9S0T1U2", **extra)
            assert answer["message"].replace(lease, "L") == unknown["message"].replace(
                "l_01JDV5Z8Q3X4M6N7P8R9S0T1U2", "L"), (answer, unknown)
        assert a.request("started", lease_id=lease)["op"] == "ok"
        assert a.request("complete", lease_id=lease, output="A")["op"] == "ok"
        # The lease has ended: B still learns nothing (404), A hears already_applied.
        assert b.request("complete", lease_id=lease, output="B")["status"] == 404
        assert a.request("complete", lease_id=lease, output="A")["reason"] == "already_applied"
        assert wait_result(http, run_id)["result"] == "A"


def test_an_unregistered_websocket_cannot_call_on_a_lease(daemon: DaemonProcess) -> None:
    name = unique()
    with ws_connect(daemon) as conn_a, ws_connect(daemon) as conn_x, daemon.client() as http:
        a, x = WsWorker(conn_a), WsWorker(conn_x)
        a.request("register", definitions=[task_def(name, "s")])
        a.send({"op": "credit", "n": 1})
        run_id = start_run(http, name)
        lease = a.wait_for("lease")["lease"]["lease_id"]
        assert x.request("complete", lease_id=lease, output="X")["status"] == 404
        a.request("started", lease_id=lease)
        assert a.request("complete", lease_id=lease, output="A")["op"] == "ok"
        assert wait_result(http, run_id)["result"] == "A"


@pytest.mark.parametrize("target", [5, None, ["a"], "", "nope", "$stop"])
def test_a_bad_next_step_is_refused_whatever_its_type(http: httpx.Client, target: object) -> None:
    """One rule for a non-string and an unknown `_next_step`: 400 naming output._next_step.

    Before the fix ``{"_next_step": 5}`` completed the run with that output as
    its result, while an unknown string failed the run. Nothing of the refused
    complete is applied: the lease stays live and a good complete still lands.
    """
    name = unique()
    worker = Worker(http, [task_def(name, "a", "b")])
    run_id = start_run(http, name)
    lease = worker.claim_one(run_id=run_id)["lease_id"]
    assert worker.call(lease, "started").status_code == 200
    r = worker.call(lease, "complete", {"output": {"_next_step": target, "x": 1},
                                        "usage": {"input_tokens": 7}})
    assert r.status_code == 400, r.text
    assert r.json()["field"] == "output._next_step"
    status = http.get(f"/v1/api/runs/{run_id}").json()
    assert status["status"] == "running" and status["usage"]["input_tokens"] == 0
    assert "step_completed" not in journal_types(http, run_id)
    assert worker.call(lease, "complete", {"output": {"_next_step": "$end"}}).status_code == 200
    assert wait_result(http, run_id)["result"] == {"_next_step": "$end"}


@pytest.fixture(scope="module")
def default_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    """A daemon with the default body limit (8 MiB), unlike the shared one (64 KiB)."""
    d = start_daemon(tmp_path_factory.mktemp("hardening") / "data")
    try:
        yield d
    finally:
        d.stop()


def test_signals_are_bounded_in_bytes_and_count(default_daemon: DaemonProcess) -> None:
    """A payload over 1 MiB is refused (400 payload); so is what would overflow a run's buffer.

    Before the fix ten 7 MB signals to a run not waiting for them were all
    buffered (the data file grew by 290 MB), and the 1,001st signal's refusal
    named ``field: "name"``. Refusals record nothing.
    """
    with default_daemon.client() as http:
        _signals_are_bounded(http)


def _signals_are_bounded(http: httpx.Client) -> None:
    name = unique()
    Worker(http, [task_def(name, "a")])
    run_id = start_run(http, name)  # nobody claims "a": every signal is buffered

    def signal(payload: object, sig: str = "note") -> httpx.Response:
        return http.post(f"/v1/api/runs/{run_id}/signal", json={"name": sig, "payload": payload})

    big = signal("x" * (1 << 20))  # 1 MiB + the two quotes
    assert big.status_code == 400 and big.json()["field"] == "payload", big.text
    assert "max_signal_bytes" in big.json()["message"]
    chunk = "y" * ((1 << 20) - 64)
    for _ in range(8):
        assert signal(chunk).status_code == 200
    over = signal(chunk)
    assert over.status_code == 400 and over.json()["field"] == "payload", over.text
    assert "max_buffered_signal_bytes" in over.json()["message"]
    events = http.get(f"/v1/api/runs/{run_id}/journal").json()["events"]
    assert [e["type"] for e in events].count("signal_received") == 8

    small = start_run(http, name)

    def tick(i: int) -> tuple[int, int, str]:
        r = http.post(f"/v1/api/runs/{small}/signal", json={"name": "tick", "payload": i})
        return i, r.status_code, r.text

    # Eight senders at once: the count bound is the same, the commits group.
    with ThreadPoolExecutor(8) as pool:
        refused = [t for t in pool.map(tick, range(1000)) if t[1] != 200]
    assert refused == []
    r = http.post(f"/v1/api/runs/{small}/signal", json={"name": "tick", "payload": 1000})
    assert r.status_code == 400, r.text
    assert r.json()["field"] is None and "max_buffered_signals" in r.json()["message"]


@pytest.mark.parametrize(("body", "field"), [
    ({"output": 1, "usage": {"input_tokens": 2**64 - 1}}, "usage.input_tokens"),
    ({"output": 1, "usage": {"output_tokens": 2**41}}, "usage.output_tokens"),
    ({"output": 1, "spans": [{"span_id": "a" * 16, "name": "llm", "start_ms": 0,
                              "end_ms": 2**60}]}, "spans[0].end_ms"),
    ({"output": 1, "spans": [{"span_id": "a" * 16, "name": "llm", "start_ms": 0, "end_ms": 1,
                              "usage": {"input_tokens": 2**64 - 1}}]},
     "spans[0].usage.input_tokens"),
])
def test_numbers_that_could_overflow_a_run_are_refused_at_the_boundary(
        http: httpx.Client, body: dict[str, object], field: str) -> None:
    """Two completes of 2**64-1 tokens each once overflowed the run's totals and hung.

    Each number is range-checked where it enters: 400 naming the field, nothing
    applied; then a good complete lands.
    """
    name = unique()
    worker = Worker(http, [task_def(name, "a", "b")])
    run_id = start_run(http, name)
    lease = worker.claim_one(run_id=run_id)["lease_id"]
    worker.call(lease, "started")
    r = worker.call(lease, "complete", body)
    assert r.status_code == 400 and r.json()["field"] == field, r.text
    assert worker.call(lease, "complete", {"output": 1, "usage": {"input_tokens": 2**40}}
                       ).status_code == 200
    assert http.get(f"/v1/api/runs/{run_id}").json()["usage"]["input_tokens"] == 2**40


def test_a_workflow_that_starts_itself_is_bounded_by_the_depth_limit(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """`start_workflows` of its own workflow: 201, a tree one level per transaction, bounded.

    Before the fix the start answered 500 (RecursionError): child runs were
    created recursively inside the parent's transaction. Now each child's
    actor enters its first step itself; at `--max-child-depth` a run fails
    with budget_exceeded (max_child_depth), and the failure travels up.
    """
    d = start_daemon(tmp_path_factory.mktemp("depth") / "data", "--max-child-depth", "3")
    try:
        with d.client() as http:
            name = unique("t1")
            Worker(http, [{"name": name, "steps": [
                {"id": "a", "kind": "start_workflows", "workflow": name, "items": [1, 2]}]}])
            r = http.post("/v1/api/runs", json={"workflow": name, "input": None})
            assert r.status_code == 201, r.text
            root = r.json()["run_id"]
            assert wait_result(http, root, timeout_s=30)["status"] == "failed"
            level = [root]
            total = 0
            depth_breaches = 0
            for depth in range(4):
                nxt = []
                for run_id in level:
                    total += 1
                    status = wait_result(http, run_id, timeout_s=30)
                    # A leaf fails on the depth limit, unless a sibling's failure
                    # reached their parent first and it cancelled the leaf.
                    assert status["status"] in ("failed", "cancelled"), status
                    error = status["error"] or {}
                    if error.get("budget") == "max_child_depth":
                        assert depth == 3 and error["reason"] == "budget_exceeded", status
                        depth_breaches += 1
                    nxt += [f"{run_id}.a.0", f"{run_id}.a.1"]
                level = nxt
            assert total == 15 and depth_breaches >= 1
            for run_id in level:  # depth 4 was never created
                assert http.get(f"/v1/api/runs/{run_id}").status_code == 404
    finally:
        d.stop()


def test_killing_a_passivated_run_says_it_is_asleep(http: httpx.Client) -> None:
    """`stepd actors kill /runs/<passivated run>` said only "no actor"; now it says why."""
    name = unique()
    Worker(http, [{"name": name, "steps": [{"id": "w", "kind": "wait", "event": "go"}]}])
    run_id = start_run(http, name)
    for _ in range(50):  # bounded: the waiting run passivates at once
        r = http.post("/v1/api/actors/kill", json={"path": f"/runs/{run_id}"})
        if r.status_code == 404:
            break
    assert r.status_code == 404, r.text
    assert "passivated" in r.json()["message"] and "waiting" in r.json()["message"]
    r = http.post("/v1/api/actors/kill", json={"path": "/runs/r_nosuchrun"})
    assert r.status_code == 404 and "there is no run" in r.json()["message"]
    r = http.post("/v1/api/actors/kill", json={"path": "/leases"})
    assert r.json()["restarted"] == ["/leases", "/timers", "/schedules", "/recovery", "/retention"]


def test_idle_workers_are_forgotten_and_connected_ones_listed_first(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """515 registered workers stayed listed forever, 2 connected; now idle ones expire."""
    d = start_daemon(tmp_path_factory.mktemp("expiry") / "data", "--worker-expiry-ms", "500")
    try:
        with d.client() as http, ws_connect(d) as conn:
            name = unique()
            idle = [Worker(http, [task_def(name, "a")]).worker_id for _ in range(30)]
            ws = WsWorker(conn)
            live = ws.request("register", name="live", definitions=[task_def(name, "a")])
            listed = http.get("/v1/api/workers").json()["workers"]
            assert listed[0]["worker_id"] == live["worker_id"] and listed[0]["connected"]
            for _ in range(100):  # bounded: the sweep runs every second
                listed = http.get("/v1/api/workers").json()["workers"]
                if len(listed) == 1:
                    break
                ws.request("heartbeat", lease_id="l_01JDV5Z8Q3X4M6N7P8R9S0T1U2")  # stays busy
                time.sleep(0.05)
            assert [w["worker_id"] for w in listed] == [live["worker_id"]]
            r = http.post("/v1/api/steps/claim", json={"worker_id": idle[0]})
            assert r.status_code == 404  # forgotten: it must register again
    finally:
        d.stop()


def test_a_huge_path_id_is_not_kept_whole_in_the_audit_log(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """Each refused read is audited with its target: a 60 KB run id once went in whole."""
    d = start_daemon(tmp_path_factory.mktemp("audit") / "data", "--admin-key", "adm")
    try:
        with d.client("adm") as http:
            huge = "r_" + "A" * 60_000
            assert http.get(f"/v1/api/runs/{huge}").status_code == 404
            targets: list[str] = []
            for _ in range(50):  # bounded: a read's entry is written behind
                entries = http.get("/v1/api/audit", params={"limit": 1000}).json()["entries"]
                targets = [e["target"] for e in entries
                           if e["target"] and e["target"].startswith("r_A")]
                if targets:
                    break
                time.sleep(0.02)
            assert targets and all(len(t) <= 1024 for t in targets), [len(t) for t in targets]
    finally:
        d.stop()
