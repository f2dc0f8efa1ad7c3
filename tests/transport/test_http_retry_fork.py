"""Retry, fork and the cancel reason over HTTP against a real ``stepd serve``.

A raw HTTP worker (no SDK) drives the runs. The retry test SIGKILLs the
daemon right after the retry's 200 and starts another on the same data
directory: the retried step must be offered there (acknowledged means on
record). The audit log of a keyed daemon holds the retry and the fork.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from .conftest import (
    KEYS,
    DaemonProcess,
    Worker,
    start_daemon,
    start_run,
    task_def,
    unique,
    wait_result,
)

MISSING = "r_01JDV5Z8Q3X4M6N7P8R9S0T1U2"


def complete(w: Worker, lease: dict[str, Any], output: Any = None,
             patch: dict[str, Any] | None = None) -> None:
    assert w.call(lease["lease_id"], "started").status_code == 200
    body: dict[str, Any] = {"output": output}
    if patch is not None:
        body["state_patch"] = patch
    r = w.call(lease["lease_id"], "complete", body)
    assert r.status_code == 200, r.text


def fail(w: Worker, lease: dict[str, Any]) -> None:
    assert w.call(lease["lease_id"], "started").status_code == 200
    r = w.call(lease["lease_id"], "fail", {"error": {"class": "fatal", "message": "db down"}})
    assert r.status_code == 200, r.text


def journal(c: httpx.Client, run_id: str) -> list[dict[str, Any]]:
    r = c.get(f"/v1/api/runs/{run_id}/journal")
    assert r.status_code == 200, r.text
    return list(r.json()["events"])


def test_a_retry_answered_200_survives_a_sigkill(tmp_path: Path) -> None:
    data = tmp_path / "data"
    d = start_daemon(data, "--max-request-ms", "2000")
    name = unique("retry")
    definition = task_def(name, "a", "b")
    try:
        with d.client() as c:
            w = Worker(c, [definition])
            run_id = start_run(c, name, {"x": 1})
            r = c.post(f"/v1/api/runs/{run_id}/retry")
            assert r.status_code == 409 and r.json()["reason"] == "not_retryable", r.text
            assert "is running" in r.json()["message"]
            complete(w, w.claim_one(run_id=run_id), {"n": 1})
            fail(w, w.claim_one(run_id=run_id))
            assert wait_result(c, run_id)["status"] == "failed"
            r = c.post(f"/v1/api/runs/{run_id}/retry", json={"step": "a"})
            assert r.status_code == 400 and r.json()["field"] == "step", r.text
            r = c.post(f"/v1/api/runs/{MISSING}/retry")
            assert r.status_code == 404, r.text
            r = c.post(f"/v1/api/runs/{run_id}/retry")
            assert r.status_code == 200, r.text
            assert r.json() == {"run_id": run_id, "status": "running", "step_id": "b"}
        os.kill(d.pid, signal.SIGKILL)
        d.proc.wait(15)
        d = start_daemon(data, "--max-request-ms", "2000")
        with d.client() as c:
            assert c.get(f"/v1/api/runs/{run_id}").json()["status"] == "running"
            w = Worker(c, [definition])
            lease = w.claim_one(run_id=run_id)
            assert (lease["step_id"], lease["attempt"], lease["steps"]) == ("b", 1, {"a": {"n": 1}})
            complete(w, lease, "done")
            assert wait_result(c, run_id) == {"run_id": run_id, "status": "completed",
                                              "result": "done", "error": None}
            types = [e["type"] for e in journal(c, run_id)]
            assert types.count("run_retried") == 1
            assert types.index("run_failed") < types.index("run_retried")
    finally:
        assert d.stop() == 0, d.stderr()


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    args: list[str] = ["--max-request-ms", "2000"]
    for scope, key in KEYS.items():
        args += [f"--{scope}-key", key]
    d = start_daemon(tmp_path_factory.mktemp("retryfork") / "data", *args)
    yield d
    assert d.stop() == 0, d.stderr()
    d.assert_quiet_log()


def test_a_fork_over_http_copies_the_history_and_links_both_ways(keyed: DaemonProcess) -> None:
    admin = {"Authorization": f"Bearer {KEYS['admin']}"}
    name = unique("fork")
    with keyed.client(KEYS["admin"]) as c:
        w = Worker(c, [task_def(name, "a", "b", "c")])
        src = start_run(c, name, {"topic": "fork"}, correlation={"t": 7})
        for step, patch in (("a", {"a": 1}), ("b", {"b": 2}), ("c", {"c": 3})):
            lease = w.claim_one(run_id=src)
            assert lease["step_id"] == step
            complete(w, lease, step.upper(), patch)
        assert wait_result(c, src)["status"] == "completed"
        for body, field in (({"from_step": "zz"}, "from_step"), ({}, "from_step"),
                            ({"from_step": "a", "extra": 1}, "extra"),
                            ({"from_step": "a", "idempotency_key": ""}, "idempotency_key")):
            r = c.post(f"/v1/api/runs/{src}/fork", json=body)
            assert r.status_code == 400 and r.json()["field"] == field, (body, r.text)
        r = c.post(f"/v1/api/runs/{MISSING}/fork", json={"from_step": "a"})
        assert r.status_code == 404, r.text
        r = c.post(f"/v1/api/runs/{src}/fork", json={"from_step": "b", "idempotency_key": name})
        assert r.status_code == 201, r.text
        fork = r.json()["run_id"]
        assert r.json() == {"run_id": fork, "created": True,
                            "forked_from": {"run_id": src, "step_id": "b"}}
        again = c.post(f"/v1/api/runs/{src}/fork", json={"from_step": "b", "idempotency_key": name})
        assert again.status_code == 200 and again.json()["run_id"] == fork
        source_events, fork_events = journal(c, src), journal(c, fork)
        cut = next(e["seq"] for e in fork_events if e["type"] == "run_forked") - 1
        assert fork_events[:cut] == source_events[:cut]
        lease = w.claim_one(run_id=fork)
        assert lease["step_id"] == "c" and lease["steps"] == {"a": "A", "b": "B"}
        assert lease["state"] == {"a": 1, "b": 2}
        complete(w, lease, "C2")
        assert wait_result(c, fork)["result"] == "C2"
        status = c.get(f"/v1/api/runs/{fork}").json()
        assert status["forked_from"] == {"run_id": src, "step_id": "b"}
        assert status["correlation"] == {"t": 7} and status["forks"] == []
        assert c.get(f"/v1/api/runs/{src}").json()["forks"] == [{"run_id": fork, "step_id": "b"}]
        exported = c.get(f"/v1/api/runs/{src}/export").json()
        assert exported["input"] == {"topic": "fork"} and exported["result"] == "C"
        assert exported["forks"] == [{"run_id": fork, "step_id": "b"}]
        assert c.get(f"/v1/api/runs/{fork}/export").json()["forked_from"]["run_id"] == src
        # A run failed on a budget: 409 naming it.
        pricey = unique("pricey")
        wp = Worker(c, [{"name": pricey, "budgets": {"max_transitions": 1}, "steps": [
            {"id": "a", "kind": "task", "body": "a"}, {"id": "b", "kind": "task", "body": "b"}]}])
        run = start_run(c, pricey)
        complete(wp, wp.claim_one(run_id=run))
        complete(wp, wp.claim_one(run_id=run))
        assert wait_result(c, run)["error"]["reason"] == "budget_exceeded"
        r = c.post(f"/v1/api/runs/{run}/retry", json={})
        assert r.status_code == 409, r.text
        assert r.json()["reason"] == "not_retryable" and r.json()["budget"] == "max_transitions"
        entries = c.get("/v1/api/audit", params={"limit": 1000}, headers=admin).json()["entries"]
    mine = [(e["action"], e["target"], e["status"]) for e in entries
            if e["action"] in ("runs.retry", "runs.fork")]
    assert ("runs.fork", fork, 201) in mine and ("runs.fork", fork, 200) in mine
    assert ("runs.fork", src, 400) in mine and ("runs.retry", run, 409) in mine


def test_cancel_takes_a_reason(keyed: DaemonProcess) -> None:
    name = unique("cancel")
    with keyed.client(KEYS["execute"]) as c:
        with keyed.client(KEYS["worker"]) as wc:
            Worker(wc, [task_def(name, "a")])
        run_id = start_run(c, name)
        for body in ({"reason": ""}, {"reason": 3}, {"reason": "x" * 1001}):
            r = c.post(f"/v1/api/runs/{run_id}/cancel", json=body)
            assert r.status_code == 400 and r.json()["field"] == "reason", (body, r.text)
        r = c.post(f"/v1/api/runs/{run_id}/cancel", json={"reason": "wrong customer"})
        assert r.status_code == 200, r.text
    with keyed.client(KEYS["read"]) as c:
        view = c.get(f"/v1/api/runs/{run_id}").json()
        assert view["status"] == "cancelled"
        assert view["error"] == {"reason": "cancelled", "message": "wrong customer",
                                 "step_id": "a"}
        assert journal(c, run_id)[-1]["error"]["message"] == "wrong customer"
