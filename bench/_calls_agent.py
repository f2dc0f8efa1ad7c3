"""The call counter's recorder, and the daemon and worker processes it profiles.

`Recorder` counts the function calls of one window: the main thread (the
event loop's thread) with cProfile, every other thread with a small
``threading.setprofile`` gate installed before those threads start (only
counting while a window is open). Both count the same profiler events, so
their counts add up the same way:

* ``call``: a Python function called, or a generator / coroutine resumed
  (every ``await`` that suspends and comes back is one more "call" of the
  coroutine: cProfile counts it so, and so do we);
* ``c_call``: a C function (builtin, method descriptor) called from Python.

The child processes (``python -m bench._calls_agent DUMP_DIR serve ...`` and
``... DUMP_DIR worker URL [--transport http]``) are ``stepd serve`` and a
``stepd.Worker`` with nothing changed but the recorder: SIGUSR1 opens a
window (it prints ``calls: on``), SIGUSR2 closes it, writes the counts to a
JSON file in DUMP_DIR and prints ``calls: off PATH``. The handlers run on the
main thread (CPython runs Python signal handlers there; uvloop wakes for
them), so cProfile is enabled on the event loop's thread.
"""

from __future__ import annotations

import cProfile
import json
import os
import signal
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

ROOT = str(Path(__file__).resolve().parent.parent) + os.sep
_SITE = "site-packages" + os.sep
_STDLIB = os.path.dirname(os.__file__) + os.sep


def short_path(filename: str) -> str:
    """A file name without the machine's prefixes: site-packages-, stdlib- or repo-relative."""
    at = filename.rfind(_SITE)
    if at >= 0:
        return filename[at + len(_SITE):]
    if filename.startswith(_STDLIB):
        return "stdlib/" + filename[len(_STDLIB):]
    if filename.startswith(ROOT):
        short = filename[len(ROOT):]
        # stepd/actors, stepd/storage, stepd/transport are symlinks to the root
        # folders (for mypy): name the code by the folder it lives in.
        for sub in ("actors/", "storage/", "transport/"):
            if short.startswith("stepd/" + sub):
                return short[len("stepd/"):]
        return short
    return filename


_AREAS: dict[str, str] = {}


def area(filename: str) -> str:
    """Where a file belongs: stepd's packages, a dependency, asyncio, the rest of the stdlib."""
    found = _AREAS.get(filename)
    if found is None:
        short = short_path(filename)
        if filename == "~":
            found = "(C, called from C)"
        elif short.startswith("stdlib/asyncio/"):
            found = "asyncio"
        elif short.startswith(("stdlib/", "<frozen")):
            found = "stdlib"
        else:
            top = short.split(os.sep, 1)[0].split("/", 1)[0]
            found = top.removesuffix(".py")
        _AREAS[filename] = found
    return found


def code_label(code: CodeType) -> str:
    return f"{short_path(code.co_filename)}:{code.co_firstlineno}({code.co_name})"  # as cProfile names it


def c_label(fn: Any) -> str:
    """cProfile's way of naming a C function, near enough."""
    qual = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
    owner = getattr(fn, "__self__", None)
    if owner is not None and not isinstance(owner, type(sys)):
        return f"<method '{getattr(fn, '__name__', qual)}' of '{type(owner).__name__}' objects>"
    module = getattr(fn, "__module__", None)
    return f"<built-in method {module + '.' if module else ''}{qual}>"


def thread_kind(name: str) -> str:
    """Thread names without their per-instance suffix (the writer's carries its path)."""
    return name.split(":", 1)[0]


