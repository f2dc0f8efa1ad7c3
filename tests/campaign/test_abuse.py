"""Abuse campaign: slowloris and a WebSocket connection flood against a real ``stepd serve``.

Two campaigns, each against its own daemon, each measuring ``GET /healthz``
while it runs (a fresh connection per probe, so accepting is measured too) and
printing one summary line:

* **slowloris**: 200 connections (``STEPD_CAMPAIGN_SLOWLORIS_CONNS``) send a
  request head one byte a second and never finish it. The daemon must close
  every one of them itself, at its request deadline (``--max-request-ms``,
  docs/serve.md "Limits"), before the test's own bound::

      ABUSE slowloris conns=200 healthz_p99_ms=... closed_by_daemon=200

* **ws_flood**: 500 WebSocket connections (``STEPD_CAMPAIGN_WS_FLOOD_CONNS``)
  opened at once, each registering a worker, all held open together for 2 s,
  then closed together::

      ABUSE ws_flood conns=500 healthz_p99_ms=... registered=500 ...

What is asserted are outcomes, never times: every probe answered 200, every
slow connection closed by the daemon (not by the test), every flood
connection registered, the daemon's connections released afterwards (the
``stepd_connected_workers`` gauge back to 0, RSS near where it started) and a
worker still served end to end (a run started, leased, completed). The p99 is
printed, not asserted.

Run: ``STEPD_CAMPAIGN=1 python -m pytest -q tests/campaign/test_abuse.py``.
"""

from __future__ import annotations

import asyncio
import os
import selectors
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Self

import httpx
import msgpack
import pytest

from tests.transport.conftest import (
    DaemonProcess,
    WsWorker,
    start_daemon,
    task_def,
    unique,
    wait_result,
    ws_connect,
)

SLOWLORIS_CONNS = int(os.environ.get("STEPD_CAMPAIGN_SLOWLORIS_CONNS", "200"))
WS_FLOOD_CONNS = int(os.environ.get("STEPD_CAMPAIGN_WS_FLOOD_CONNS", "500"))
MAX_REQUEST_MS = 5000  # the daemon's deadline in the slowloris campaign
MEMORY_MARGIN_MB = 64  # RSS after the flood, over RSS before it
HOLD_S = 2.0  # how long the flood's connections stay open together, probed


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


_PROBE = """
import sys, time, select, httpx
url, period = sys.argv[1], float(sys.argv[2])
with httpx.Client(trust_env=False, timeout=10.0, limits=httpx.Limits(max_keepalive_connections=0)) as c:
    while not select.select([sys.stdin], [], [], period)[0]:
        start = time.perf_counter()
        try:
            r = c.get(url + "/healthz")
            line = f"ok {(time.perf_counter() - start) * 1000:.3f}" if r.status_code == 200 \\
                else f"fail status {r.status_code}"
        except httpx.HTTPError as exc:
            line = f"fail {exc!r}"
        print(line, flush=True)
"""


