"""Smoke test of the benchmark harness: ``python -m bench --quick --only A --transport embedded``.

Runs it as a subprocess (a few seconds) and checks that it exits 0 and that
its JSON lines parse and carry PEERS.md's field names. Timings are never
asserted.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_quick_a_embedded(tmp_path: Path) -> None:
    out = tmp_path / "bench.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--only", "A", "--transport", "embedded",
         "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=30, check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    printed = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert printed == written
    by_workload = {row["workload"]: row for row in written}
    assert {"baseline", "machine", "A", "run"} <= set(by_workload)
    a = by_workload["A"]
    assert a["engine"] == "stepd" and a["transport"] == "embedded"
    for key in ("per_step_ms_median", "per_step_ms_p95", "wf1_e2e_ms_median"):
        assert isinstance(a[key], float) and a[key] > 0, key
    assert by_workload["baseline"]["synced_lmdb_commit_ms_median"] > 0
    assert by_workload["run"]["failures"] == []
    assert "A per-step median" in proc.stdout  # the table


def test_repeat_reports_the_median_of_the_runs(tmp_path: Path) -> None:
    """``--repeat 3``: three A rows tagged 1-3, then one row with their medians."""
    out = tmp_path / "bench.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--only", "A", "--transport", "embedded",
         "--repeat", "3", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    runs = [r for r in rows if r["workload"] == "A" and "repeat" in r]
    assert [r["repeat"] for r in runs] == [1, 2, 3]
    median = next(r for r in rows if r["workload"] == "A" and "repeats" in r)
    values = sorted(r["per_step_ms_median"] for r in runs)
    assert median["repeats"] == 3 and median["per_step_ms_median"] == values[1]
    assert median["per_repeat"]["per_step_ms_median"] == [r["per_step_ms_median"] for r in runs]
    assert median["runs"] == runs[0]["runs"] and isinstance(median["runs"], int)


def test_median_of_repeats_takes_numbers_and_dicts_of_numbers() -> None:
    from bench.__main__ import median_of_repeats

    rows = [{"engine": "stepd", "workload": "B", "repeat": i, "steps_per_s": v,
             "cpu_s": {"daemon": c, "worker": 1.0}, "workflows": 1000, "note": "x"}
            for i, (v, c) in enumerate([(900.0, 3.0), (1100.0, 2.0), (1000.0, 4.0)], 1)]
    m = median_of_repeats(rows)
    assert m["steps_per_s"] == 1000.0 and m["cpu_s"] == {"daemon": 3.0, "worker": 1.0}
    assert m["workflows"] == 1000 and m["note"] == "x" and m["repeats"] == 3
    assert m["per_repeat"]["steps_per_s"] == [900.0, 1100.0, 1000.0]
    assert "repeat" not in m and "engine" not in m


def test_floor_quick_measures_the_bare_stack_and_stepd_side_by_side() -> None:
    """``python -m bench.floor --quick``: the bare server answers real frames and
    requests (it checks its results), then stepd's B runs; every figure is there."""
    proc = subprocess.run(
        [sys.executable, "-m", "bench.floor", "--quick"],
        cwd=ROOT, capture_output=True, text=True, timeout=90, check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r.get("round") for r in rows[:-1]] == [0]
    medians = rows[-1]["medians"]
    for key in ("ws_steps_per_s", "http_workflows_per_s", "commit_ms_plain", "commit_ms_handed",
                "stepd_steps_per_s", "stepd_daemon_cpu_us_per_step"):
        assert medians[key] > 0, key
    assert "x the floor" in proc.stdout
