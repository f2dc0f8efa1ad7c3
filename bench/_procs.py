"""Processes for `python -m bench`: the daemon and worker subprocesses, /proc readers, strace.

Everything started here is stopped here, by PID: SIGTERM, a bounded wait, then
SIGKILL, and always reaped (`stop`). Nothing is ever killed by name.
"""

from __future__ import annotations

import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any, Self

CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")
STOP_WAIT_S = 20.0
"""How long a SIGTERMed process may take to shut down before SIGKILL."""
PIDS_ENV = "BENCH_PIDS_FILE"
"""Set by `python -m bench` for its children: a file where every PID they start is noted,
so that the parent can stop what a crashed child left behind (`kill_pid`)."""


def note_pid(pid: int) -> None:
    path = os.environ.get(PIDS_ENV)
    if path:
        with open(path, "a") as f:
            f.write(f"{pid}\n")


def kill_pid(pid: int, wait: float = STOP_WAIT_S) -> None:
    """SIGTERM, then SIGKILL after `wait` s, a process that is not our child (no reaping)."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        if not os.path.exists(f"/proc/{pid}") or _zombie(pid):
            return
        time.sleep(0.1)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
        return raw[raw.rindex(b")") + 2:].split()[0] == b"Z"
    except OSError:
        return True


# --------------------------------------------------------------------------- /proc


def cpu_seconds(pid: int) -> float:
    """utime + stime of the whole process (every thread), in seconds."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        raw = f.read()
    fields = raw[raw.rindex(b")") + 2:].split()
    # fields[0] is field 3 (state): utime is field 14, stime field 15.
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def rss_bytes(pid: int) -> int:
    """Resident set size (statm's second field, in pages)."""
    with open(f"/proc/{pid}/statm", "rb") as f:
        return int(f.read().split()[1]) * PAGE


def rss_detail_mb(pid: int) -> dict[str, float]:
    """VmRSS split as /proc/<pid>/status does: anonymous, file-backed (LMDB's map), shmem."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
                out[key] = round(int(value.split()[0]) / 1024, 1)
    return out


def cpu_snapshot(pids: dict[str, int]) -> dict[str, float]:
    return {name: cpu_seconds(pid) for name, pid in pids.items()}


class RssSampler:
    """Peak RSS of some processes, sampled every `interval` seconds on a thread."""

    def __init__(self, pids: dict[str, int], interval: float = 0.05) -> None:
        self.pids = pids
        self.interval = interval
        self.peak: dict[str, int] = dict.fromkeys(pids, 0)
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="bench-rss", daemon=True)

    def _sample(self) -> None:
        for name, pid in self.pids.items():
            try:
                self.peak[name] = max(self.peak[name], rss_bytes(pid))
            except (FileNotFoundError, ProcessLookupError):  # pragma: no cover - it died
                pass
        self.samples += 1

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self) -> Self:
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sample()

    def peak_mb(self) -> dict[str, float]:
        return {name: round(b / 2**20, 1) for name, b in self.peak.items()}


# --------------------------------------------------------------------------- subprocesses


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPD_")}
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    return env


class Child:
    """A subprocess whose stdout lines are pumped into a queue (and a log file)."""

    def __init__(self, name: str, cmd: list[str], log_dir: Path) -> None:
        self.name = name
        self.cmd = cmd
        self.err_path = log_dir / f"{name}.stderr"
        self.out_path = log_dir / f"{name}.stdout"
        self._err: IO[str] = self.err_path.open("w")
        self._out: IO[str] = self.out_path.open("w")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self._err, text=True,
                                     env=_env(), start_new_session=True)
        self.pid = self.proc.pid
        note_pid(self.pid)
        self.lines: queue.Queue[str | None] = queue.Queue()
        self._pump = threading.Thread(target=self._pump_lines, name=f"bench-{name}-out", daemon=True)
        self._pump.start()

    def _pump_lines(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._out.write(line)
            self._out.flush()
            self.lines.put(line)
        self.lines.put(None)

    def wait_line(self, pattern: str, timeout: float) -> re.Match[str]:
        """The first stdout line matching `pattern`; SystemExit if the process exits or times out."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise SystemExit(f"bench: {self.name} did not print /{pattern}/ within {timeout} s "
                                 f"(see {self.err_path})\n{self.stderr_tail()}")
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                code = self.proc.wait()
                raise SystemExit(f"bench: {self.name} exited {code} before /{pattern}/\n"
                                 f"{self.stderr_tail()}")
            found = re.search(pattern, line)
            if found:
                return found

    def stderr_tail(self, n: int = 20) -> str:
        self._err.flush()
        try:
            return "\n".join(self.err_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:  # pragma: no cover
            return ""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, wait: float = STOP_WAIT_S) -> int:
        """SIGTERM by PID, wait at most `wait` s, then SIGKILL; reaped either way."""
        code = stop(self.proc, wait)
        self._pump.join(5)
        self._err.close()
        self._out.close()
        return code


