"""The call budget: Python function calls per step must not rise more than 20 % above it.

Runs ``python -m bench.calls --runs 3 --top 0`` (the three setups of sequential
workload A, counted with cProfile; about 25-30 s) as a subprocess and compares
every count with ``bench/calls_budget.json``. Counts, not times: they hardly
move with the machine's load (five runs in a row: the main threads' counts
within 3 %, the writer thread's and the client's within 10 %; bench/README.md
"Calls per step"). When a change makes a count rise on
purpose, re-measure and commit the new budget: ``python -m bench.calls
--update-budget``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUDGET = ROOT / "bench" / "calls_budget.json"
SETUPS = {"websocket": {"daemon", "worker", "client"}, "http": {"daemon", "worker", "client"},
          "embedded": {"process"}}


def run_calls(*args: str, timeout: float = 110) -> subprocess.CompletedProcess[str]:
    """``python -m bench.calls ARGS``; on a timeout it gets SIGTERM (it stops its daemon and
    worker by PID) before SIGKILL."""
    proc = subprocess.Popen([sys.executable, "-m", "bench.calls", *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={k: v for k, v in os.environ.items() if not k.startswith("STEPD_")})
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        pytest.fail(f"python -m bench.calls {' '.join(args)} took over {timeout} s:\n{out}\n{err}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_the_budget_file_has_every_figure_and_says_where_it_comes_from() -> None:
    budget = json.loads(BUDGET.read_text())
    assert len(budget["commit"]) == 40 and budget["date"] and budget["runs"] >= 1
    keys = set(budget["calls_per_step"])
    for setup, processes in SETUPS.items():
        for process in processes:
            # A process with a storage writer: its main and writer threads summed (a
            # batch runs on either, bench/calls.py MAIN_WRITER); any other: its main.
            thread = "main+writer" if process in ("daemon", "process") else "main"
            assert f"{setup}/{process}/{thread}" in keys
    assert all(v > 0 for v in budget["calls_per_step"].values())


def test_over_budget_flags_a_rise_above_the_tolerance_only() -> None:
    from bench.calls import over_budget

    budget = {"calls_per_step": {"websocket/daemon/main": 1000.0, "http/worker/main": 500.0}}
    rows = [{"setup": "websocket", "process": "daemon", "thread": "main", "calls_per_step": 1199.0},
            {"setup": "http", "process": "worker", "thread": "main", "calls_per_step": 100.0}]
    assert over_budget(rows, budget) == []
    rows[0]["calls_per_step"] = 1201.0
    problems = over_budget(rows, budget)
    assert len(problems) == 1 and problems[0].startswith("websocket/daemon/main: 1,201.0")
    assert over_budget(rows[1:], budget) == ["websocket/daemon/main: not measured"]


def test_calls_per_step_stay_within_the_budget() -> None:
    from bench.calls import TOLERANCE, over_budget

    proc = run_calls("--runs", "3", "--top", "0")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert {(r["setup"], r["process"]) for r in rows} == {
        (s, p) for s, ps in SETUPS.items() for p in ps}
    from bench.calls import budgeted

    for r in rows:
        if not budgeted(r, rows):
            continue  # a writer thread alone may be near 0 (its batches ran on the loop)
        assert r["calls_per_step"] > 0, r
        # The idle window (same length) is subtracted; it must stay a small correction.
        assert r["idle_share_pct"] < 10, r
    budget = json.loads(BUDGET.read_text())
    print(proc.stdout)  # the table and the JSON lines (pytest -rP shows them)
    problems = over_budget(rows, budget)
    assert not problems, (
        f"calls per step rose more than {TOLERANCE:.0%} above bench/calls_budget.json "
        f"(measured at {budget['commit'][:9]}, {budget['date']}):\n  " + "\n  ".join(problems)
        + "\nIf the rise is intended, re-measure: python -m bench.calls --update-budget"
        + "\n\n" + proc.stdout)
