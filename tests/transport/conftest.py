"""Fixtures for the network tests: real daemons on 127.0.0.1, raw HTTP and raw WebSockets.

* `start_daemon` starts ``python -m stepd serve`` as a subprocess with
  ``--port 0``, waits (bounded) for its listening line and returns a
  `DaemonProcess` (URL, PID). `DaemonProcess.stop` sends SIGTERM, waits a
  bounded time, then SIGKILLs it by its PID.
* ``daemon`` (default timings, ``--max-request-ms 2000``), ``auth_daemon``
  (one key per scope) and ``fast_daemon`` (``--lease-ttl-ms 300
  --heartbeat-ms 100 --recovery-window-ms 200``) are shared by a session;
  tests keep out of each other's way by using their own workflow names
  (`unique`).
* ``inproc`` runs the daemon in this process, in a thread with its own event
  loop (`stepd.daemon.Daemon`), for tests that look at the engine directly.

Every network call is bounded (client timeouts, bounded loops); nothing sleeps
longer than the behaviour under test needs.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from websockets.sync.client import ClientConnection, connect

LISTENING = re.compile(r"stepd listening on (http://\S+) ")
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 15.0

KEYS = {
    "admin": "admin-key-0123456789abcdef",
    "write": "write-key-0123456789abcdef",
    "worker": "worker-key-0123456789abcdef",
    "execute": "execute-key-0123456789abcdef",
    "read": "read-key-0123456789abcdef",
}


def unique(prefix: str = "wf") -> str:
    """A workflow (or other) name no other test uses."""
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def task_def(name: str, *bodies: str, **step_options: Any) -> dict[str, Any]:
    """A definition of task steps, one per body (step id = body name)."""
    return {
        "name": name,
        "steps": [{"id": b, "kind": "task", "body": b, **step_options} for b in bodies],
    }


@dataclass
class DaemonProcess:
    """A ``stepd serve`` subprocess."""

    url: str
    proc: subprocess.Popen[str]
    data: Path
    stderr_path: Path
    args: tuple[str, ...] = ()
    lines: list[str] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def ws_url(self) -> str:
        return self.url.replace("http://", "ws://", 1) + "/v1/api/workers/connect"

    def stderr(self) -> str:
        try:
            return self.stderr_path.read_text(errors="replace")
        except OSError:
            return ""

    def assert_quiet_log(self) -> None:
        """No traceback and no ERROR line in the daemon's log."""
        text = self.stderr()
        assert "Traceback" not in text and " ERROR " not in text, text

    def stop(self, *, timeout: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM, then SIGKILL after ``timeout``; returns the exit status."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                return self.proc.wait(timeout)
        return self.proc.returncode

    def client(self, key: str | None = None, **kwargs: Any) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        kwargs.setdefault("timeout", 10.0)
        return httpx.Client(base_url=self.url, headers=headers, trust_env=False, **kwargs)


def start_daemon(data: Path, *args: str, env: dict[str, str] | None = None) -> DaemonProcess:
    """Start ``python -m stepd serve`` on a free port; return once it listens."""
    data.mkdir(parents=True, exist_ok=True)
    stderr_path = data.parent / f"{data.name}.stderr"
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("STEPD_")}
    full_env.update(env or {})
    cmd = [sys.executable, "-m", "stepd", "serve", "--data", str(data), "--host", "127.0.0.1",
           "--port", "0", *args]
    with stderr_path.open("w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=full_env)
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        with proc.stdout:
            for line in proc.stdout:
                lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    seen: list[str] = []
    try:
        while True:
            line = lines.get(timeout=START_TIMEOUT_S)
            if line is None:
                raise RuntimeError(
                    f"stepd serve exited ({proc.wait()}) before listening:\n"
                    f"{''.join(seen)}{stderr_path.read_text(errors='replace')}"
                )
            seen.append(line)
            found = LISTENING.search(line)
            if found:
                return DaemonProcess(found.group(1), proc, data, stderr_path, tuple(args), seen)
    except queue.Empty:
        proc.kill()
        proc.wait()
        raise RuntimeError(f"stepd serve did not listen within {START_TIMEOUT_S} s") from None


@pytest.fixture(scope="session")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    d = start_daemon(tmp_path_factory.mktemp("daemon") / "data", "--max-request-ms", "2000",
                     "--max-body-bytes", "65536")
    yield d
    assert d.stop() == 0, d.stderr()
    d.assert_quiet_log()


@pytest.fixture(scope="session")
def auth_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    args: list[str] = ["--max-request-ms", "2000"]
    for scope, key in KEYS.items():
        args += [f"--{scope}-key", key]
    d = start_daemon(tmp_path_factory.mktemp("auth") / "data", *args)
    yield d
    assert d.stop() == 0, d.stderr()
    d.assert_quiet_log()


@pytest.fixture(scope="session")
def fast_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    d = start_daemon(tmp_path_factory.mktemp("fast") / "data", "--lease-ttl-ms", "300",
                     "--heartbeat-ms", "100", "--recovery-window-ms", "200",
                     "--max-request-ms", "2000")
    yield d
    assert d.stop() == 0, d.stderr()
    d.assert_quiet_log()


@pytest.fixture
def http(daemon: DaemonProcess) -> Iterator[httpx.Client]:
    with daemon.client() as client:
        yield client


# --------------------------------------------------------------------------- workers


class Worker:
    """An SDK-less worker over raw HTTP: only what PROTOCOL.md says."""

    def __init__(self, client: httpx.Client, definitions: list[dict[str, Any]], **extra: Any):
        self.client = client
        r = client.post("/v1/api/workers/register", json={"definitions": definitions, **extra})
        assert r.status_code == 200, r.text
        self.registered = r.json()
        self.worker_id: str = self.registered["worker_id"]

    def claim(self, *, max: int = 1, wait_ms: int = 0, run_id: str | None = None,
              expect: int = 200) -> list[dict[str, Any]]:
        body: dict[str, Any] = {"worker_id": self.worker_id, "max": max, "wait_ms": wait_ms}
        if run_id is not None:
            body["run_id"] = run_id
        r = self.client.post("/v1/api/steps/claim", json=body)
        assert r.status_code == expect, r.text
        return r.json()["leases"] if expect == 200 else []

    def claim_one(self, *, run_id: str | None = None, wait_ms: int = 1500) -> dict[str, Any]:
        for _ in range(5):
            leases = self.claim(run_id=run_id, wait_ms=wait_ms)
            if leases:
                return leases[0]
        raise AssertionError("no lease offered")

    def call(self, lease_id: str, op: str, body: Any = None) -> httpx.Response:
        if body is None:
            return self.client.post(f"/v1/api/steps/{lease_id}/{op}")
        return self.client.post(f"/v1/api/steps/{lease_id}/{op}", json=body)


def start_run(client: httpx.Client, workflow: str, input: Any = None, **extra: Any) -> str:
    r = client.post("/v1/api/runs", json={"workflow": workflow, "input": input, **extra})
    assert r.status_code == 201, r.text
    return str(r.json()["run_id"])


def wait_result(client: httpx.Client, run_id: str, *, timeout_s: float = 10.0) -> dict[str, Any]:
    """Long-poll the result until the run is terminal (bounded)."""
    for _ in range(int(timeout_s / 1.5) + 2):
        r = client.get(f"/v1/api/runs/{run_id}/result", params={"wait_ms": 1500})
        assert r.status_code == 200, r.text
        if r.json()["status"] in ("completed", "failed", "cancelled", "timed_out"):
            return dict(r.json())
    raise AssertionError(f"run {run_id} did not end: {r.json()}")


def journal_types(client: httpx.Client, run_id: str) -> list[str]:
    r = client.get(f"/v1/api/runs/{run_id}/journal")
    assert r.status_code == 200, r.text
    return [e["type"] for e in r.json()["events"]]


# --------------------------------------------------------------------------- websockets


def ws_connect(d: DaemonProcess, *, subprotocol: str = "stepd.v1.msgpack", key: str | None = None,
               **kwargs: Any) -> ClientConnection:
    headers = {"Authorization": f"Bearer {key}"} if key else None
    kwargs.setdefault("open_timeout", 10)
    kwargs.setdefault("close_timeout", 5)
    return connect(d.ws_url, subprotocols=[subprotocol], additional_headers=headers,  # type: ignore[list-item]
                   proxy=None, compression=None, **kwargs)


class WsWorker:
    """A worker speaking the WebSocket frames of PROTOCOL.md, msgpack or JSON."""

    def __init__(self, conn: ClientConnection) -> None:
        import msgpack

        self.conn = conn
        self.binary = conn.subprotocol == "stepd.v1.msgpack"
        self._msgpack = msgpack
        self.next_id = 0
        self.pending: list[dict[str, Any]] = []  # frames received while waiting for another

    def send(self, frame: dict[str, Any]) -> None:
        if self.binary:
            self.conn.send(self._msgpack.packb(frame, use_bin_type=True))
        else:
            self.conn.send(json.dumps(frame))

    def recv(self, timeout: float = 10.0) -> dict[str, Any]:
        if self.pending:
            return self.pending.pop(0)
        data = self.conn.recv(timeout=timeout)
        if self.binary:
            assert isinstance(data, bytes), data
            return dict(self._msgpack.unpackb(data, raw=False))
        assert isinstance(data, str), data
        return dict(json.loads(data))

    def request(self, op: str, timeout: float = 10.0, **body: Any) -> dict[str, Any]:
        """Send a request frame and return its answer (other frames are kept for later)."""
        self.next_id += 1
        frame_id = self.next_id
        self.send({"op": op, "id": frame_id, **body})
        skipped: list[dict[str, Any]] = []
        try:
            for _ in range(1000):
                frame = self.recv_raw(timeout)
                if frame.get("id") == frame_id and frame["op"] in (
                        "ok", "conflict", "error", "registered"):
                    return frame
                skipped.append(frame)
            raise AssertionError("no answer")
        finally:
            self.pending.extend(skipped)

    def recv_raw(self, timeout: float) -> dict[str, Any]:
        data = self.conn.recv(timeout=timeout)
        if self.binary:
            return dict(self._msgpack.unpackb(data, raw=False))  # type: ignore[arg-type]
        return dict(json.loads(data))

    def wait_for(self, op: str, timeout: float = 10.0) -> dict[str, Any]:
        """The next frame with this ``op`` (earlier frames of other ops are kept)."""
        for i, frame in enumerate(self.pending):
            if frame["op"] == op:
                return self.pending.pop(i)
        for _ in range(1000):
            frame = self.recv_raw(timeout)
            if frame["op"] == op:
                return frame
            self.pending.append(frame)
        raise AssertionError(f"no {op} frame")


# --------------------------------------------------------------------------- in process


@dataclass
class InProcDaemon:
    """A daemon running in this process, on its own event loop in a thread."""

    url: str
    daemon: Any  # stepd.daemon.Server
    portal: Any  # anyio.from_thread.BlockingPortal

    def client(self, key: str | None = None) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.url, headers=headers, trust_env=False, timeout=10.0)

    def run(self, fn: Any, *args: Any) -> Any:
        """Call ``fn(*args)`` (sync or async) on the daemon's event loop."""
        return self.portal.call(fn, *args)


def serve_in_process(data: Path, **config: Any) -> Iterator[InProcDaemon]:
    """`stepd serve` on a portal thread of this process, stopped (exit 0) when done."""
    from stepd.daemon import ServeConfig, Server

    daemon = Server(ServeConfig(data=str(data), port=0, **config), announce=lambda line: None)
    with anyio.from_thread.start_blocking_portal("asyncio") as portal:
        future, _ = portal.start_task(daemon.run)
        try:
            assert daemon.url is not None
            yield InProcDaemon(daemon.url, daemon, portal)
        finally:
            portal.call(daemon.request_stop)
            assert future.result(timeout=STOP_TIMEOUT_S) == 0


@pytest.fixture(scope="module")
def inproc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcDaemon]:
    yield from serve_in_process(tmp_path_factory.mktemp("inproc") / "data", max_request_ms=2000)