def stop(proc: subprocess.Popen[Any], wait: float = STOP_WAIT_S) -> int:
    if proc.poll() is None:
        try:
            os.kill(proc.pid, signal.SIGTERM)
        except ProcessLookupError:  # pragma: no cover - exited meanwhile
            pass
        try:
            return proc.wait(wait)
        except subprocess.TimeoutExpired:
            print(f"bench: pid {proc.pid} ignored SIGTERM for {wait} s: SIGKILL", file=sys.stderr)
            try:
                os.kill(proc.pid, signal.SIGKILL)
            except ProcessLookupError:  # pragma: no cover
                pass
    return proc.wait()


def start_daemon(data: Path, log_dir: Path, extra: list[str] = (), name: str = "daemon",  # type: ignore[assignment]
                 ) -> tuple[Child, str]:
    """``python -m stepd serve`` on a free loopback port (``--port 0``); returns it and its URL."""
    cmd = [sys.executable, "-m", "stepd", "serve", "--data", str(data), "--host", "127.0.0.1",
           "--port", "0", *extra]
    child = Child(name, cmd, log_dir)
    try:
        found = child.wait_line(r"stepd listening on (http://\S+) ", 30)
    except BaseException:
        child.stop()
        raise
    return child, found.group(1)


def start_workers(url: str, transport: str, concurrency: int | None, log_dir: Path,
                  names: list[str]) -> list[Child]:
    """``python -m bench._worker`` processes (a `stepd.Worker` each), started together,
    all registered when this returns. ``concurrency`` None: the SDK's default."""
    children: list[Child] = []
    try:
        for name in names:
            cmd = [sys.executable, "-m", "bench._worker", url, "--transport", transport,
                   "--name", name]
            if concurrency is not None:
                cmd += ["--concurrency", str(concurrency)]
            children.append(Child(name, cmd, log_dir))
        for child in children:
            found = child.wait_line(r"^ready (\S+)", 30)
            if found.group(1) != transport:
                raise SystemExit(f"bench: {child.name} connected over {found.group(1)}, "
                                 f"not {transport}")
    except BaseException:
        for child in children:
            child.stop()
        raise
    return children


# --------------------------------------------------------------------------- strace


class SyncCounter:
    """``strace -f -c -e trace=fsync,fdatasync,msync,sync_file_range -p PID`` for a phase.

    `start` attaches (every thread of the process) and returns once strace says
    so; `stop` detaches (SIGINT: strace writes its summary) and returns the
    calls per syscall.
    """

    SYSCALLS = ("fsync", "fdatasync", "msync", "sync_file_range")

    def __init__(self, pid: int, out: Path) -> None:
        self.pid = pid
        self.out = out
        self.proc: subprocess.Popen[str] | None = None
        self.err_path = out.with_suffix(".stderr")

    @staticmethod
    def available() -> str | None:
        """None when strace can be used, else why not."""
        if shutil.which("strace") is None:
            return "strace is not installed"
        return None

    def start(self) -> None:
        cmd = ["strace", "-f", "-c", "-e", "trace=" + ",".join(self.SYSCALLS),
               "-p", str(self.pid), "-o", str(self.out)]
        self._err = self.err_path.open("w+")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self._err, text=True)
        note_pid(self.proc.pid)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            text = self.err_path.read_text(errors="replace")
            if "attached" in text:
                time.sleep(0.2)  # every thread: "attached with N threads" is printed at once
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"strace exited {self.proc.returncode}: {text.strip()}")
            time.sleep(0.02)
        stop(self.proc, 5)
        raise RuntimeError("strace did not attach within 10 s: "
                           + self.err_path.read_text(errors="replace").strip())

    def stop(self) -> dict[str, int]:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            stop(self.proc, 5)
        self._err.close()
        calls = dict.fromkeys(self.SYSCALLS, 0)
        for line in self.out.read_text().splitlines():
            parts = line.split()
            if len(parts) >= 5 and parts[-1] in calls and parts[3].isdigit():
                calls[parts[-1]] = int(parts[3])
        return calls
