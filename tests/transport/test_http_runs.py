"""The runs API and the operations endpoints over HTTP against a real daemon.

PROTOCOL.md "Runs API" with the shapes of ``transport/openapi.json``: start
(with and without an idempotency key), status, list (filters, cursor),
journal, export, the result long-poll, signal (and its 409 budget refusal),
cancel; request bodies over the limit (413) and malformed (400); 404 for
ids that name nothing; ``/healthz``, ``/metrics``, ``/openapi.json``.
"""

from __future__ import annotations

import json
import re
import threading
import time
from typing import Any

import httpx
import pytest

from .conftest import DaemonProcess, Worker, journal_types, start_run, task_def, unique, wait_result

TERMINAL = ("completed", "failed", "cancelled", "timed_out")


def wait_def(name: str, **budgets: Any) -> dict[str, Any]:
    d: dict[str, Any] = {
        "name": name,
        "steps": [{"id": "approval", "kind": "wait", "event": "approved", "into": "approval"}],
    }
    if budgets:
        d["budgets"] = budgets
    return d


# --------------------------------------------------------------------------- start


def test_start_with_and_without_idempotency_key(http: httpx.Client) -> None:
    name = unique()
    Worker(http, [task_def(name, "a")])
    r = http.post("/v1/api/runs", json={"workflow": name, "input": {"n": 1}})
    assert r.status_code == 201 and r.json()["created"] is True
    plain = r.json()["run_id"]
    key = unique("key")
    r1 = http.post("/v1/api/runs", json={"workflow": name, "input": 1, "idempotency_key": key})
    assert r1.status_code == 201 and r1.json()["created"] is True
    r2 = http.post("/v1/api/runs", json={"workflow": name, "input": 2, "idempotency_key": key})
    assert r2.status_code == 200
    assert r2.json() == {"run_id": r1.json()["run_id"], "created": False}
    assert r1.json()["run_id"] != plain


def test_start_refusals(http: httpx.Client) -> None:
    name = unique()
    Worker(http, [task_def(name, "a")])
    for body, field in [
        ({"workflow": name}, "input"),
        ({"input": 1}, "workflow"),
        ({"workflow": name, "input": 1, "idempotencyKey": "k"}, "idempotencyKey"),
        ({"workflow": name, "input": 1, "deadline_ms": 0}, "deadline_ms"),
        ({"workflow": name, "input": 1, "idempotency_key": ""}, "idempotency_key"),
        ({"workflow": name, "input": 1, "idempotency_key": "k" * 257}, "idempotency_key"),
        ({"workflow": name, "input": 1, "version": 3}, "version"),
    ]:
        r = http.post("/v1/api/runs", json=body)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"] == "invalid" and r.json()["field"] == field, r.json()
    r = http.post("/v1/api/runs", json={"workflow": unique("nobody"), "input": 1})
    assert r.status_code == 422 and r.json()["error"] == "unprocessable"
    r = http.post("/v1/api/runs", json={"workflow": name, "input": 1, "version": "v9"})
    assert r.status_code == 422


# --------------------------------------------------------------------------- reads


