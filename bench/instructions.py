"""``python -m bench.instructions``: CPU instructions per step, counted by callgrind.

    python -m bench.instructions [--runs 10] [--base 2] [--keep]

Times on these machines move by 30 % from one run to the next; call counts
(``python -m bench.calls``) do not, but weigh a dict lookup and a frozen
dataclass's ``__init__`` alike. Instructions do neither: this runs PEERS.md's
sequential workload A on the embedded default (``stepd.embedded(path)``, a
``stepd.Worker`` and a ``stepd.AsyncClient`` on one uvloop loop, as bench's
embedded setup runs them) under ``valgrind --tool=callgrind`` twice, with
``--base`` and ``--base + --runs`` seq(20) runs after the warm-up, and prints
the difference divided by the steps between them: start-up, imports and the
warm-up cancel out. Both threads are counted (valgrind runs them one at a
time); the split is by the shared object the instructions ran in (the
interpreter, msgpack, py-lmdb with LMDB, libc, zlib...). Repeatable to ~1 %
here (bench/README.md, "Instructions per step").

``--setup websocket`` counts ``stepd serve`` instead, the daemon alone: it
runs under callgrind with its instrumentation off, a ``stepd.Worker(url)``
(its WebSocket) in a second process and ``stepd.AsyncClient(url)`` in this
one, and only the counted runs are instrumented (``callgrind_control -i
on``/``off`` around them, then ``--dump``): one count, divided by its steps.
Workload A only (B's timing under a 50x slower daemon is not B).

Needs valgrind (``apt-get install valgrind``); ~1 minute on two cores.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

STEPS = 20
B_STEPS = 3
_LINE = re.compile(r"^\s*([\d,]+) \([^)]*\)\s+(.*)$")
_OBJECT = re.compile(r"\[([^\]]*)\]\s*$")
# callgrind_annotate names no object for code inlined from CPython's headers.
_GROUPS = (("libpython", "python"), ("Python-3", "python"), ("/Include/", "python"),
           ("_cmsgpack", "msgpack"), ("lmdb", "lmdb"), ("cpython.cpython", "lmdb"),
           ("libc.so", "libc"), ("libz.so", "zlib"), ("loop.cpython", "uvloop"),
           ("libcrypto", "libcrypto"))


def group_of(where: str) -> str:
    """The library a ``callgrind_annotate`` line's instructions count in."""
    found = _OBJECT.search(where)
    obj = found.group(1) if found else where
    for needle, name in _GROUPS:
        if needle in obj:
            return name
    if obj == where:  # no object named: look at the file
        for needle, name in _GROUPS:
            if needle in where:
                return name
    return "other"


def parse(text: str) -> tuple[int, dict[str, int]]:
    """(program total, instructions by library) from ``callgrind_annotate --auto=no``.

    Raises:
        ValueError: the text holds no program total, or its lines do not add up to it.
    """
    total = None
    groups: dict[str, int] = collections.Counter()
    for line in text.splitlines():
        m = _LINE.match(line)
        if m is None:
            continue
        n = int(m.group(1).replace(",", ""))
        if "PROGRAM TOTALS" in m.group(2):
            total = n
        else:
            groups[group_of(m.group(2))] += n
    if total is None:
        raise ValueError("no PROGRAM TOTALS line: not callgrind_annotate output")
    if sum(groups.values()) != total:
        raise ValueError(f"the functions add up to {sum(groups.values())}, not {total}: "
                         "run callgrind_annotate with --threshold=100")
    return total, dict(groups)


def per_step(short: tuple[int, dict[str, int]], long: tuple[int, dict[str, int]],
             steps: int) -> dict[str, Any]:
    """The difference of two counts (`parse`'s), per step."""
    names = sorted(set(short[1]) | set(long[1]),
                   key=lambda k: -(long[1].get(k, 0) - short[1].get(k, 0)))
    return {
        "instructions_per_step": round((long[0] - short[0]) / steps),
        "by_library": {k: round((long[1].get(k, 0) - short[1].get(k, 0)) / steps) for k in names},
    }


# --------------------------------------------------------------------------- the child


def child(workload: str, runs: int, data: Path) -> None:
    """The counted process: the embedded setup, the warm-up, then `runs` x seq(20) one
    at a time (A), or B's concurrent start and wait of `runs` x seq(3)."""
    import uvloop

    from bench import _setups
    from bench._workloads import run_seq, sdk_concurrency, warm_up, workload_b

    async def go() -> None:
        async with _setups.embedded(data, concurrency=sdk_concurrency()) as s:
            await warm_up(s)
            if workload == "B":
                await workload_b(s, runs, B_STEPS)
                return
            for _ in range(runs):
                await run_seq(s, STEPS)

    uvloop.run(go())


# --------------------------------------------------------------------------- the parent


def count(workload: str, runs: int, tmp: Path, tag: str) -> subprocess.Popen[bytes]:
    out = tmp / f"callgrind.{tag}"
    cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
           sys.executable, "-m", "bench.instructions", "--workload", workload,
           "--child", str(runs), "--data", str(tmp / f"data-{tag}")]
    log = (tmp / f"valgrind.{tag}.log").open("wb")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                            cwd=Path(__file__).resolve().parents[1])


def control(what: str, pid: int) -> None:
    """``callgrind_control`` on the counted daemon; it answers once the daemon took it."""
    subprocess.run(["callgrind_control", what, str(pid)], check=True, capture_output=True,
                   timeout=300)


