"""``python -m stepd serve`` as a subprocess on a free port, for the CLI and example tests.

`serve_process` returns once the daemon prints its listening line; `ServeProcess.stop`
sends SIGTERM to that PID (and SIGKILL after a bounded wait) and returns the exit status.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

LISTENING = re.compile(r"stepd listening on (http://\S+) ")
START_TIMEOUT_S = 20.0
STOP_TIMEOUT_S = 15.0
ROOT = Path(__file__).resolve().parents[2]


def clean_env(**extra: str) -> dict[str, str]:
    """The environment without any STEPD_* variable, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPD_")}
    env.update(extra)
    return env


@dataclass
class ServeProcess:
    url: str
    proc: subprocess.Popen[str]
    stderr_path: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def stop(self) -> int:
        """SIGTERM by PID; SIGKILL if it has not exited within the bound. Returns its status."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                return self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(STOP_TIMEOUT_S)
                raise AssertionError(f"stepd serve ignored SIGTERM:\n{self.stderr()}") from None
        return self.proc.returncode


def serve_process(data: Path, *args: str) -> ServeProcess:
    """Start ``python -m stepd serve --data DATA --port 0 ARGS``; return once it listens."""
    data.parent.mkdir(parents=True, exist_ok=True)
    stderr_path = data.parent / f"{data.name}.serve.stderr"
    cmd = [sys.executable, "-m", "stepd", "serve", "--data", str(data), "--host", "127.0.0.1",
           "--port", "0", *args]
    with stderr_path.open("w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True,
                                env=clean_env(), cwd=ROOT)
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        with proc.stdout:
            for line in proc.stdout:
                lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, name="serve stdout", daemon=True).start()
    try:
        while True:
            line = lines.get(timeout=START_TIMEOUT_S)
            if line is None:
                raise RuntimeError(f"stepd serve exited ({proc.wait()}) before listening:\n"
                                   f"{stderr_path.read_text(errors='replace')}")
            found = LISTENING.search(line)
            if found:
                return ServeProcess(found.group(1), proc, stderr_path)
    except queue.Empty:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        raise RuntimeError(f"stepd serve did not listen within {START_TIMEOUT_S} s") from None
