"""Helpers for the cross-worker affinity scenarios (tests/affinity/scenarios.toml).

Real parts only: ``stepd serve`` subprocesses on 127.0.0.1 (`start_daemon`),
SDK worker subprocesses (`tests.affinity._worker_proc`, through the
campaign's `WorkerProcess`: stopped by PID, SIGKILLed by some tests, always
reaped), raw HTTP and WebSocket workers (`make_link`) for the protocol's
edges. Short lease timings, so a killed worker's lease is recovered in about
a second.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.campaign._common import WorkerProcess, journal
from tests.reliability.conftest import DaemonProcess, start_daemon, stop_daemon

__all__ = ["FAST_ARGS", "Fleet", "journal", "start_fast_daemon"]

FAST_ARGS = ("--lease-ttl-ms", "800", "--heartbeat-ms", "200", "--recovery-window-ms", "200",
             "--max-request-ms", "2000")
WAIT_S = 30.0


def start_fast_daemon(data: Path) -> DaemonProcess:
    return start_daemon(data, *FAST_ARGS)


class Fleet:
    """Worker processes of one test, and the lines they print (bounded waits)."""

    def __init__(self, tmp: Path) -> None:
        self.bodies = tmp / "bodies"
        self.bodies.mkdir(parents=True, exist_ok=True)
        self.logs = tmp / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.lines: queue.Queue[tuple[WorkerProcess, str | None]] = queue.Queue()
        self.procs: list[WorkerProcess] = []
        self.seen: list[tuple[WorkerProcess, str]] = []

    def start(self, name: str, url: str, *, transport: str = "websocket",
              workflow: str = "local", extra: tuple[str, ...] = ()) -> tuple[WorkerProcess, str]:
        """Start a worker; return it and its worker id once it registered."""
        proc = WorkerProcess(name, url, workflow, self.bodies, self.logs, self.lines,
                             transport=transport, concurrency=2,
                             module="tests.affinity._worker_proc", extra=extra)
        self.procs.append(proc)
        line = self.wait_line(lambda p, text: p is proc and text.startswith("ready "),
                              f"{name} ready")
        return proc, line.split()[1]

    def wait_line(self, match: Any, what: str) -> str:
        for p, text in self.seen:
            if match(p, text):
                return text
        deadline = time.monotonic() + WAIT_S
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"timed out waiting for {what}: "
                                     + " | ".join(p.stderr()[-800:] for p in self.procs))
            try:
                proc, text = self.lines.get(timeout=left)
            except queue.Empty:
                continue
            if text is None:
                continue
            self.seen.append((proc, text))
            if match(proc, text):
                return text

    def body_files(self, run_id: str, step: str) -> list[tuple[str, str]]:
        """``(pid, idempotency key)`` of each body of `step` in `run_id` that ran."""
        out = []
        for path in sorted(self.bodies.glob(f"{run_id}__{step}__*")):
            pid = path.name.split("__")[2]
            out.append((pid, path.read_text().split()[0]))
        return out

    def stop_all(self) -> None:
        for proc in self.procs:
            proc.stop()


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    f = Fleet(tmp_path)
    try:
        yield f
    finally:
        f.stop_all()


@pytest.fixture
def fast_daemon(tmp_path: Path) -> Iterator[DaemonProcess]:
    d = start_fast_daemon(tmp_path / "data")
    try:
        yield d
    finally:
        stop_daemon(d)


def start_runs(url: str, workflow: str, ns: list[int]) -> list[str]:
    with httpx.Client(base_url=url, trust_env=False, timeout=10) as c:
        out = []
        for n in ns:
            r = c.post("/v1/api/runs", json={"workflow": workflow, "input": {"n": n}})
            assert r.status_code == 201, r.text
            out.append(r.json()["run_id"])
        return out


def result(url: str, run_id: str) -> dict[str, Any]:
    """The run's terminal answer (long-polled, bounded)."""
    deadline = time.monotonic() + WAIT_S
    with httpx.Client(base_url=url, trust_env=False, timeout=10) as c:
        while time.monotonic() < deadline:
            r = c.get(f"/v1/api/runs/{run_id}/result", params={"wait_ms": 1500})
            if r.status_code == 200 and r.json()["status"] in (
                    "completed", "failed", "cancelled", "timed_out"):
                return dict(r.json())
    raise AssertionError(f"run {run_id} did not end within {WAIT_S} s")


def events_of(url: str, run_id: str) -> list[dict[str, Any]]:
    with httpx.Client(base_url=url, trust_env=False, timeout=10) as c:
        return journal(c, run_id)
