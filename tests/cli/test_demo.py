"""``stepd demo``: the README's first command runs end to end and exits 0, in seconds."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from .conftest import stepd_process

pytestmark = pytest.mark.timeout(90)


def test_demo_runs_end_to_end(tmp_path: Path) -> None:
    t0 = time.monotonic()
    r = stepd_process("demo", "--runs", "2", "--data", str(tmp_path / "data"), timeout=60)
    elapsed = time.monotonic() - t0
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    # the journal, live: task steps, the for_each with a retried item, the wait and its signal
    for text in ("run_started", "step_offered", "execute_task[1] #1", "retryable: upstream 503",
                 "execute_task[1] #2", "the reviewer approves", "signal_received",
                 "run_completed", "to demo-worker"):
        assert text in out, text
    assert "the same run" in out  # the idempotency key returned the original run
    # the final status: results, budget usage, tokens and cost
    assert re.search(r"total: [\d,]+ input and [\d,]+ output tokens, \$0\.\d{6}", out)
    assert "max_transitions" in out and "max_cost_units" in out
    assert "every run completed" in out
    assert out.count("completed │") >= 2
    assert (tmp_path / "data").is_dir()
    assert elapsed < 30, elapsed
    assert r.stderr == ""