def websocket_count(runs: int, tmp: Path) -> Path:
    """The daemon's instructions over `runs` x seq(20) (the module docstring); the dump."""
    import anyio

    import stepd
    from bench._procs import Child
    from bench._workloads import run_seq, warm_up

    out = tmp / "callgrind.daemon"
    dumps = tmp / "agent-dumps"
    dumps.mkdir()
    daemon = Child("daemon", ["valgrind", "--tool=callgrind", "--instr-atstart=no",
                              f"--callgrind-out-file={out}", sys.executable, "-m", "stepd",
                              "serve", "--data", str(tmp / "data"), "--host", "127.0.0.1",
                              "--port", "0"], tmp)
    worker = None
    try:
        url = daemon.wait_line(r"stepd listening on (http://\S+) ", 600).group(1)
        worker = Child("worker", [sys.executable, "-m", "bench._calls_agent", str(dumps),
                                  "worker", url], tmp)
        found = worker.wait_line(r"^ready (\S+)", 300)
        if found.group(1) != "websocket":
            raise SystemExit(f"instructions: the worker connected over {found.group(1)}")

        async def go() -> None:
            client = stepd.AsyncClient(url, trust_env=False, timeout=600)
            try:
                s = SimpleNamespace(transport="websocket", client=client)
                await warm_up(s)  # type: ignore[arg-type]  # a client is all run_seq uses
                control("--instr=on", daemon.pid)
                for _ in range(runs):
                    await run_seq(s, STEPS)  # type: ignore[arg-type]
                control("--instr=off", daemon.pid)
                control("--dump", daemon.pid)
            finally:
                await client.aclose()

        anyio.run(go, backend="asyncio", backend_options={"use_uvloop": True})
    finally:
        if worker is not None:
            worker.stop()
        daemon.stop(120)
    dumped = sorted(p for p in tmp.glob("callgrind.daemon.*") if p.suffix[1:].isdigit())
    if not dumped:
        raise SystemExit(f"instructions: the daemon left no dump in {tmp}")
    return dumped[0]


def annotate(path: Path) -> tuple[int, dict[str, int]]:
    text = subprocess.run(["callgrind_annotate", "--auto=no", "--threshold=100", str(path)],
                          capture_output=True, text=True, check=True).stdout
    return parse(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--setup", choices=("embedded", "websocket"), default="embedded",
                        help="embedded: the whole process; websocket: `stepd serve` alone")
    parser.add_argument("--workload", choices=("A", "B"), default="A",
                        help="A: seq(20) runs one at a time; B: seq(3) runs started and "
                             "awaited concurrently, as bench's B")
    parser.add_argument("--runs", type=int,
                        help="runs between the two counts (A: 10 x seq(20); B: 500 x seq(3))")
    parser.add_argument("--base", type=int,
                        help="runs in the shorter count (A: 2; B: 100)")
    parser.add_argument("--keep", action="store_true", help="keep the callgrind files")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        child(args.workload, args.child, args.data)
        return 0
    b = args.workload == "B"
    if args.runs is None:
        args.runs = 500 if b else 10
    if args.base is None:
        args.base = 100 if b else 2
    steps = args.runs * (B_STEPS if b else STEPS)
    if args.setup == "websocket" and b:
        parser.error("--setup websocket counts workload A only")
    if args.runs < 1 or args.base < 0:
        parser.error("--runs must be >= 1 and --base >= 0")
    for tool in ("valgrind", "callgrind_annotate"):
        if shutil.which(tool) is None:
            print(f"instructions: {tool} is not installed (apt-get install valgrind)",
                  file=sys.stderr)
            return 2
    tmp = Path(tempfile.mkdtemp(prefix="stepd-instructions-"))
    try:
        if args.setup == "websocket":  # one count of the window alone: nothing to subtract
            found = per_step((0, {}), annotate(websocket_count(args.runs, tmp)), steps)
        else:
            procs = {"short": count(args.workload, args.base, tmp, "short"),
                     "long": count(args.workload, args.base + args.runs, tmp, "long")}
            for tag, proc in procs.items():  # both run at once, one core each
                if proc.wait() != 0:
                    log = (tmp / f"valgrind.{tag}.log").read_text(errors="replace")
                    print(f"instructions: the {tag} count failed:\n{log[-3000:]}",
                          file=sys.stderr)
                    return 1
            found = per_step(annotate(tmp / "callgrind.short"),
                             annotate(tmp / "callgrind.long"), steps)
    finally:
        if args.keep:
            print(f"instructions: kept {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return report(args, found, steps)


def report(args: argparse.Namespace, found: dict[str, Any], steps: int) -> int:
    b = args.workload == "B"
    what = (f"B, {args.runs} x seq({B_STEPS}) started and awaited concurrently" if b
            else f"A, {args.runs} x seq({STEPS}) one at a time")
    who = "embedded (the process)" if args.setup == "embedded" else "websocket (the daemon)"
    print(f"{who}, {what}: {found['instructions_per_step']:,} instructions per step")
    for name, n in found["by_library"].items():
        share = 100 * n / found["instructions_per_step"] if found["instructions_per_step"] else 0.0
        print(f"  {name:<10} {n:>10,}  {share:5.1f} %")
    print(json.dumps({"bench": "instructions", "setup": args.setup, "workload": args.workload,
                      "runs": args.runs, "steps": steps, **found}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
