"""``examples/raw_http_worker.py`` with no daemon to talk to: one line, not a traceback.

The port is one this test holds bound but never listens on, so a connection to
it is refused, whatever else runs on the machine.
"""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from ._serve import ROOT, clean_env

pytestmark = pytest.mark.timeout(60)


def test_raw_http_worker_without_a_daemon_says_so_in_one_line() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
        url = f"http://127.0.0.1:{held.getsockname()[1]}"
        proc = subprocess.run([sys.executable, str(ROOT / "examples" / "raw_http_worker.py"),
                               "--url", url], check=False, capture_output=True, text=True,
                              timeout=30, env=clean_env(), cwd=ROOT)
    assert proc.returncode != 0
    assert proc.stdout == ""
    assert "Traceback" not in proc.stderr
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(f"error: no stepd daemon answers at {url} ("), proc.stderr
