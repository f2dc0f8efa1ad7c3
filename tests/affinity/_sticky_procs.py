"""Sticky execution's worker processes (`tests.affinity._sticky_worker`): started and stopped
by PID, always reaped; the fixtures that use them are in the conftest."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import stepd

__all__ = ["StickyProcess", "start_worker", "sticky_of"]

ROOT = Path(__file__).resolve().parents[2]
READY_TIMEOUT_S = 30.0
REAP_TIMEOUT_S = 10.0


@dataclass
class StickyProcess:
    proc: subprocess.Popen[str]
    worker_id: str

    def kill(self) -> None:
        """SIGKILL by PID: the worker is lost without a word."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(REAP_TIMEOUT_S)
        self._close()

    def _close(self) -> None:
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    def stop(self) -> None:
        """SIGTERM (graceful), then SIGKILL if it does not exit in time."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(REAP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.kill()
        self._close()


def start_worker(url: str, prefix: str, *, transport: str, capacity: int = 0,
                 build_id: str | None = "b1", worker_id: str | None = None,
                 schedule_ms: int | None = None, max_bytes: int | None = None,
                 log: Path | None = None) -> StickyProcess:
    cmd = [sys.executable, "-m", "tests.affinity._sticky_worker", "--url", url, "--prefix",
           prefix, "--transport", transport, "--capacity", str(capacity)]
    for flag, value in (("--build-id", build_id), ("--worker-id", worker_id),
                        ("--schedule-ms", schedule_ms), ("--max-bytes", max_bytes)):
        if value is not None:
            cmd += [flag, str(value)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPD_")}
    if log is not None:
        with log.open("a") as err:
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=err,
                                    text=True, env=env)
    else:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True, env=env)
    # The first line only: the worker prints nothing after it.
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], READY_TIMEOUT_S)
    line = proc.stdout.readline() if ready else None
    if line is None or not line.startswith("ready "):
        proc.kill()
        proc.wait(REAP_TIMEOUT_S)
        proc.stdout.close()
        raise RuntimeError(f"worker process did not get ready: {line!r}")
    return StickyProcess(proc, line.split()[1])


def sticky_of(client: stepd.Client, worker_id: str) -> dict[str, Any] | None:
    for w in client.workers():
        if w["worker_id"] == worker_id:
            return w.get("sticky")  # type: ignore[no-any-return]
    raise AssertionError(f"worker {worker_id} is not listed")