class Probe:
    """``GET /healthz`` on a fresh connection every ``period`` s, until stopped.

    In its own process, so the campaign's clients (in this one) do not slow
    the probe down and the figure is the daemon's. Stopped by closing its
    stdin; killed by its PID if it does not stop.
    """

    def __init__(self, url: str, period: float = 0.02) -> None:
        self.url = url
        self.period = period
        self.latencies_ms: list[float] = []
        self.failures: list[str] = []
        self._proc: subprocess.Popen[str] | None = None

    def __enter__(self) -> Self:
        self._proc = subprocess.Popen([sys.executable, "-c", _PROBE, self.url, str(self.period)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        return self

    def __exit__(self, *exc: object) -> None:
        proc = self._proc
        assert proc is not None
        try:
            out, _ = proc.communicate(timeout=30)  # closes its stdin: the probe stops
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate(timeout=30)
        for line in out.splitlines():
            kind, _, rest = line.partition(" ")
            if kind == "ok":
                self.latencies_ms.append(float(rest))
            else:
                self.failures.append(rest)

    @property
    def sent(self) -> int:
        return len(self.latencies_ms) + len(self.failures)

    def p99_ms(self) -> float:
        if len(self.latencies_ms) < 2:
            return max(self.latencies_ms, default=float("nan"))
        return statistics.quantiles(self.latencies_ms, n=100)[98]


def _serves_a_worker(d: DaemonProcess) -> dict[str, Any]:
    """A run started over HTTP, leased over a WebSocket, completed: the daemon still works."""
    name = unique("abuse")
    with ws_connect(d) as conn, d.client() as http:
        w = WsWorker(conn)
        assert w.request("register", definitions=[task_def(name, "s")])["op"] == "registered"
        w.send({"op": "credit", "n": 1})
        r = http.post("/v1/api/runs", json={"workflow": name, "input": {"x": 1}})
        assert r.status_code == 201, r.text
        lease = w.wait_for("lease", timeout=30)["lease"]
        assert w.request("started", lease_id=lease["lease_id"])["op"] == "ok"
        assert w.request("complete", lease_id=lease["lease_id"], output={"ok": True})["op"] == "ok"
        return wait_result(http, r.json()["run_id"], timeout_s=30)


@pytest.fixture
def abuse_daemon(tmp_path: Path) -> Iterator[Callable[..., DaemonProcess]]:
    started: list[DaemonProcess] = []

    def start(*args: str) -> DaemonProcess:
        d = start_daemon(tmp_path / f"d{len(started)}", *args)
        started.append(d)
        return d

    yield start
    for d in started:
        assert d.stop() == 0, d.stderr()
        d.assert_quiet_log()


def test_slowloris(abuse_daemon: Callable[..., DaemonProcess],
                   summary: Callable[[str], None]) -> None:
    """200 connections sending a head a byte a second: each closed by the daemon at its deadline."""
    d = abuse_daemon("--max-request-ms", str(MAX_REQUEST_MS))
    host, port = d.url.removeprefix("http://").rsplit(":", 1)
    head = f"GET /healthz HTTP/1.1\r\nHost: {host}:{port}\r\n".encode()
    trickle = b"X-Slow: 1\r\n"
    bound_s = MAX_REQUEST_MS / 1000 * 3 + 10  # the test's own bound: far past the deadline
    sel = selectors.DefaultSelector()
    open_socks: dict[socket.socket, int] = {}
    closed_by_daemon = answered_408 = 0
    with Probe(d.url) as probe:
        for _ in range(SLOWLORIS_CONNS):
            sock = socket.create_connection((host, int(port)), timeout=10)
            sock.sendall(head)
            sock.setblocking(False)
            sel.register(sock, selectors.EVENT_READ)
            open_socks[sock] = 0
        deadline = time.monotonic() + bound_s
        next_byte = time.monotonic()
        while open_socks and time.monotonic() < deadline:  # bounded by the test's own limit
            for key, _ in sel.select(timeout=0.1):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                try:
                    data = sock.recv(65536)
                except (ConnectionResetError, BlockingIOError) as exc:
                    if isinstance(exc, BlockingIOError):
                        continue
                    data = b""
                if data.startswith(b"HTTP/1.1 408"):
                    answered_408 += 1
                if not data or b'"error":"timeout"' in data:
                    # The daemon answered 408 and shut its side, or closed: either way it ended it.
                    closed_by_daemon += 1
                    sel.unregister(sock)
                    del open_socks[sock]
                    sock.close()
            if time.monotonic() >= next_byte:  # one more header byte on every open connection
                next_byte += 1.0
                for sock, sent in list(open_socks.items()):
                    try:
                        sock.send(trickle[sent % len(trickle):sent % len(trickle) + 1])
                        open_socks[sock] = sent + 1
                    except (BlockingIOError, BrokenPipeError, ConnectionResetError):
                        pass
        still_open = len(open_socks)
        for sock in list(open_socks):
            sel.unregister(sock)
            sock.close()
        sel.close()
        result = _serves_a_worker(d)
    summary(f"ABUSE slowloris conns={SLOWLORIS_CONNS} healthz_p99_ms={probe.p99_ms():.1f} "
            f"closed_by_daemon={closed_by_daemon} answered_408={answered_408} "
            f"still_open_at_bound={still_open} healthz_ok={len(probe.latencies_ms)}/{probe.sent}")
    assert closed_by_daemon == SLOWLORIS_CONNS, (closed_by_daemon, still_open)
    assert not probe.failures, probe.failures[:5]
    assert probe.latencies_ms, "no /healthz probe ran"
    assert result["status"] == "completed", result


async def _flood(ws_url: str, n: int) -> tuple[int, int, list[str]]:
    """Open ``n`` worker WebSockets at once, register each, hold them all, close them all."""
    from websockets.asyncio.client import connect

    errors: list[str] = []
    everyone_in = asyncio.Event()
    registered = 0
    connected = 0

    async def one(i: int) -> None:
        nonlocal registered, connected
        try:
            async with connect(ws_url, subprotocols=["stepd.v1.msgpack"],  # type: ignore[list-item]
                               open_timeout=60, close_timeout=10, compression=None,
                               proxy=None) as ws:
                connected += 1
                await ws.send(msgpack.packb({"op": "register", "id": 1, "name": f"flood-{i}",
                                             "definitions": []}))
                answer = msgpack.unpackb(await asyncio.wait_for(ws.recv(), 60), raw=False)
                if answer.get("op") == "registered":
                    registered += 1
                else:
                    errors.append(repr(answer)[:200])
                if registered + len(errors) >= n:
                    everyone_in.set()
                await asyncio.wait_for(everyone_in.wait(), 120)
                await asyncio.sleep(HOLD_S)  # all held open together, then closed together
        except Exception as exc:  # noqa: BLE001 - counted and reported
            errors.append(repr(exc)[:200])
            if registered + len(errors) >= n:
                everyone_in.set()

    await asyncio.gather(*(one(i) for i in range(n)))
    return connected, registered, errors


def _connected_workers(http: httpx.Client) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith("stepd_connected_workers "):
            return float(line.split()[1])
    raise AssertionError("no stepd_connected_workers")


def test_ws_flood(abuse_daemon: Callable[..., DaemonProcess],
                  summary: Callable[[str], None]) -> None:
    """500 WebSockets connect and register at once; /healthz is served meanwhile; all released."""
    d = abuse_daemon()
    with d.client() as http:
        assert http.get("/healthz").status_code == 200
        _serves_a_worker(d)  # warm: the code paths loaded before the baseline
        baseline = _rss_mb(d.pid)
        with Probe(d.url) as probe:
            connected, registered, errors = asyncio.run(_flood(d.ws_url, WS_FLOOD_CONNS))
            peak = _rss_mb(d.pid)
        gauge = _connected_workers(http)
        for _ in range(100):  # bounded: until the daemon has seen every connection end
            if gauge == 0:
                break
            time.sleep(0.1)
            gauge = _connected_workers(http)
        result = _serves_a_worker(d)
        after = _rss_mb(d.pid)
    summary(f"ABUSE ws_flood conns={WS_FLOOD_CONNS} healthz_p99_ms={probe.p99_ms():.1f} "
            f"connected={connected} registered={registered} errors={len(errors)} "
            f"healthz_ok={len(probe.latencies_ms)}/{probe.sent} rss_mb={baseline:.0f}/"
            f"{peak:.0f}/{after:.0f}")
    assert registered == WS_FLOOD_CONNS and not errors, errors[:5]
    assert not probe.failures, probe.failures[:5]
    assert probe.latencies_ms, "no /healthz probe ran"
    assert gauge == 0, "connections still counted after their peers left"
    assert result["status"] == "completed", result
    assert after - baseline < MEMORY_MARGIN_MB, (baseline, peak, after)
