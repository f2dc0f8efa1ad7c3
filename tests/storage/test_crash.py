"""D1 at the storage level: acknowledged writes survive SIGKILL.

A child process (``_crash_child``) writes records with several concurrent
writers and prints each id only after its ``write`` returned. The parent kills
it with SIGKILL at a random moment, 0.05-0.5 s after it opened its environment
(one round in four: after it started, so some kills land while it opens the
environment; most land while it writes, some while the map grows), reopens the same directory, and checks that every acknowledged id is
there. Rounds accumulate in one directory, so later rounds start from earlier
data. Alternate rounds run the child on asyncio and on trio.

Note: SIGKILL cannot show a missing fsync (the page cache survives a process
crash; see research/anchors-reliability.md 5.4). This test proves the
acknowledge-after-commit ordering and crash recovery, not power-loss safety.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import anyio
import pytest

from stepd.storage import Storage

ROOT = Path(__file__).resolve().parents[2]
ROUNDS = 12
"""Six rounds per backend and three kills counted from the spawn: each kind of moment
(while opening, writing, growing the map) is hit; more rounds only repeat them."""
READY_WAIT_S = 30.0


def _read_lines(stream: object, into: list[str]) -> None:
    """Collect complete lines; a torn last line (no newline) is not an acknowledgement."""
    for raw in stream:  # type: ignore[attr-defined]
        line = raw.decode()
        if line.endswith("\n"):
            into.append(line[:-1])


def _run_and_kill(data: Path, round_: int, delay: float, stderr_path: Path) -> list[str]:
    backend = "asyncio" if round_ % 2 == 0 else "trio"
    lines: list[str] = []
    with stderr_path.open("wb") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.storage._crash_child", str(data), str(round_), backend],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=stderr,
        )
        try:
            reader = threading.Thread(target=_read_lines, args=(proc.stdout, lines))
            reader.start()
            if round_ % 4 != 3:
                # Three rounds in four count the delay from "ready" (the environment
                # is open): on a loaded machine the child's start-up alone can take
                # longer than the longest delay, and a run of kills during imports
                # acknowledges nothing. The fourth counts it from the spawn, so
                # some kills still land while it opens the environment.
                deadline = time.monotonic() + READY_WAIT_S
                while "ready" not in lines and proc.poll() is None and \
                        time.monotonic() < deadline:
                    time.sleep(0.005)
            time.sleep(delay)
            alive = proc.poll() is None
            os.kill(proc.pid, signal.SIGKILL)
        finally:
            proc.wait()  # always reap
            reader.join(10)
            assert proc.stdout is not None
            proc.stdout.close()
    if not alive:
        pytest.fail(f"round {round_}: the child exited on its own:\n{stderr_path.read_text()}")
    assert proc.returncode == -signal.SIGKILL
    return [line for line in lines if line != "ready"]


async def _stored_ids(data: Path) -> set[str]:
    async with Storage.open(data, map_size=128 << 10, max_map_size=1 << 30) as storage:
        return {key.decode() for key, _ in storage.scan("runs")}


@pytest.mark.slow
def test_sigkill_loses_no_acknowledged_write(tmp_path: Path) -> None:
    seed = int(os.environ.get("STEPD_CRASH_SEED", random.randrange(1 << 32)))
    rng = random.Random(seed)
    data = tmp_path / "db"
    acked_total = 0
    rounds_with_acks = 0
    unacked_recovered = 0
    lost: list[str] = []
    started = time.monotonic()
    for round_ in range(ROUNDS):
        acked = _run_and_kill(data, round_, rng.uniform(0.05, 0.5), tmp_path / "stderr.txt")
        stored = anyio.run(_stored_ids, data)
        lost += [record_id for record_id in acked if record_id not in stored]
        acked_total += len(acked)
        rounds_with_acks += bool(acked)
        prefix = f"{round_}-"
        unacked_recovered += sum(1 for s in stored if s.startswith(prefix)) - len(acked)
    summary = (
        f"crash test: {ROUNDS} SIGKILLs, {acked_total} acknowledged records checked "
        f"({rounds_with_acks} rounds with acknowledgements), {len(lost)} lost, "
        f"{unacked_recovered} recovered-unacknowledged, seed {seed}, "
        f"{time.monotonic() - started:.1f} s"
    )
    print(summary)
    assert acked_total > 0, f"nothing was acknowledged: an empty run proves nothing. {summary}"
    assert not lost, f"lost acknowledged records {lost[:10]}... {summary}"
