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
