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


_EMBEDDED_PROBE = """
import asyncio, gc, sys, tempfile, stepd
from stepd.gc_policy import YOUNG_THRESHOLD
policy = sys.argv[1]
gc.set_threshold(*{threshold})
async def main():
    with tempfile.TemporaryDirectory() as d:
        async with stepd.embedded(d, gc=policy):
            inside = gc.get_threshold()[0]
            frozen = gc.get_freeze_count()
        print(inside, gc.get_threshold()[0], frozen > 1000)
asyncio.run(main())
"""


@pytest.mark.parametrize(("policy", "threshold", "expected"), [
    ("young", (700, 10, 10), ["10000", "700", "False"]),  # raised while open, put back after
    ("default", (700, 10, 10), ["700", "700", "False"]),
    ("tuned", (700, 10, 10), ["10000", "10000", "True"]),  # tune_gc: for good, frozen
    ("young", (0, 10, 10), ["0", "0", "False"]),  # a host that switched collection off
    ("young", (50_000, 10, 10), ["50000", "50000", "False"]),  # one that set a higher one
])
def test_an_embedded_daemon_applies_its_gc_policy_while_open(
        policy: str, threshold: tuple[int, int, int], expected: list[str]) -> None:
    probe = _EMBEDDED_PROBE.replace("{threshold}", repr(threshold))
    out = subprocess.run([sys.executable, "-c", probe, policy], capture_output=True, text=True,
                         timeout=60, check=True).stdout.split()
    assert out == expected


def test_the_host_threshold_set_meanwhile_is_kept() -> None:
    """A host that changes the threshold while the daemon is open keeps its own after."""
    probe = """
import asyncio, gc, tempfile, stepd
async def main():
    with tempfile.TemporaryDirectory() as d:
        async with stepd.embedded(d):
            gc.set_threshold(2000, 10, 10)
        print(gc.get_threshold()[0])
asyncio.run(main())
"""
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=60, check=True).stdout.split()
    assert out == ["2000"]


def test_an_unknown_embedded_gc_policy_is_refused_by_name(tmp_path: Path) -> None:
    import stepd

    with pytest.raises(Invalid) as caught:
        stepd.embedded(tmp_path / "data", gc="off")
    assert caught.value.field == "gc"
    assert not (tmp_path / "data").exists()
