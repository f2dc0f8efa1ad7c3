"""Test configuration shared by the whole suite.

Three things live here:

* ``anyio_backend``: async tests run on asyncio (in debug mode) and on trio
  unless a module narrows the parameter.
* ``stepd_wheel``: the project's wheel, built once per session. Two tests read
  it (tests/test_packaging.py, tests/console/test_wheel.py) and neither writes
  to it; building it is ~8 s of pip a time, so they share one build.
* The loop-block guard (``tests/_loopguard.py``): an async test fails when
  its event loop stops turning for longer than a threshold, and the failure
  shows the stack of the call that blocked it. LMDB fsyncs must happen off the
  loop (DESIGN.md), and a blocked loop shows up as latency, never as an error,
  unless something looks for it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest_plugins = ["tests._loopguard", "pytester"]


@pytest.fixture(
    params=[
        pytest.param(("asyncio", {"debug": True}), id="asyncio"),
        pytest.param(("trio", {}), id="trio"),
    ]
)
def anyio_backend(request: pytest.FixtureRequest) -> tuple[str, dict[str, object]]:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture(scope="session")
def stepd_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``pip wheel`` of the repository (no deps, no build isolation), built once."""
    root = Path(__file__).resolve().parent.parent
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(root), "--no-deps", "--no-build-isolation",
         "-q", "-w", str(out)],
        check=True, cwd=out, timeout=300,
    )
    (wheel,) = out.glob("stepd-*.whl")
    return wheel
