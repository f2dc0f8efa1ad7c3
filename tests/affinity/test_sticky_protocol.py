"""Sticky execution on the wire, by a worker written against the protocol alone (raw HTTP
against a real ``stepd serve``; docs/affinity.md "Sticky execution").

The lease's ``sticky`` part (full, then delta), ``GET /v1/api/steps/{lease}/history``
fenced to its lease, and the protocol boundary: a completion's sticky cursor
that names another build, another history or comes from a worker that did not
negotiate sticky execution is a 400 naming the field, and nothing is applied.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from stepd.sansio.sticky import view_hash
from tests.sdk.conftest import unique
from tests.transport.conftest import DaemonProcess, Worker, start_run, task_def, wait_result

pytestmark = pytest.mark.timeout(60)

MANIFEST = {"local_steps": {"status": "rejected"}, "sessions": {"status": "rejected"},
            "sticky": {"status": "supported", "capacity": 4, "schedule_ms": 2000}}


@pytest.fixture
def http(daemon: DaemonProcess) -> Iterator[httpx.Client]:
    with daemon.client() as c:
        yield c


def sticky_worker(http: httpx.Client, defs: list[dict[str, Any]], build: str = "b1",
                  **extra: Any) -> Worker:
    return Worker(http, defs, protocol_version="1.20", capabilities=["sticky"],
                  manifest=MANIFEST, build_id=build, **extra)


def report(lease: dict[str, Any], build: str | None = "b1", **change: Any) -> dict[str, Any]:
    """The sticky fields of a complete body: the cursor cached for `lease`, and counts."""
    cursor = {**lease["sticky"]["cursor"], "build_id": build, **change}
    return {"sticky_cursor": cursor, "sticky_stats": {"hit": 0, "miss": 1}}


def complete(http: httpx.Client, lease: dict[str, Any], body: dict[str, Any]) -> httpx.Response:
    return http.post(f"/v1/api/steps/{lease['lease_id']}/complete", json=body)


def test_full_then_delta_then_history(http: httpx.Client) -> None:
    name = unique()
    w = sticky_worker(http, [task_def(name, "a", "b", "c")])
    run = start_run(http, name, {"n": 1})
    (first,) = w.claim(wait_ms=2000)
    s = first["sticky"]
    assert s["mode"] == "full" and first["steps"] == {} and first["state"] == {}
    assert s["cursor"]["hash"] == view_hash({}, {}) and s["cursor"]["build_id"] == "b1"
    assert s["cursor"]["workflow"] == name and s["cursor"]["run_id"] == run
    r = complete(http, first, {"output": {"a": 1}, "state_patch": {"big": "x" * 100},
                               **report(first)})
    assert r.status_code == 200, r.text

    (second,) = w.claim(wait_ms=2000)
    s2 = second["sticky"]
    assert s2["mode"] == "delta" and "steps" not in second and "state" not in second
    assert s2["base"] == {**s["cursor"], "build_id": "b1"}
    assert s2["steps"] == {"a": {"a": 1}} and s2["state"] == {"big": "x" * 100}
    assert s2["cursor"]["hash"] == view_hash({"a": {"a": 1}}, {"big": "x" * 100})
    # The full history, fenced to this live lease.
    h = http.get(f"/v1/api/steps/{second['lease_id']}/history")
    assert h.status_code == 200, h.text
    assert h.json() == {"cursor": {k: s2["cursor"][k] for k in ("seq", "hash", "workflow",
                                                                 "run_id")},
                        "steps": {"a": {"a": 1}}, "state": {"big": "x" * 100}}
    r = complete(http, second, {"output": {"b": 2}, **report(second)})
    assert r.status_code == 200, r.text
    # Over: already applied; an unknown lease: 404.
    h = http.get(f"/v1/api/steps/{second['lease_id']}/history")
    assert h.status_code == 409 and h.json()["reason"] == "already_applied"
    assert http.get("/v1/api/steps/l_NOSUCHLEASE/history").status_code == 404

    (third,) = w.claim(wait_ms=2000)
    assert third["sticky"]["steps"] == {"b": {"b": 2}} and third["sticky"]["state"] == {}
    assert complete(http, third, {"output": 3, "sticky_cursor": None}).status_code == 200
    assert wait_result(http, run)["status"] == "completed"


def test_a_cursor_that_does_not_match_is_refused_whole(http: httpx.Client) -> None:
    name = unique()
    w = sticky_worker(http, [task_def(name, "a", "b")])
    run = start_run(http, name, None)
    (lease,) = w.claim(wait_ms=2000)
    cases = [
        # The run machine: not the history this lease was issued with.
        (report(lease, hash="1" * 64), "sticky_cursor"),
        (report(lease, seq=lease["sticky"]["cursor"]["seq"] + 5), "sticky_cursor"),
        # The capability gate: the exact cache identity of the lease.
        (report(lease, build="b2"), "sticky_cursor.build_id"),
        (report(lease, run_id="r_SOMEOTHERRUN"), "sticky_cursor.run_id"),
        (report(lease, workflow="another"), "sticky_cursor.workflow"),
        # The transport parser.
        (report(lease, hash="not-hex"), "sticky_cursor.hash"),
        ({"sticky_stats": {"hits": 1}}, "sticky_stats.hits"),
    ]
    for sticky, field in cases:
        r = complete(http, lease, {"output": {"a": 1}, **sticky})
        assert r.status_code == 400, (sticky, r.text)
        assert r.json()["field"] == field, r.text
    # Nothing was applied: the lease is still live and completes.
    events = http.get(f"/v1/api/runs/{run}/journal").json()["events"]
    assert [e["type"] for e in events].count("step_completed") == 0
    assert complete(http, lease, {"output": {"a": 1}, **report(lease)}).status_code == 200


def test_sticky_data_from_a_worker_that_did_not_negotiate_it_is_400(http: httpx.Client) -> None:
    name = unique()
    plain = Worker(http, [task_def(name, "a")])  # protocol 1.0, no capabilities
    start_run(http, name, None)
    (lease,) = plain.claim(wait_ms=2000)
    assert "sticky" not in lease and lease["steps"] == {} and lease["state"] == {}
    cursor = {"seq": 1, "hash": "0" * 64, "workflow": name, "run_id": lease["run_id"],
              "build_id": None}
    r = complete(http, lease, {"output": 1, "sticky_cursor": cursor})
    assert r.status_code == 400 and r.json()["field"] == "sticky_cursor", r.text
    r = complete(http, lease, {"output": 1, "sticky_stats": {"hit": 1}})
    assert r.status_code == 400 and r.json()["field"] == "sticky_stats", r.text
    assert complete(http, lease, {"output": 1}).status_code == 200


def test_manifest_sticky_settings_are_checked(http: httpx.Client) -> None:
    bad = {**MANIFEST, "sticky": {"status": "supported", "schedule_ms": -1}}
    r = http.post("/v1/api/workers/register", json={
        "definitions": [], "protocol_version": "1.20", "capabilities": ["sticky"],
        "manifest": bad})
    assert r.status_code == 400 and r.json()["field"] == "manifest.sticky.schedule_ms", r.text
    bad = {**MANIFEST, "sticky": {"status": "supported", "colour": "red"}}
    r = http.post("/v1/api/workers/register", json={
        "definitions": [], "protocol_version": "1.20", "capabilities": ["sticky"],
        "manifest": bad})
    assert r.status_code == 400 and r.json()["field"] == "manifest.sticky.colour", r.text


def test_another_workers_lease_history_is_unknown_to_its_connection(
        daemon: DaemonProcess) -> None:
    """Over the WebSocket the connection's worker is known: another's lease is a 404."""
    import msgpack
    from websockets.sync.client import connect

    name = unique()
    with daemon.client() as http:
        owner = sticky_worker(http, [task_def(name, "a")])
        start_run(http, name, None)
        (lease,) = owner.claim(wait_ms=2000)
        with connect(daemon.ws_url, subprotocols=["stepd.v1.msgpack"]) as ws:  # type: ignore[list-item]
            ws.send(msgpack.packb({"op": "register", "id": 1, "definitions": []}))
            assert msgpack.unpackb(ws.recv(timeout=10))["op"] == "registered"
            ws.send(msgpack.packb({"op": "history", "id": 2, "lease_id": lease["lease_id"]}))
            answer = msgpack.unpackb(ws.recv(timeout=10))
            assert answer["op"] == "error" and answer["status"] == 404, answer
