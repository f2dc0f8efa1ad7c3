"""Fixtures for the web console's tests: real daemons on 127.0.0.1, and a real browser.

* `start_daemon` starts ``python -m stepd serve --port 0`` and waits (bounded)
  for its listening line; `DaemonProcess.stop` sends SIGTERM, waits a bounded
  time, then SIGKILLs it by its PID.
* `browser` (package scope: closed after tests/console's last test) is
  Debian's chromium driven by Playwright's Python package, headless, with a
  fresh user-data directory. One launch serves both browser modules: every
  test opens its own page (`_pages.open_page`) on its module's own daemon, so
  they share nothing but the process (the console keeps its key in the tab's
  sessionStorage, new with every page). Playwright's own browser download is not
  used (it cannot run here): the tests skip, saying why, when
  ``/usr/bin/chromium`` (or ``$STEPD_CHROMIUM``) or the
  ``playwright`` package is missing.
"""

from __future__ import annotations

import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

LISTENING = re.compile(r"stepd listening on (http://\S+) ")
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 15.0

KEYS = {
    "admin": "console-admin-key-0123456789",
    "write": "console-write-key-0123456789",
    "worker": "console-worker-key-0123456789",
    "execute": "console-execute-key-0123456789",
    "read": "console-read-key-0123456789",
}

CHROMIUM = os.environ.get("STEPD_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync",
]


@dataclass
class DaemonProcess:
    """A ``stepd serve`` subprocess."""

    url: str
    proc: subprocess.Popen[str]
    data: Path
    stderr_path: Path
    lines: list[str] = field(default_factory=list)

    def stderr(self) -> str:
        try:
            return self.stderr_path.read_text(errors="replace")
        except OSError:
            return ""

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


def start_daemon(data: Path, *args: str) -> DaemonProcess:
    """Start ``python -m stepd serve`` on a free port of 127.0.0.1; return once it listens."""
    data.mkdir(parents=True, exist_ok=True)
    stderr_path = data.parent / f"{data.name}.stderr"
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPD_")}
    cmd = [sys.executable, "-m", "stepd", "serve", "--data", str(data), "--host", "127.0.0.1",
           "--port", "0", *args]
    with stderr_path.open("w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
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
                raise RuntimeError(f"stepd serve exited ({proc.wait()}) before listening:\n"
                                   f"{''.join(seen)}{stderr_path.read_text(errors='replace')}")
            seen.append(line)
            found = LISTENING.search(line)
            if found:
                return DaemonProcess(found.group(1), proc, data, stderr_path, seen)
    except queue.Empty:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        raise RuntimeError(f"stepd serve did not listen within {START_TIMEOUT_S} s") from None


def keyed_args() -> list[str]:
    args: list[str] = []
    for scope, key in KEYS.items():
        args += [f"--{scope}-key", key]
    return args


@pytest.fixture(scope="module")
def keyless(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    d = start_daemon(tmp_path_factory.mktemp("keyless") / "data")
    yield d
    assert d.stop() == 0, d.stderr()


PRICES = """
[models."fast-1"]
input_per_million = 0.5
output_per_million = 1.5

[models."smart-1"]
input_per_million = 3.0
output_per_million = 15.0
"""


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    """A daemon with one key per scope, and a price book (the console shows costs)."""
    base = tmp_path_factory.mktemp("keyed")
    (base / "prices.toml").write_text(PRICES)
    d = start_daemon(base / "data", *keyed_args(), "--prices", str(base / "prices.toml"))
    yield d
    assert d.stop() == 0, d.stderr()


# --------------------------------------------------------------------------- the browser


def _chromium_or_skip() -> str:
    if not (os.path.isfile(CHROMIUM) and os.access(CHROMIUM, os.X_OK)):
        found = shutil.which("chromium")
        if found is None:
            pytest.skip(f"no chromium at {CHROMIUM} (apt-get install -y chromium; or set "
                        "STEPD_CHROMIUM): the console's browser tests need a real browser")
        return found
    return CHROMIUM


@pytest.fixture(scope="package")
def browser() -> Iterator[Any]:
    """A headless chromium (a Playwright `BrowserContext`) with a fresh user-data directory."""
    sync_api = pytest.importorskip(
        "playwright.sync_api",
        reason="the console's browser tests need Playwright (pip install -e '.[test]')")
    executable = _chromium_or_skip()
    profile = tempfile.mkdtemp(prefix="stepd-console-chromium-")
    try:
        with sync_api.sync_playwright() as pw:
            context = pw.chromium.launch_persistent_context(
                profile, executable_path=executable, headless=True, args=CHROMIUM_ARGS,
                viewport={"width": 1440, "height": 900}, timeout=30_000)
            try:
                yield context
            finally:
                context.close()
    finally:
        shutil.rmtree(profile, ignore_errors=True)
