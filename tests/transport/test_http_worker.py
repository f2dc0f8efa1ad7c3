"""The worker calls over HTTP against a real daemon (PROTOCOL.md "Worker calls").

Every row of the worker half of PROTOCOL.md: register (and its 400s), claim
(empty, immediate, woken by a new run, the hold cap, restricted to one run),
started/heartbeat/complete/fail, the four 409 reasons and their precedence,
404 for an unknown lease, and unservable.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx

from .conftest import DaemonProcess, Worker, journal_types, start_run, task_def, unique, wait_result

# --------------------------------------------------------------------------- register


def test_register_answers_the_numbers_the_protocol_runs_on(http: httpx.Client) -> None:
    name = unique()
    r = http.post("/v1/api/workers/register", json={
        "name": "billing-7f9c", "build_id": "2026.11.29-abc", "protocol_version": "1.20",
        "concurrency": 8, "definitions": [task_def(name, "a")],
    })
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["worker_id"].startswith("w_")
    assert body["lease_ttl_ms"] == 30_000 and body["heartbeat_ms"] == 10_000
    assert body["max_request_ms"] == 2000
    assert body["protocol_version"] == "1.20"
    (d,) = body["definitions"]
    assert d["name"] == name and d["version"] is None and len(d["definition_hash"]) == 64


def test_register_again_keeps_the_worker_id_only_when_passed(http: httpx.Client) -> None:
    defs = [task_def(unique(), "a")]
    first = Worker(http, defs).worker_id
    assert Worker(http, defs).worker_id != first
    assert Worker(http, defs, worker_id=first).worker_id == first
    r = http.post("/v1/api/workers/register",
                  json={"definitions": defs, "worker_id": "w_NOBODYKNOWSTHISONE"})
    assert r.status_code == 404 and r.json()["error"] == "not_found"


def test_a_bad_definition_is_400_naming_the_definition_and_the_field(http: httpx.Client) -> None:
    name = unique()
    good = task_def(unique(), "a")
    bad = {"name": name, "steps": [{"id": "a", "kind": "task", "body": "a",
                                    "retry": {"max_attempts": 0}}]}
    r = http.post("/v1/api/workers/register", json={"definitions": [good, bad]})
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["error"] == "invalid"
    assert body["field"] == "definitions[1].steps[0].retry.max_attempts"
    assert body["definition"] == name
    # Nothing of the request is stored: the good definition cannot be started.
    r = http.post("/v1/api/runs", json={"workflow": good["name"], "input": None})
    assert r.status_code == 422 and r.json()["error"] == "unprocessable"


def test_register_refuses_unknown_keys_and_wrong_types(http: httpx.Client) -> None:
    defs = [task_def(unique(), "a")]
    cases: list[tuple[dict[str, Any], str | None]] = [
        ({"definitions": defs, "concurency": 2}, "concurency"),
        ({"definitions": defs, "concurrency": 0}, "concurrency"),
        ({"definitions": defs, "concurrency": True}, "concurrency"),
        ({"definitions": defs, "protocol_version": "one"}, "protocol_version"),
        ({"definitions": "nope"}, "definitions"),
        ({}, "definitions"),
        ({"definitions": defs, "capabilities": ["flying"]}, "capabilities[0]"),
        ({"definitions": defs, "name": ""}, "name"),
    ]
    for body, field in cases:
        r = http.post("/v1/api/workers/register", json=body)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["field"] == field, (body, r.json())


# --------------------------------------------------------------------------- claim


def test_claim_empty_immediate_and_hold_cap(http: httpx.Client) -> None:
    w = Worker(http, [task_def(unique(), "a")])
    t0 = time.monotonic()
    assert w.claim(wait_ms=0) == []
    assert time.monotonic() - t0 < 1.5  # at once, not at the hold
    # hold = 4/5 of max_request_ms (2000): a claim asking 60 s waits ~1.6 s.
    t0 = time.monotonic()
    assert w.claim(wait_ms=60_000) == []
    held = time.monotonic() - t0
    assert 1.5 <= held < 5, held


def test_claim_takes_what_is_runnable_at_once(http: httpx.Client) -> None:
    name = unique()
    w = Worker(http, [task_def(name, "a")])
    runs = {start_run(http, name, {"i": i}) for i in range(3)}
    leases = w.claim(max=10, wait_ms=0)
    assert {lease["run_id"] for lease in leases} == runs
    lease = leases[0]
    for key in ("lease_id", "fence", "run_id", "workflow", "version", "definition_hash", "step_id",
                "body", "attempt", "item_index", "delivery", "input", "steps", "state",
                "correlation", "idempotency_key", "trace_id", "span_id", "lease_ttl_ms",
                "timeout_ms"):
        assert key in lease, key
    assert lease["workflow"] == name and lease["step_id"] == "a" and lease["attempt"] == 1
    assert lease["lease_ttl_ms"] == 30_000


def test_a_waiting_claim_is_woken_by_a_new_run(http: httpx.Client, daemon: DaemonProcess) -> None:
    name = unique()
    w = Worker(http, [task_def(name, "a")])
    got: list[Any] = []

    def claim() -> None:
        with daemon.client() as c:
            t0 = time.monotonic()
            r = c.post("/v1/api/steps/claim",
                       json={"worker_id": w.worker_id, "max": 1, "wait_ms": 10_000})
            got.append((r.status_code, r.json(), time.monotonic() - t0))

    t = threading.Thread(target=claim)
    t.start()
    time.sleep(0.2)
    run_id = start_run(http, name)
    t.join(10)
    status, body, took = got[0]
    # A lease in the answer: woken by the run (at the hold, 1.6 s, it would be empty).
    assert status == 200 and [x["run_id"] for x in body["leases"]] == [run_id]
    assert took < 5


def test_a_claim_restricted_to_a_run_takes_only_its_steps(http: httpx.Client) -> None:
    name = unique()
    w = Worker(http, [task_def(name, "a")])
    other = start_run(http, name)
    mine = start_run(http, name)
    leases = w.claim(max=5, run_id=mine)
    assert [x["run_id"] for x in leases] == [mine]
    assert [x["run_id"] for x in w.claim(max=5)] == [other]
    r = http.post("/v1/api/steps/claim", json={"worker_id": w.worker_id, "run_id": "r_NOSUCHRUN"})
    assert r.status_code == 404


def test_claim_validation(http: httpx.Client) -> None:
    w = Worker(http, [task_def(unique(), "a")])
    for body, field in [
        ({}, "worker_id"),
        ({"worker_id": w.worker_id, "max": 0}, "max"),
        ({"worker_id": w.worker_id, "wait_ms": -1}, "wait_ms"),
        ({"worker_id": w.worker_id, "waitMs": 5}, "waitMs"),
        ({"worker_id": w.worker_id, "run_id": 7}, "run_id"),
    ]:
        r = http.post("/v1/api/steps/claim", json=body)
        assert r.status_code == 400 and r.json()["field"] == field, (body, r.text)
    r = http.post("/v1/api/steps/claim", json={"worker_id": "w_UNKNOWNWORKER"})
    assert r.status_code == 404


# --------------------------------------------------------------------------- lease calls


def test_started_heartbeat_complete_run_a_step_to_the_end(http: httpx.Client) -> None:
    name = unique()
    w = Worker(http, [task_def(name, "a", "b")])
    run_id = start_run(http, name, {"x": 1})
    a = w.claim_one(run_id=run_id)
    assert a["input"] == {"x": 1}
    assert w.call(a["lease_id"], "started").json() == {}
    assert w.call(a["lease_id"], "started", {}).status_code == 200  # repeating is harmless
    r = w.call(a["lease_id"], "heartbeat", {"progress": {"pct": 50}})
    assert r.status_code == 200 and r.json() == {"lease_ttl_ms": 30_000}
    assert w.call(a["lease_id"], "heartbeat").json() == {"lease_ttl_ms": 30_000}
    r = w.call(a["lease_id"], "complete", {
        "output": {"a": 1}, "state_patch": {"summary": "s"},
        "usage": {"model": "m", "input_tokens": 10, "output_tokens": 5},
        "spans": [{"span_id": "0123456789abcdef", "name": "llm.call", "start_ms": 1,
                   "end_ms": 2, "attributes": {"k": "v"}}],
    })
    assert r.status_code == 200 and r.json() == {}
    b = w.claim_one(run_id=run_id)
    assert b["step_id"] == "b" and b["steps"]["a"] == {"a": 1} and b["state"] == {"summary": "s"}
    w.call(b["lease_id"], "started")
    assert w.call(b["lease_id"], "complete", {"output": "done"}).status_code == 200
    result = wait_result(http, run_id)
    assert result == {"run_id": run_id, "status": "completed", "result": "done", "error": None}
    status = http.get(f"/v1/api/runs/{run_id}").json()
    assert status["usage"]["input_tokens"] == 10 and status["usage"]["output_tokens"] == 5


def test_fail_retryable_is_retried_and_fatal_fails_the_run(http: httpx.Client) -> None:
    name = unique()
    w = Worker(http, [task_def(name, "a", retry={"max_attempts": 2, "initial_backoff_ms": 0})])
    run_id = start_run(http, name)
    first = w.claim_one(run_id=run_id)
    w.call(first["lease_id"], "started")
    r = w.call(first["lease_id"], "fail", {"error": {"class": "retryable", "message": "503"}})
    assert r.status_code == 200 and r.json() == {}
    second = w.claim_one(run_id=run_id)
    assert second["attempt"] == 2 and second["fence"] > first["fence"]
    assert second["idempotency_key"] == first["idempotency_key"]
    w.call(second["lease_id"], "started")
    w.call(second["lease_id"], "fail", {"error": {"class": "fatal", "message": "boom"}})
    result = wait_result(http, run_id)
    assert result["status"] == "failed" and result["error"]["reason"] == "step_failed"
    types = journal_types(http, run_id)
    assert types.count("step_failed") == 2


def test_lease_call_bodies_are_validated(http: httpx.Client) -> None:
    name = unique()
    w = Worker(http, [task_def(name, "a")])
    run_id = start_run(http, name)
    lease = w.claim_one(run_id=run_id)["lease_id"]
    for op, body, field in [
        ("started", {"x": 1}, "x"),
        ("heartbeat", {"progres": 1}, "progres"),
        ("complete", {"outptu": 1}, "outptu"),
        ("complete", {"state_patch": [1]}, "state_patch"),
        ("complete", {"usage": {"input_tokens": -1}}, "usage.input_tokens"),
        ("complete", {"usage": {"tokens": 1}}, "usage.tokens"),
        ("complete", {"spans": [{"span_id": "xyz", "name": "n", "start_ms": 0, "end_ms": 0}]},
         "spans[0].span_id"),
        ("complete", {"spans": [{"span_id": "0123456789abcdef", "name": "n", "start_ms": 0}]},
         "spans[0].end_ms"),
        ("fail", {}, "error"),
        ("fail", {"error": {"message": "m"}}, "error.class"),
        ("fail", {"error": {"class": "retryable", "msg": "m"}}, "error.msg"),
    ]:
        r = w.call(lease, op, body)
        assert r.status_code == 400, (op, body, r.text)
        assert r.json()["field"] == field, (op, body, r.json())
    r = w.call(lease, "complete")  # a complete needs a body
    assert r.status_code == 400 and r.json()["field"] is None


def test_unknown_lease_is_404(http: httpx.Client) -> None:
    for lease in ("l_01JDV5Z8Q3X4M6N7P8R9S0T1U2", "not-a-lease-id"):
        for op, body in (("started", {}), ("heartbeat", {}), ("complete", {}),
                         ("fail", {"error": {"class": "fatal"}})):
            r = http.post(f"/v1/api/steps/{lease}/{op}", json=body)
            assert r.status_code == 404, (lease, op, r.text)
            assert r.json()["error"] == "not_found"


# --------------------------------------------------------------------------- the 409s


def _conflict(r: httpx.Response) -> str:
    assert r.status_code == 409, r.text
    body = r.json()
    assert body["error"] == "conflict" and isinstance(body["message"], str)
    return str(body["reason"])


def test_already_applied_on_a_repeated_complete_or_fail(http: httpx.Client) -> None:
    name = unique()
    w = Worker(http, [task_def(name, "a", "b")])
    run_id = start_run(http, name)
    lease = w.claim_one(run_id=run_id)["lease_id"]
    w.call(lease, "started")
    assert w.call(lease, "complete", {"output": 1}).status_code == 200
    assert _conflict(w.call(lease, "complete", {"output": 1})) == "already_applied"
    assert _conflict(w.call(lease, "fail", {"error": {"class": "fatal"}})) == "already_applied"
    assert _conflict(w.call(lease, "heartbeat")) == "already_applied"
    # Precedence: the run is over too (cancelled), but already_applied comes first.
    assert http.post(f"/v1/api/runs/{run_id}/cancel").status_code == 200
    assert _conflict(w.call(lease, "complete", {"output": 1})) == "already_applied"


def test_run_terminal_after_cancel_and_over_not_started(http: httpx.Client) -> None:
    name = unique()
    w = Worker(http, [task_def(name, "a", delivery="at_most_once")])
    run_id = start_run(http, name)
    lease = w.claim_one(run_id=run_id)["lease_id"]
    # at_most_once without started: not_started...
    assert _conflict(w.call(lease, "complete", {"output": 1})) == "not_started"
    # ...but once the run is over, run_terminal wins over not_started.
    r = http.post(f"/v1/api/runs/{run_id}/cancel", json={})
    assert r.status_code == 200 and r.json() == {}
    for op, body in (("complete", {"output": 1}), ("heartbeat", {}), ("started", {}),
                     ("fail", {"error": {"class": "fatal"}})):
        assert _conflict(w.call(lease, op, body)) == "run_terminal", op
    assert http.get(f"/v1/api/runs/{run_id}").json()["status"] == "cancelled"


def test_not_started_for_at_most_once(http: httpx.Client) -> None:
    name = unique()
    w = Worker(http, [task_def(name, "a", delivery="at_most_once")])
    run_id = start_run(http, name)
    lease = w.claim_one(run_id=run_id)
    assert lease["delivery"] == "at_most_once"
    assert _conflict(w.call(lease["lease_id"], "fail", {"error": {"class": "fatal"}})) == \
        "not_started"
    assert w.call(lease["lease_id"], "started").status_code == 200
    assert w.call(lease["lease_id"], "complete", {"output": 2}).status_code == 200
    assert wait_result(http, run_id)["result"] == 2


def test_fenced_after_recovery_and_over_run_terminal(fast_daemon: DaemonProcess) -> None:
    """TTL 300 ms + window 200 ms: the attempt is recovered, the late worker is fenced."""
    name = unique()
    with fast_daemon.client() as c:
        w = Worker(c, [task_def(name, "a", retry={"max_attempts": 3, "initial_backoff_ms": 0})])
        run_id = start_run(c, name)
        late = w.claim_one(run_id=run_id)
        w.call(late["lease_id"], "started")
        # No heartbeat: expired at 300 ms, recovered at 500 ms, re-queued as attempt 2.
        again = w.claim_one(run_id=run_id, wait_ms=1500)
        assert again["attempt"] == 2 and again["fence"] > late["fence"]
        assert _conflict(w.call(late["lease_id"], "heartbeat")) == "fenced"
        assert _conflict(w.call(late["lease_id"], "complete", {"output": 1})) == "fenced"
        types = journal_types(c, run_id)
        assert "step_orphaned" in types and "step_recovered" in types
        # Precedence: after cancel, the recovered lease is still fenced (fenced before run_terminal).
        assert c.post(f"/v1/api/runs/{run_id}/cancel").status_code == 200
        assert _conflict(w.call(late["lease_id"], "complete", {"output": 1})) == "fenced"
        assert _conflict(w.call(again["lease_id"], "heartbeat")) == "run_terminal"


def test_a_late_heartbeat_inside_the_window_revives(fast_daemon: DaemonProcess) -> None:
    name = unique()
    with fast_daemon.client() as c:
        w = Worker(c, [task_def(name, "a")])
        run_id = start_run(c, name)
        lease = w.claim_one(run_id=run_id)
        w.call(lease["lease_id"], "started")
        # Heartbeat within TTL keeps it; then miss one TTL but come back inside the window.
        deadline = time.monotonic() + 5
        while "step_orphaned" not in journal_types(c, run_id):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        r = w.call(lease["lease_id"], "heartbeat")
        if r.status_code == 200:  # inside the 200 ms window: revived
            deadline = time.monotonic() + 5  # journaled by the run actor just after
            while "step_revived" not in journal_types(c, run_id):
                assert time.monotonic() < deadline
                time.sleep(0.02)
            assert w.call(lease["lease_id"], "complete", {"output": 1}).status_code == 200
            assert wait_result(c, run_id)["status"] == "completed"
        else:  # the window passed while we looked (slow machine): fenced, never silence
            assert _conflict(r) == "fenced"


def test_unservable_goes_to_another_worker_and_not_back(http: httpx.Client) -> None:
    name = unique()
    defs = [task_def(name, "a", retry={"max_attempts": 1})]
    first = Worker(http, defs)
    run_id = start_run(http, name)
    lease = first.claim_one(run_id=run_id)
    r = first.call(lease["lease_id"], "fail",
                   {"error": {"class": "unservable", "message": "no such body here"}})
    assert r.status_code == 200
    assert first.claim(run_id=run_id, wait_ms=300) == []  # not offered to it again
    second = Worker(http, defs)
    again = second.claim_one(run_id=run_id)
    assert again["step_id"] == "a"
    assert again["attempt"] == lease["attempt"]  # no retry budget spent (max_attempts 1)
    second.call(again["lease_id"], "started")
    assert second.call(again["lease_id"], "complete", {"output": "ok"}).status_code == 200
    assert wait_result(http, run_id)["status"] == "completed"
    assert "step_unservable" in journal_types(http, run_id)