class Recorder:
    """Counts the calls of one window: cProfile on the thread that opens it, a gate elsewhere."""

    def __init__(self) -> None:
        self.active = False
        self._prof: cProfile.Profile | None = None
        self._threads: dict[int, tuple[str, Counter[Any]]] = {}

    def install_thread_gate(self) -> None:
        """Every thread started from now on counts its calls while a window is open."""
        threading.setprofile(self._gate)

    def _gate(self, frame: FrameType, event: str, arg: Any) -> None:
        if not self.active:
            return
        if event == "call":
            key: Any = frame.f_code
        elif event == "c_call":  # the C function, and the file of the code calling it
            key = (c_label(arg), frame.f_code.co_filename)  # no reference to `arg` kept
        else:
            return
        ident = threading.get_ident()
        slot = self._threads.get(ident)
        if slot is None:
            slot = self._threads[ident] = (threading.current_thread().name, Counter())
        slot[1][key] += 1

    def start(self) -> None:
        self._threads = {}
        self._prof = cProfile.Profile()  # builtins=True: C calls are counted, and told apart
        self.active = True
        self._prof.enable()

    def stop(self) -> dict[str, Any]:
        """Close the window; the counts: ``{"main": {...}, "threads": {kind: {...}}}``, each
        ``{"python": n, "c": n, "functions": {label: [n, is_c]}, "areas": {area: n}}``."""
        assert self._prof is not None
        self._prof.disable()
        self.active = False
        self._prof.create_stats()
        raw = os.environ.get("BENCH_CALLS_PSTATS")  # a directory: keep the whole profile too
        if raw:
            self._prof.dump_stats(str(Path(raw) / f"{os.getpid()}-{time.monotonic_ns()}.prof"))
        functions: dict[str, list[Any]] = {}
        areas: Counter[str] = Counter()
        for (filename, line, name), (_cc, nc, _tt, _ct, callers) in self._prof.stats.items():
            if name == "<method 'disable' of '_lsprof.Profiler' objects>":
                continue
            is_c = filename == "~"
            label = name if is_c else f"{short_path(filename)}:{line}({name})"
            functions.setdefault(label, [0, is_c])[0] += nc
            if not is_c:
                areas[area(filename)] += nc
                continue
            seen = 0
            for (caller_file, _l, _n), (from_caller, *_rest) in callers.items():
                areas[area(caller_file)] += from_caller
                seen += from_caller
            if nc > seen:  # called from a frame that was running before the window opened
                areas["(caller not seen)"] += nc - seen
        out: dict[str, Any] = {"main": summarize(functions, areas), "threads": {}}
        merged: dict[str, tuple[dict[str, list[Any]], Counter[str]]] = {}
        for name, counts in list(self._threads.values()):
            fns, ars = merged.setdefault(thread_kind(name), ({}, Counter()))
            for key, n in counts.items():
                if isinstance(key, tuple):
                    fns.setdefault(key[0], [0, True])[0] += n
                    ars[area(key[1])] += n
                else:
                    fns.setdefault(code_label(key), [0, False])[0] += n
                    ars[area(key.co_filename)] += n
        out["threads"] = {k: summarize(f, a) for k, (f, a) in merged.items()}
        return out


def summarize(functions: dict[str, list[Any]], areas: Counter[str]) -> dict[str, Any]:
    python = sum(n for n, is_c in functions.values() if not is_c)
    c = sum(n for n, is_c in functions.values() if is_c)
    return {"python": python, "c": c, "functions": functions, "areas": dict(areas)}


# --------------------------------------------------------------------------- child side


def install_signal_control(recorder: Recorder, dump_dir: Path) -> None:
    """SIGUSR1 opens a window, SIGUSR2 closes it and dumps it (see the module's docstring)."""
    windows = [0]

    def on(_sig: int, _frame: Any) -> None:
        recorder.start()
        print("calls: on", flush=True)

    def off(_sig: int, _frame: Any) -> None:
        counts = recorder.stop()
        windows[0] += 1
        path = dump_dir / f"{os.getpid()}-{windows[0]}.json"
        path.write_text(json.dumps(counts))
        print(f"calls: off {path}", flush=True)

    signal.signal(signal.SIGUSR1, on)
    signal.signal(signal.SIGUSR2, off)


def worker_main(url: str, transport: str) -> None:
    import stepd
    from bench._workloads import bodies, workflows

    # stepd.Worker(url) with the SDK's defaults (transport "auto": the WebSocket), or forced
    # to HTTP long-poll.
    worker = (stepd.Worker(url) if transport == "auto"
              else stepd.Worker(url, transport=transport))
    worker.register(*workflows(), bodies=bodies())

    def announce() -> None:
        if worker.wait_ready(30):
            print(f"ready {worker.transport} {worker.worker_id}", flush=True)
        else:
            print("not ready after 30 s", file=sys.stderr, flush=True)

    threading.Thread(target=announce, name="calls-announce", daemon=True).start()
    worker.serve()  # main thread: SIGTERM stops it gracefully


def die_with_parent() -> None:
    """SIGTERM when the process that started us dies (Linux), so that nothing outlives it."""
    parent = os.getppid()
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        return
    if os.getppid() != parent:  # it died before prctl
        os.kill(os.getpid(), signal.SIGTERM)


def main(argv: list[str]) -> None:
    die_with_parent()
    dump_dir = Path(argv[0])
    role = argv[1]
    recorder = Recorder()
    recorder.install_thread_gate()  # before stepd starts its storage writer thread
    install_signal_control(recorder, dump_dir)
    if role == "serve":
        from stepd.cli import main as stepd_main

        stepd_main(args=["serve", *argv[2:]], prog_name="stepd")
    elif role == "worker":
        url = argv[2]
        transport = argv[4] if argv[3:4] == ["--transport"] else "auto"
        worker_main(url, transport)
    else:
        raise SystemExit(f"unknown role {role!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
