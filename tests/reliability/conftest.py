"""Helpers for the reliability tests (docs/reliability.md).

Real ``stepd serve`` subprocesses on 127.0.0.1 (started by
`tests.transport.conftest.start_daemon`, free port, bounded wait for the
listening line), stopped by PID and always reaped:

* `kill9` SIGKILLs a daemon (no graceful exit) and reaps it;
* `stop_daemon` is SIGTERM, a bounded wait, then SIGKILL (the transport
  fixtures' `DaemonProcess.stop`), and reaps whatever is left.

`Current` publishes "the daemon now serving" to worker threads, so a test can
kill a daemon and start the next on another port while its clients keep going.

Every test reports one Jepsen-style summary line (research/anchors-reliability.md
"How each test reports"): the ``summary`` fixture prints it, records it as a
junit property and repeats it at the end of the pytest run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from collections.abc import Callable, Iterator

import pytest

from tests.transport.conftest import DaemonProcess, start_daemon

__all__ = [
    "Current", "DaemonProcess", "env_int", "kill9", "seed_from_env", "start_daemon", "stop_daemon",
]

REAP_TIMEOUT_S = 10.0

_SUMMARIES: list[str] = []


def kill9(d: DaemonProcess) -> int:
    """SIGKILL the daemon by its PID and reap it; returns its exit status."""
    if d.proc.poll() is None:
        try:
            os.kill(d.pid, signal.SIGKILL)
        except ProcessLookupError:  # exited on its own in between; still reaped below
            pass
    return d.proc.wait(REAP_TIMEOUT_S)


def stop_daemon(d: DaemonProcess) -> int:
    """SIGTERM, a bounded wait, then SIGKILL; the process is reaped either way."""
    try:
        return d.stop()
    except subprocess.TimeoutExpired:
        return kill9(d)
    finally:
        if d.proc.poll() is None:
            kill9(d)


def seed_from_env(default: int) -> int:
    """The run's seed: ``STEPD_RELIABILITY_SEED`` when set, else ``default`` (printed)."""
    raw = os.environ.get("STEPD_RELIABILITY_SEED")
    return int(raw) if raw else default


def env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    return int(raw) if raw else default


class Current:
    """The daemon URL clients should talk to now, with a generation number.

    ``None`` between a kill and the next start. Threads wait on it (bounded) and
    notice a new generation to re-register and open fresh connections.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._url: str | None = None
        self._gen = 0

    def publish(self, url: str | None) -> None:
        with self._cond:
            self._url = url
            if url is not None:
                self._gen += 1
            self._cond.notify_all()

    def get(self, timeout: float = 0.05) -> tuple[str | None, int]:
        """The current (url, generation); waits up to ``timeout`` while there is none."""
        with self._cond:
            if self._url is None:
                self._cond.wait(timeout)
            return self._url, self._gen


@pytest.fixture
def summary(request: pytest.FixtureRequest,
            record_property: Callable[[str, object], None]) -> Iterator[Callable[[str], None]]:
    """``summary(line)``: print the test's history summary and keep it for the run's end."""

    def emit(line: str) -> None:
        print(line)
        record_property("summary", line)
        _SUMMARIES.append(f"{request.node.name}: {line}")

    yield emit


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _SUMMARIES:
        terminalreporter.section("stepd reliability summaries")
        for line in _SUMMARIES:
            terminalreporter.write_line(line)
