"""Keys, scopes and the audit log, over HTTP and the WebSocket handshake, against a real daemon.

The daemon has one key per scope (``admin``, ``write``, ``worker``, ``execute``,
``read``): with every scope configured, each group accepts its own scope and
``admin`` only (``write`` then holds nothing: its fallback applies only where a
group has no key of its own; docs/http-api.md). Every endpoint is called with
every key, no key, an unknown key and a malformed header; then the audit log
must hold exactly one entry per audited call made with a known key (403s
included, 401s and worker calls not).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.exceptions import InvalidStatus

from stepd.transport.auth import key_id

from .conftest import KEYS, DaemonProcess, start_daemon, task_def, unique, ws_connect

RUN = "r_01JDV5Z8Q3X4M6N7P8R9S0T1U2"  # names no run: allowed calls get 404
LEASE = "l_01JDV5Z8Q3X4M6N7P8R9S0T1U2"

# (group, method, path, body, audit action or None, audit target)
ENDPOINTS: list[tuple[str, str, str, Any, str | None, str | None]] = [
    ("worker", "POST", "/v1/api/workers/register", {}, None, None),
    ("worker", "POST", "/v1/api/steps/claim", {}, None, None),
    ("worker", "POST", f"/v1/api/steps/{LEASE}/started", {}, None, None),
    ("worker", "POST", f"/v1/api/steps/{LEASE}/heartbeat", {}, None, None),
    ("worker", "POST", f"/v1/api/steps/{LEASE}/complete", {}, None, None),
    ("worker", "POST", f"/v1/api/steps/{LEASE}/fail", {"error": {"class": "x"}}, None, None),
    ("execute", "POST", "/v1/api/runs", {"workflow": "nobody-registered-this", "input": 1},
     "runs.start", None),
    ("execute", "POST", f"/v1/api/runs/{RUN}/signal", {"name": "x"}, "runs.signal", RUN),
    ("execute", "POST", f"/v1/api/runs/{RUN}/cancel", {}, "runs.cancel", RUN),
    ("execute", "POST", f"/v1/api/runs/{RUN}/retry", {}, "runs.retry", RUN),
    ("execute", "POST", f"/v1/api/runs/{RUN}/fork", {"from_step": "a"}, "runs.fork", RUN),
    ("read", "GET", "/v1/api/runs", None, "runs.list", None),
    ("read", "GET", f"/v1/api/runs/{RUN}", None, "runs.read", RUN),
    ("read", "GET", f"/v1/api/runs/{RUN}/journal", None, "runs.journal", RUN),
    ("read", "GET", f"/v1/api/runs/{RUN}/export", None, "runs.export", RUN),
    ("read", "GET", f"/v1/api/runs/{RUN}/result", None, "runs.result", RUN),
    ("read", "GET", "/v1/api/workers", None, "workers.read", None),
    ("admin", "GET", "/v1/api/audit", None, "audit.read", None),
    ("admin", "GET", "/v1/api/actors", None, "actors.read", None),
    ("admin", "POST", "/v1/api/actors/kill", {"path": "/no/such/actor"}, "actors.kill",
     "/no/such/actor"),
]


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    """A daemon of its own, so the audit log holds only what this module did."""
    args: list[str] = []
    for scope, key in KEYS.items():
        args += [f"--{scope}-key", key]
    d = start_daemon(tmp_path_factory.mktemp("audit") / "data", *args)
    yield d
    assert d.stop() == 0, d.stderr()
    d.assert_quiet_log()


def _call(client: httpx.Client, method: str, path: str, body: Any,
          headers: dict[str, str]) -> httpx.Response:
    return client.request(method, path, json=body, headers=headers)


def test_the_auth_matrix_and_its_audit_log(keyed: DaemonProcess) -> None:
    expected: Counter[tuple[Any, ...]] = Counter()
    with keyed.client() as c:
        for group, method, path, body, action, target in ENDPOINTS:
            # No key, an unknown key, a malformed header: 401, never audited.
            for headers, error in (({}, None), ({"Authorization": "Bearer nobody-has-this"},
                                                "invalid_token"),
                                   ({"Authorization": "Basic abc"}, "invalid_request")):
                r = _call(c, method, path, body, headers)
                assert r.status_code == 401, (path, headers, r.text)
                assert r.json()["error"] == "unauthorized"
                www = r.headers["www-authenticate"]
                assert www.startswith('Bearer realm="stepd"')
                assert (error is None) == ("error=" not in www) and (error or "") in www
            for scope, key in KEYS.items():
                r = _call(c, method, path, body, {"Authorization": f"Bearer {key}"})
                allowed = scope in (group, "admin")
                if allowed:
                    assert r.status_code not in (401, 403), (scope, path, r.text)
                else:
                    assert r.status_code == 403, (scope, path, r.text)
                    assert r.json()["error"] == "forbidden"
                    assert key not in r.text  # never repeat a key
                if action is not None:
                    expected[(
                        action,
                        target if allowed else (None if path.endswith("/kill") else target),
                        key_id(key),
                        ("admin" if scope == "admin" else group) if allowed else None,
                        r.status_code,
                    )] += 1
        # Health and metrics need no key.
        assert c.get("/healthz").status_code == 200
        assert c.get("/metrics").status_code == 200

        # A whole worker flow with the worker key and a run driven with the execute key:
        # worker calls are never audited; the start and the result read are.
        wk = {"Authorization": f"Bearer {KEYS['worker']}"}
        ex = {"Authorization": f"Bearer {KEYS['execute']}"}
        rd = {"Authorization": f"Bearer {KEYS['read']}"}
        name = unique()
        wid = c.post("/v1/api/workers/register", json={"definitions": [task_def(name, "a")]},
                     headers=wk).json()["worker_id"]
        r = c.post("/v1/api/runs", json={"workflow": name, "input": 1}, headers=ex)
        assert r.status_code == 201
        run_id = r.json()["run_id"]
        expected[("runs.start", run_id, key_id(KEYS["execute"]), "execute", 201)] += 1
        lease = c.post("/v1/api/steps/claim", json={"worker_id": wid, "wait_ms": 1000},
                       headers=wk).json()["leases"][0]
        c.post(f"/v1/api/steps/{lease['lease_id']}/started", headers=wk)
        c.post(f"/v1/api/steps/{lease['lease_id']}/complete", json={"output": 1}, headers=wk)
        r = c.get(f"/v1/api/runs/{run_id}/result", params={"wait_ms": 1000}, headers=rd)
        assert r.json()["status"] == "completed"
        expected[("runs.result", run_id, key_id(KEYS["read"]), "read", 200)] += 1

        admin = {"Authorization": f"Bearer {KEYS['admin']}"}
        total = sum(expected.values())
        entries: list[dict[str, Any]] = []
        deadline = time.monotonic() + 5  # reads are committed a few ms after their answer
        while time.monotonic() < deadline:
            page = c.get("/v1/api/audit", params={"limit": 1000}, headers=admin).json()
            entries = page["entries"]
            if len(entries) >= total:
                break
            time.sleep(0.02)
        # The admin's own audit reads above were audited too (one per loop turn).
        reads = [e for e in entries if e["action"] == "audit.read" and e["status"] == 200
                 and e["key_id"] == key_id(KEYS["admin"])]
        admin_reads_in_matrix = expected[("audit.read", None, key_id(KEYS["admin"]), "admin", 200)]
        extra = len(reads) - admin_reads_in_matrix
        assert extra >= 0
        got = Counter((e["action"], e["target"], e["key_id"], e["scope"], e["status"])
                      for e in entries)
        got[("audit.read", None, key_id(KEYS["admin"]), "admin", 200)] -= extra
        assert +got == +expected
        for e in entries:
            if e["status"] == 403:
                assert e["reason"] == "insufficient_scope" and e["scope"] is None
            elif e["status"] == 404:
                assert e["reason"] == "not_found"
            elif e["status"] < 300:
                assert e["reason"] is None
            assert isinstance(e["time_ms"], int)
        # Paging: newest first, cursor back for older entries.
        first = c.get("/v1/api/audit", params={"limit": 2}, headers=admin).json()
        assert len(first["entries"]) == 2 and first["next_cursor"]
        older = c.get("/v1/api/audit", params={"limit": 2, "cursor": first["next_cursor"]},
                      headers=admin).json()
        assert older["entries"][0]["time_ms"] <= first["entries"][-1]["time_ms"]
        r = c.get("/v1/api/audit", params={"cursor": "zz"}, headers=admin)
        assert r.status_code == 400 and r.json()["field"] == "cursor"


def test_raw_keys_never_reach_the_data_directory(keyed: DaemonProcess) -> None:
    blob = b"".join(p.read_bytes() for p in Path(keyed.data).rglob("*") if p.is_file())
    for key in KEYS.values():
        assert key.encode() not in blob
    assert all(key not in keyed.stderr() for key in KEYS.values())


def test_the_websocket_handshake_is_authorized(auth_daemon: DaemonProcess) -> None:
    for key, status in ((None, 401), ("nobody-has-this", 401), (KEYS["execute"], 403),
                        (KEYS["read"], 403), (KEYS["write"], 403)):
        with pytest.raises(InvalidStatus) as info:
            ws_connect(auth_daemon, key=key)
        assert info.value.response.status_code == status, key
    for key in (KEYS["worker"], KEYS["admin"]):
        with ws_connect(auth_daemon, key=key) as conn:
            assert conn.subprotocol == "stepd.v1.msgpack"


def test_a_keyless_daemon_refuses_what_a_web_page_could_send(daemon: DaemonProcess) -> None:
    """Without keys, a cross-site page (Origin) or a DNS-rebinding page (Host) is refused."""
    from websockets.sync.client import connect

    with daemon.client() as c:
        for headers in ({"Origin": "http://evil.example"}, {"Host": "evil.example"},
                        {"Host": "evil.example:80"}):
            r = c.post(f"/v1/api/runs/{RUN}/cancel", headers=headers)
            assert r.status_code == 403 and r.json()["error"] == "forbidden", headers
            assert c.get("/v1/api/runs", headers=headers).status_code == 403
        for host in ("localhost", "127.0.0.1:1", "[::1]:7707", "127.1.2.3"):
            assert c.get("/v1/api/runs", headers={"Host": host}).status_code == 200, host
        assert c.get("/healthz", headers={"Origin": "http://evil.example"}).status_code == 200
        # The daemon's own pages (the console) are same-origin: allowed; another port or
        # scheme on the same host is another origin: refused.
        here = daemon.url.removeprefix("http://")
        assert c.get("/v1/api/runs", headers={"Origin": f"http://{here}"}).status_code == 200
        port = int(here.rsplit(":", 1)[1])
        for other in (f"http://127.0.0.1:{port + 1}", f"https://{here}", "null"):
            assert c.get("/v1/api/runs", headers={"Origin": other}).status_code == 403, other
    with pytest.raises(InvalidStatus) as info:
        connect(daemon.ws_url, subprotocols=["stepd.v1.msgpack"],  # type: ignore[list-item]
                origin="http://evil.example", proxy=None, open_timeout=5)  # type: ignore[arg-type]
    assert info.value.response.status_code == 403


def test_with_keys_an_origin_header_is_no_reason_to_refuse(auth_daemon: DaemonProcess) -> None:
    with auth_daemon.client(KEYS["read"]) as c:
        r = c.get("/v1/api/runs", headers={"Origin": "http://dashboard.example"})
        assert r.status_code == 200
