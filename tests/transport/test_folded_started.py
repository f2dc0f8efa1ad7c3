"""A folded ``started`` (docs/leases.md "A folded started"), against a real daemon.

An at_least_once worker whose body ends before its first heartbeat is due
sends ``"started": true`` inside its ``complete`` or ``fail`` instead of a
``started`` call of its own: one frame (one request) a step fewer. The daemon
applies ``started`` first, in the same commit, so the journal reads exactly as
if both had come; for at_most_once the flag changes nothing (``not_started``
still holds, since ``started`` must be durable before the body runs).
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from .conftest import (
    DaemonProcess,
    Worker,
    WsWorker,
    journal_types,
    start_run,
    task_def,
    unique,
    wait_result,
    ws_connect,
)


def _step_events(http: httpx.Client, run_id: str) -> list[str]:
    return [t for t in journal_types(http, run_id) if t.startswith("step_")]


def test_register_says_the_daemon_takes_a_folded_started(http: httpx.Client) -> None:
    r = http.post("/v1/api/workers/register", json={"definitions": [task_def(unique(), "a")]})
    assert r.status_code == 200 and r.json()["fold_started"] is True


def test_complete_with_started_journals_both_over_http(http: httpx.Client) -> None:
    name = unique()
    folded = Worker(http, [task_def(name, "a")])
    run_id = start_run(http, name)
    lease = folded.claim_one(run_id=run_id)["lease_id"]
    assert folded.call(lease, "complete", {"output": 7, "started": True}).status_code == 200
    assert wait_result(http, run_id)["result"] == 7
    events = _step_events(http, run_id)
    # The same events, in the same order, as a separate `started` call gives.
    name2 = unique()
    plain = Worker(http, [task_def(name2, "a")])
    run2 = start_run(http, name2)
    lease2 = plain.claim_one(run_id=run2)["lease_id"]
    assert plain.call(lease2, "started").status_code == 200
    assert plain.call(lease2, "complete", {"output": 7}).status_code == 200
    assert wait_result(http, run2)["result"] == 7
    assert events == _step_events(http, run2)
    assert events.index("step_started") < events.index("step_completed")


def test_fail_with_started_journals_both(http: httpx.Client) -> None:
    name = unique()
    w = Worker(http, [task_def(name, "a", retry={"max_attempts": 1})])
    run_id = start_run(http, name)
    lease = w.claim_one(run_id=run_id)["lease_id"]
    r = w.call(lease, "fail", {"error": {"class": "fatal", "message": "no"}, "started": True})
    assert r.status_code == 200, r.text
    assert wait_result(http, run_id)["status"] == "failed"
    events = _step_events(http, run_id)
    assert "step_started" in events and events.index("step_started") < events.index("step_failed")


def test_the_flag_does_not_start_an_at_most_once_attempt(http: httpx.Client) -> None:
    name = unique()
    w = Worker(http, [task_def(name, "a", delivery="at_most_once")])
    run_id = start_run(http, name)
    lease = w.claim_one(run_id=run_id)["lease_id"]
    r = w.call(lease, "complete", {"output": 1, "started": True})
    assert r.status_code == 409 and r.json()["reason"] == "not_started"
    assert "step_started" not in _step_events(http, run_id)


@pytest.mark.parametrize("value", [1, "yes", None])
def test_a_started_that_is_not_a_boolean_is_400_naming_it(http: httpx.Client, value: Any) -> None:
    name = unique()
    w = Worker(http, [task_def(name, "a")])
    run_id = start_run(http, name)
    lease = w.claim_one(run_id=run_id)["lease_id"]
    for op, body in (("complete", {"output": 1}), ("fail", {"error": {"class": "fatal"}})):
        r = w.call(lease, op, {**body, "started": value})
        assert r.status_code == 400 and r.json()["field"] == "started", (op, r.text)
    # Nothing was applied: the lease still takes its complete.
    assert w.call(lease, "complete", {"output": 2}).status_code == 200
    assert wait_result(http, run_id)["result"] == 2


def test_complete_with_started_over_the_websocket(daemon: DaemonProcess) -> None:
    name = unique()
    with ws_connect(daemon) as conn, daemon.client() as http:
        w = WsWorker(conn)
        w.request("register", definitions=[task_def(name, "a", "b")])
        w.send({"op": "credit", "n": 2})
        run_id = start_run(http, name)
        for _ in range(2):
            lease = w.wait_for("lease")["lease"]
            ok = w.request("complete", lease_id=lease["lease_id"], output=lease["step_id"],
                           started=True)
            assert ok["op"] == "ok", ok
        assert wait_result(http, run_id)["result"] == "b"
        events = _step_events(http, run_id)
        assert events.count("step_started") == 2 and events.count("step_completed") == 2
