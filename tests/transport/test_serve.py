"""``python -m stepd serve`` as a process: flags, environment, the staged SIGTERM shutdown, restart.

STYLE.md rule 22: on SIGTERM the daemon answers 503, stops handing out
leases (a held claim ends with 503), closes WebSockets with 1001, waits for
calls in flight up to the grace period, and exits 0 with its data intact; a
second SIGTERM cuts the grace period short.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx
import pytest
from websockets.exceptions import ConnectionClosed

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


def _stall_a_request(d: DaemonProcess) -> socket.socket:
    """Open a request whose body never finishes arriving: a call in flight."""
    url = urlparse(d.url)
    sock = socket.create_connection((url.hostname, url.port), timeout=5)
    sock.sendall(b"POST /v1/api/runs HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 100\r\n\r\n{\"workflow\": ")
    return sock


def _wait_503(client: httpx.Client, deadline_s: float = 5.0) -> None:
    deadline = time.monotonic() + deadline_s
    while True:
        r = client.get("/healthz")
        if r.status_code == 503:
            assert r.json()["error"] == "unavailable"
            return
        assert time.monotonic() < deadline, r.text
        time.sleep(0.01)


def test_sigterm_shuts_down_in_stages(tmp_path: Path) -> None:
    d = start_daemon(tmp_path / "data", "--shutdown-grace-ms", "1500", "--max-request-ms", "20000")
    try:
        name = unique()
        with d.client() as http, ws_connect(d) as conn:
            w = Worker(http, [task_def(name, "a")])
            ws = WsWorker(conn)
            ws.request("register", definitions=[task_def(unique(), "b")])
            claimed: list[Any] = []

            def claim() -> None:
                with d.client(timeout=15) as c:
                    claimed.append(c.post("/v1/api/steps/claim",
                                          json={"worker_id": w.worker_id, "wait_ms": 15_000}))

            t = threading.Thread(target=claim)
            t.start()
            stalled = _stall_a_request(d)
            time.sleep(0.2)  # the claim is parked, the stalled request is in flight
            t0 = time.monotonic()
            os.kill(d.pid, signal.SIGTERM)
            # Stage 1: every new request answers 503 while the stalled call holds the drain.
            _wait_503(http)
            r = http.post("/v1/api/runs", json={"workflow": name, "input": 1})
            assert r.status_code == 503
            # Stage 2: the held claim ends at once with 503 (no lease handed out).
            t.join(5)
            assert claimed and claimed[0].status_code == 503, claimed
            # Stage 3: the WebSocket is closed with 1001.
            with pytest.raises(ConnectionClosed) as info:
                for _ in range(10):
                    conn.recv(timeout=5)
            assert info.value.rcvd is not None and info.value.rcvd.code == 1001
            # Stage 4-5: the grace period (1.5 s) runs out for the stalled call; exit 0.
            assert d.proc.wait(timeout=10) == 0, d.stderr()
            took = time.monotonic() - t0
            assert 1.4 <= took < 6, took
            stalled.close()
    finally:
        d.stop()


def test_a_second_sigterm_cuts_the_grace_short(tmp_path: Path) -> None:
    d = start_daemon(tmp_path / "data", "--shutdown-grace-ms", "30000")
    try:
        stalled = _stall_a_request(d)
        with d.client() as http:
            assert http.get("/healthz").status_code == 200
            os.kill(d.pid, signal.SIGTERM)
            _wait_503(http)
        t0 = time.monotonic()
        os.kill(d.pid, signal.SIGTERM)
        assert d.proc.wait(timeout=10) == 0, d.stderr()
        assert time.monotonic() - t0 < 5
        stalled.close()
    finally:
        d.stop()


def test_data_is_intact_after_a_staged_shutdown(tmp_path: Path) -> None:
    data = tmp_path / "data"
    d = start_daemon(data)
    name, waiting = unique(), unique()
    defs = [task_def(name, "a"),
            {"name": waiting, "steps": [{"id": "w", "kind": "wait", "event": "go"}]}]
    try:
        with d.client() as http:
            w = Worker(http, defs)
            done = start_run(http, name, {"n": 1}, idempotency_key="k-done")
            lease = w.claim_one(run_id=done)
            w.call(lease["lease_id"], "started")
            w.call(lease["lease_id"], "complete", {"output": {"n": 2}})
            assert wait_result(http, done)["status"] == "completed"
            parked = start_run(http, waiting)
            journal = http.get(f"/v1/api/runs/{done}/journal").json()
        assert d.stop() == 0, d.stderr()
    finally:
        d.stop()
    again = start_daemon(data)
    try:
        with again.client() as http:
            assert http.get(f"/v1/api/runs/{done}/result").json()["result"] == {"n": 2}
            assert http.get(f"/v1/api/runs/{done}/journal").json() == journal
            r = http.post("/v1/api/runs", json={"workflow": name, "input": 9,
                                                "idempotency_key": "k-done"})
            assert r.status_code == 200 and r.json() == {"run_id": done, "created": False}
            assert http.get(f"/v1/api/runs/{parked}").json()["status"] == "waiting"
            assert http.post(f"/v1/api/runs/{parked}/signal", json={"name": "go"}).status_code \
                == 200
            assert wait_result(http, parked)["status"] == "completed"
            assert "run_completed" in journal_types(http, parked)
    finally:
        assert again.stop() == 0, again.stderr()
    again.assert_quiet_log()


def test_no_keys_means_loopback_only(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "stepd", "serve", "--data", str(tmp_path / "d"), "--host",
         "0.0.0.0", "--port", "0"],
        capture_output=True, text=True, timeout=30, check=False,
        env={k: v for k, v in os.environ.items() if not k.startswith("STEPD_")},
    )
    assert proc.returncode == 2, proc
    assert "refusing to listen" in proc.stderr and "0.0.0.0" in proc.stderr


def test_flags_from_the_environment_and_a_price_book(tmp_path: Path) -> None:
    prices = tmp_path / "prices.toml"
    prices.write_text('[models."m-1"]\ninput_per_million = 1000.0\noutput_per_million = 2000.0\n')
    env = {
        "STEPD_WORKER_KEY": "wk-one-123456, wk-two-123456",
        "STEPD_EXECUTE_KEY": "ex-key-123456",
        "STEPD_MAX_REQUEST_MS": "1500",
        "STEPD_LEASE_TTL_MS": "20000",
        "STEPD_HEARTBEAT_MS": "5000",
        "STEPD_PRICES": str(prices),
    }
    d = start_daemon(tmp_path / "data", env=env)
    try:
        name = unique()
        with d.client("wk-two-123456") as worker, d.client("ex-key-123456") as client:
            w = Worker(worker, [task_def(name, "a")])
            assert w.registered["max_request_ms"] == 1500
            assert w.registered["lease_ttl_ms"] == 20_000 and w.registered["heartbeat_ms"] == 5000
            run_id = start_run(client, name)
            lease = w.claim_one(run_id=run_id)
            w.call(lease["lease_id"], "started")
            r = w.call(lease["lease_id"], "complete", {
                "output": 1, "usage": {"model": "m-1", "input_tokens": 1000,
                                       "output_tokens": 1000}})
            assert r.status_code == 200, r.text
            status = client.get(f"/v1/api/runs/{run_id}").json()
            assert status["usage"]["cost_usd"] == pytest.approx(3.0)
            assert worker.post("/v1/api/runs", json={"workflow": name, "input": 1}).status_code \
                == 403  # a worker key cannot start a run
        with d.client("wk-three") as nobody:
            assert nobody.post("/v1/api/steps/claim", json={}).status_code == 401
    finally:
        assert d.stop() == 0, d.stderr()
    d.assert_quiet_log()


def test_a_taken_port_is_a_startup_error(daemon: DaemonProcess, tmp_path: Path) -> None:
    port = str(urlparse(daemon.url).port)
    proc = subprocess.run(
        [sys.executable, "-m", "stepd", "serve", "--data", str(tmp_path / "d"), "--port", port],
        capture_output=True, text=True, timeout=30, check=False,
        env={k: v for k, v in os.environ.items() if not k.startswith("STEPD_")},
    )
    assert proc.returncode == 1, proc
    assert "cannot listen" in proc.stderr