def test_status_fields(http: httpx.Client) -> None:
    name = unique()
    w = Worker(http, [task_def(name, "a")])
    run_id = start_run(http, name, {"t": 42}, correlation={"ticket": "T-42"},
                       idempotency_key=unique("k"))
    r = http.get(f"/v1/api/runs/{run_id}")
    assert r.status_code == 200
    s = r.json()
    for key in ("run_id", "workflow", "status", "definition_version", "definition_hash",
                "idempotency_key", "correlation", "input", "state", "result", "error",
                "current_steps", "waiting_for", "budget", "usage", "created_at", "updated_at",
                "parent_run_id"):
        assert key in s, key
    assert s["status"] == "running" and s["input"] == {"t": 42}
    assert s["correlation"] == {"ticket": "T-42"} and s["current_steps"] == ["a"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", s["created_at"])
    assert set(s["budget"]) == {"limits", "usage"}
    lease = w.claim_one(run_id=run_id)
    assert lease["correlation"] == {"ticket": "T-42"}
    assert lease["definition_hash"] == s["definition_hash"]


def test_unknown_runs_are_404(http: httpx.Client) -> None:
    for run_id in ("r_01JDV5Z8Q3X4M6N7P8R9S0T1U2", "nope", "r_"):
        for method, suffix, body in (("GET", "", None), ("GET", "/journal", None),
                                     ("GET", "/export", None), ("GET", "/result", None),
                                     ("POST", "/signal", {"name": "x"}),
                                     ("POST", "/cancel", {})):
            r = http.request(method, f"/v1/api/runs/{run_id}{suffix}", json=body)
            assert r.status_code == 404, (run_id, suffix, r.text)
            assert r.json()["error"] == "not_found"
    assert http.get("/v1/api/nothing-here").status_code == 404
    r = http.delete("/v1/api/runs")
    assert r.status_code == 405 and "GET" in r.headers["allow"]


def test_list_with_filters_and_cursor(http: httpx.Client) -> None:
    name = unique()
    Worker(http, [task_def(name, "a")])
    ids = [start_run(http, name, i) for i in range(3)]
    newest_first = sorted(ids, key=lambda i: (http.get(f"/v1/api/runs/{i}").json()["created_at"],
                                              i), reverse=True)
    r = http.get("/v1/api/runs", params={"workflow": name, "limit": 2})
    assert r.status_code == 200
    page = r.json()
    assert [x["run_id"] for x in page["runs"]] == newest_first[:2]
    assert page["next_cursor"]
    summary = page["runs"][0]
    assert summary["workflow"] == name and summary["status"] == "running"
    assert re.fullmatch(r"\d{4}-.*Z", summary["created_at"])
    r = http.get("/v1/api/runs",
                 params={"workflow": name, "limit": 2, "cursor": page["next_cursor"]})
    assert [x["run_id"] for x in r.json()["runs"]] == newest_first[2:]
    assert r.json()["next_cursor"] is None
    r = http.get("/v1/api/runs", params={"workflow": name, "order": "asc"})
    assert [x["run_id"] for x in r.json()["runs"]] == newest_first[::-1]
    assert http.post(f"/v1/api/runs/{ids[1]}/cancel").status_code == 200
    r = http.get("/v1/api/runs", params={"workflow": name, "status": "cancelled"})
    assert [x["run_id"] for x in r.json()["runs"]] == [ids[1]]
    for params, field in (({"limit": 0}, "limit"), ({"limit": "x"}, "limit"),
                          ({"status": "sleepy"}, "status"), ({"cursor": "bogus"}, "cursor"),
                          ({"cursor": "r_01JDV5Z8Q3X4M6N7P8R9S0T1U2"}, "cursor"),
                          ({"order": "up"}, "order"), ({"created_after": "yesterday"},
                                                       "created_after"),
                          ({"correlation": "null"}, "correlation"),
                          ({"status": "running", "cursor": page["next_cursor"]}, "cursor")):
        r = http.get("/v1/api/runs", params=params)
        assert r.status_code == 400 and r.json()["field"] == field, (params, r.text)


def test_journal_and_export(http: httpx.Client) -> None:
    name = unique()
    w = Worker(http, [task_def(name, "a")])
    run_id = start_run(http, name, idempotency_key=unique("k"))
    lease = w.claim_one(run_id=run_id)
    w.call(lease["lease_id"], "started")
    w.call(lease["lease_id"], "complete", {
        "output": 7, "spans": [{"span_id": "0123456789abcdef", "name": "s", "start_ms": 0,
                                "end_ms": 1}]})
    wait_result(http, run_id)
    r = http.get(f"/v1/api/runs/{run_id}/journal")
    assert r.status_code == 200
    events = r.json()["events"]
    assert r.json()["run_id"] == run_id
    assert [e["seq"] for e in events] == sorted(e["seq"] for e in events)
    assert events[0]["type"] == "run_started" and events[-1]["type"] == "run_completed"
    offered = next(e for e in events if e["type"] == "step_offered")
    assert offered["worker_id"] == w.worker_id
    tail = http.get(f"/v1/api/runs/{run_id}/journal",
                    params={"after_seq": events[1]["seq"], "limit": 2}).json()["events"]
    assert [e["seq"] for e in tail] == [e["seq"] for e in events[2:4]]
    r = http.get(f"/v1/api/runs/{run_id}/journal", params={"limit": 0})
    assert r.status_code == 400 and r.json()["field"] == "limit"
    export = http.get(f"/v1/api/runs/{run_id}/export").json()
    for key in ("run_id", "workflow", "definition", "definition_version", "definition_hash",
                "idempotency_key", "budget", "state", "journal", "spans"):
        assert key in export, key
    assert export["definition"]["name"] == name
    assert export["journal"] == events


def test_export_lists_the_spans_a_completion_reported(http: httpx.Client) -> None:
    name = unique()
    w = Worker(http, [task_def(name, "a")])
    run_id = start_run(http, name)
    lease = w.claim_one(run_id=run_id)
    w.call(lease["lease_id"], "started")
    w.call(lease["lease_id"], "complete", {
        "output": 7, "spans": [{"span_id": "0123456789abcdef", "name": "s", "start_ms": 0,
                                "end_ms": 1}]})
    wait_result(http, run_id)
    export = http.get(f"/v1/api/runs/{run_id}/export").json()
    assert [s["span_id"] for s in export["spans"]] == ["0123456789abcdef"]


def test_result_long_poll(http: httpx.Client, daemon: DaemonProcess) -> None:
    name = unique()
    w = Worker(http, [task_def(name, "a")])
    run_id = start_run(http, name)
    r = http.get(f"/v1/api/runs/{run_id}/result")  # wait_ms 0: at once
    assert r.json() == {"run_id": run_id, "status": "running", "result": None, "error": None}
    # Capped at the hold (4/5 of max_request_ms = 1.6 s): a non-terminal answer.
    t0 = time.monotonic()
    r = http.get(f"/v1/api/runs/{run_id}/result", params={"wait_ms": 60_000})
    assert r.json()["status"] == "running" and 1.5 <= time.monotonic() - t0 < 5
    got: list[Any] = []

    def poll() -> None:
        with daemon.client() as c:
            t = time.monotonic()
            res = c.get(f"/v1/api/runs/{run_id}/result", params={"wait_ms": 10_000})
            got.append((res.json(), time.monotonic() - t))

    t = threading.Thread(target=poll)
    t.start()
    time.sleep(0.1)
    lease = w.claim_one(run_id=run_id)
    w.call(lease["lease_id"], "started")
    w.call(lease["lease_id"], "complete", {"output": {"ok": True}})
    t.join(10)
    result, took = got[0]
    # Completed in the answer: woken by the run's end (at the hold it would say running).
    assert result == {"run_id": run_id, "status": "completed", "result": {"ok": True},
                      "error": None}
    assert took < 5
    r = http.get(f"/v1/api/runs/{run_id}/result", params={"wait_ms": "-5"})
    assert r.status_code == 400 and r.json()["field"] == "wait_ms"


# --------------------------------------------------------------------------- signal and cancel


def test_signal_completes_a_wait(http: httpx.Client) -> None:
    name = unique()
    Worker(http, [wait_def(name)])
    run_id = start_run(http, name)
    status = http.get(f"/v1/api/runs/{run_id}").json()
    assert status["status"] == "waiting" and status["waiting_for"] == "approved"
    r = http.post(f"/v1/api/runs/{run_id}/signal", json={"name": "approved", "payload": {"by": "x"}})
    assert r.status_code == 200 and r.json() == {}
    result = wait_result(http, run_id)
    assert result["status"] == "completed" and result["result"] == {"by": "x"}
    r = http.post(f"/v1/api/runs/{run_id}/signal", json={"name": "approved"})
    assert r.status_code == 409 and r.json()["reason"] == "run_terminal"
    for body, field in (({}, "name"), ({"name": ""}, "name"), ({"name": "a", "x": 1}, "x")):
        r = http.post(f"/v1/api/runs/{run_id}/signal", json=body)
        assert r.status_code == 400 and r.json()["field"] == field


def test_signal_refused_by_a_budget_names_it(http: httpx.Client) -> None:
    name = unique()
    Worker(http, [wait_def(name, max_state_bytes=64)])
    run_id = start_run(http, name)
    r = http.post(f"/v1/api/runs/{run_id}/signal",
                  json={"name": "approved", "payload": "x" * 500})
    assert r.status_code == 409, r.text
    body = r.json()
    assert body["error"] == "conflict" and body["reason"] == "budget_exceeded"
    assert body["budget"] == "max_state_bytes" and body["message"]
    assert http.get(f"/v1/api/runs/{run_id}").json()["status"] == "waiting"  # keeps waiting
    r = http.post(f"/v1/api/runs/{run_id}/signal", json={"name": "approved", "payload": 1})
    assert r.status_code == 200
    assert wait_result(http, run_id)["status"] == "completed"


def test_cancel_makes_outstanding_leases_run_terminal(http: httpx.Client) -> None:
    name = unique()
    w = Worker(http, [task_def(name, "a")])
    run_id = start_run(http, name)
    lease = w.claim_one(run_id=run_id)
    w.call(lease["lease_id"], "started")
    r = http.post(f"/v1/api/runs/{run_id}/cancel")  # the body may be omitted
    assert r.status_code == 200 and r.json() == {}
    r = w.call(lease["lease_id"], "heartbeat")
    assert r.status_code == 409 and r.json()["reason"] == "run_terminal"
    result = wait_result(http, run_id)
    assert result["status"] == "cancelled" and result["error"]["reason"] == "cancelled"
    assert "run_cancelled" in journal_types(http, run_id)
    r = http.post(f"/v1/api/runs/{run_id}/cancel")
    assert r.status_code == 409 and r.json()["reason"] == "run_terminal"
    r = http.post(f"/v1/api/runs/{run_id}/cancel", json={"why": "x"})
    assert r.status_code == 400 and r.json()["field"] == "why"


# --------------------------------------------------------------------------- bodies


def test_malformed_json_is_400_naming_the_problem(http: httpx.Client) -> None:
    for raw in (b'{"workflow": ', b"[1, 2]", b"\xff\xfe", b'{"workflow": "x", "input": NaN}'):
        r = http.post("/v1/api/runs", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400, (raw, r.text)
        body = r.json()
        assert body["error"] == "invalid" and body["field"] is None and body["message"]
    r = http.post("/v1/api/runs", content=b'{"workflow": ')
    assert "not valid JSON" in r.json()["message"]


def test_a_body_over_the_limit_is_413(http: httpx.Client) -> None:
    big = json.dumps({"workflow": "x", "input": "y" * 70_000}).encode()  # limit: 65536
    r = http.post("/v1/api/runs", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"] == "too_large"

    def chunks() -> Any:  # streamed without a Content-Length: counted as it arrives
        for _ in range(20):
            yield b" " * 4096

    r = http.post("/v1/api/steps/claim", content=chunks())
    assert r.status_code == 413
    r = http.post("/v1/api/runs", content=b" " * 1000 + b'{"workflow": "x"}')
    assert r.status_code == 400 and r.json()["field"] == "input"  # under the limit: parsed


# --------------------------------------------------------------------------- operations


def test_healthz_metrics_openapi(http: httpx.Client) -> None:
    r = http.get("/healthz")
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    r = http.get("/openapi.json")
    assert r.status_code == 200 and r.json()["openapi"].startswith("3.1")
    r = http.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    samples = _parse_prometheus(r.text)
    for name in ("stepd_runs", "stepd_live_leases", "stepd_waiting_claims",
                 "stepd_connected_workers", "stepd_step_schedule_to_start_seconds_count",
                 "stepd_run_to_complete_seconds_count", "stepd_commit_batch_size_count",
                 "stepd_http_requests_total"):
        assert name in samples, name
    assert samples["stepd_commit_batch_size_count"][0][1] >= 1
    assert any(labels.get("route") == "/healthz" for labels, _ in
               samples["stepd_http_requests_total"])


def test_workers_and_actors(http: httpx.Client) -> None:
    name = unique()
    w = Worker(http, [task_def(name, "a")], name="listed")
    run_id = start_run(http, name)
    lease = w.claim_one(run_id=run_id)
    workers = http.get("/v1/api/workers").json()["workers"]
    me = next(x for x in workers if x["worker_id"] == w.worker_id)
    assert me["name"] == "listed" and me["connected"] is False
    assert "last_heartbeat_at" in me and isinstance(me["leases"], list)
    tree = http.get("/v1/api/actors").json()["tree"]
    assert tree["path"] == "/" and {c["path"] for c in tree["children"]} >= {"/registry", "/runs"}
    r = http.post("/v1/api/actors/kill", json={"path": f"/runs/{run_id}"})
    assert r.status_code in (200, 404)  # the run may have passivated
    r = http.post("/v1/api/actors/kill", json={"path": "/registry"})
    assert r.status_code == 200
    # rest_for_one: the root restarts the registry and every later sibling with it.
    assert r.json() == {"path": "/registry", "restarted": [
        "/registry", "/runs", "/leases", "/timers", "/schedules", "/recovery", "/retention"]}
    r = http.post("/v1/api/actors/kill", json={"path": "/no/such/actor"})
    assert r.status_code == 404
    r = http.post("/v1/api/actors/kill", json={"path": "registry"})
    assert r.status_code == 400 and r.json()["field"] == "path"
    # The lease survives a registry restart: it completes.
    w.call(lease["lease_id"], "started")
    assert w.call(lease["lease_id"], "complete", {"output": 1}).status_code == 200
    assert wait_result(http, run_id)["status"] == "completed"


def test_workers_list_their_leases(http: httpx.Client) -> None:
    name = unique()
    w = Worker(http, [task_def(name, "a")])
    lease = w.claim_one(run_id=start_run(http, name))
    w.call(lease["lease_id"], "started")
    workers = http.get("/v1/api/workers").json()["workers"]
    me = next(x for x in workers if x["worker_id"] == w.worker_id)
    assert [x["lease_id"] for x in me["leases"]] == [lease["lease_id"]]


@pytest.mark.parametrize("path", ["/v1/api/workers/connect"])
def test_the_websocket_path_wants_an_upgrade(http: httpx.Client, path: str) -> None:
    assert http.get(path).status_code == 426


def _parse_prometheus(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """A strict-enough parser of the text format: every sample line must parse."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    line_re = re.compile(r'([a-zA-Z_:][a-zA-Z0-9_:]*)(\{((?:[^"}]|"(?:[^"\\]|\\.)*")*)\})? (\S+)')
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = line_re.fullmatch(line)
        assert m, line
        labels = dict(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"', m.group(3) or ""))
        value = m.group(4)
        out.setdefault(m.group(1), []).append(
            (labels, float("inf") if value == "+Inf" else float(value)))
    return out
