"""`stepd.tune_gc` and ``stepd serve --gc``: run in child processes, never in this one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from stepd.daemon import ServeConfig, run
from stepd.sansio.errors import Invalid

_PROBE = """
import gc, stepd
before = gc.get_threshold()
stepd.tune_gc()
after = gc.get_threshold()
print(before[0], after[0], after[1:] == before[1:], gc.get_freeze_count() > 1000, gc.isenabled())
"""


def test_tune_gc_freezes_startup_objects_and_raises_the_young_threshold() -> None:
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                         timeout=60, check=True).stdout.split()
    assert out == ["700", "10000", "True", "True", "True"]


def test_an_unknown_gc_setting_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(Invalid) as caught:
        run(ServeConfig(data=str(tmp_path / "data"), port=0, gc="off"))
    assert caught.value.field == "gc"
    assert not (tmp_path / "data").exists()  # refused before anything was opened
    proc = subprocess.run(
        [sys.executable, "-m", "stepd", "serve", "--data", str(tmp_path / "d"), "--gc", "off"],
        capture_output=True, text=True, timeout=30, check=False,
        env={k: v for k, v in os.environ.items() if not k.startswith("STEPD_")},
    )
    assert proc.returncode == 2 and "--gc" in proc.stderr, proc
