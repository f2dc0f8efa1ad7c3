"""Test configuration shared by the whole suite.

Five things live here:

* ``anyio_backend``: async tests run on asyncio (in debug mode) and on trio
  unless a module narrows the parameter.
* ``stepd_wheel``: the project's wheel, built once per session. Two tests read
  it (tests/test_packaging.py, tests/console/test_wheel.py) and neither writes
  to it; building it is ~8 s of pip a time, so they share one build.
* ``_subprocess_bytecode``: the session's Python subprocesses share one
  bytecode cache (see the fixture).
* The collector and the suite's own heap (`pytest_configure`,
  `pytest_collection_finish`): what collection leaves alive is frozen out of
  the collector's way.
* The loop-block guard (``tests/_loopguard.py``): an async test fails when
  its event loop stops turning for longer than a threshold, and the failure
  shows the stack of the call that blocked it. LMDB fsyncs must happen off the
  loop (DESIGN.md), and a blocked loop shows up as latency, never as an error,
  unless something looks for it.
"""

from __future__ import annotations

import gc
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest_plugins = ["tests._loopguard", "pytester"]


def pytest_configure(config: pytest.Config) -> None:
    """No cyclic collection while the suite is collected (see `pytest_collection_finish`)."""
    gc.disable()


def pytest_collection_finish(session: pytest.Session) -> None:
    """One collection, then freeze what is alive (``gc.freeze``) and collect as usual.

    Importing and collecting 2,270 tests leaves ~300,000 tracked objects alive
    for the whole session (modules, hypothesis and schemathesis, the items).
    Each full collection walks all of them: 29 during collection and 22 during
    the tests of one full run, 0.4-1.5 s each on the loaded 2-core host (31 s
    in all), and one in an async test is a stall of the loop under test (the
    loop guard's failures of this kind, tests/_loopguard.py). Frozen, they are
    never walked again; what the tests create is collected as before. The
    product does the same with its start-up objects (`stepd.tune_gc`).
    """
    gc.collect()
    gc.freeze()
    gc.enable()


@pytest.fixture(
    params=[
        pytest.param(("asyncio", {"debug": True}), id="asyncio"),
        pytest.param(("trio", {}), id="trio"),
    ]
)
def anyio_backend(request: pytest.FixtureRequest) -> tuple[str, dict[str, object]]:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture(scope="session", autouse=True)
def _subprocess_bytecode(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Let the session's Python subprocesses cache bytecode, under the session's tmp dir.

    Hosts and CI images often set ``PYTHONDONTWRITEBYTECODE=1`` (this one does),
    and then every ``stepd serve``, worker and CLI subprocess a test starts
    compiles stepd's ~135 modules from source again (stepd is installed
    editable, so no install step compiled them): importing the daemon, CLI and
    worker took 1.2-1.4 s of CPU without a cache and 0.8-0.9 s with one.
    ``PYTHONPYCACHEPREFIX`` puts the cache in the session's tmp dir, not in the
    source tree. Python then reads bytecode from there alone, so the first child
    compiles its dependencies too (~3 s of CPU once); every later one reads.
    This process keeps its own flags (they are read at start-up).
    """
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PYTHONPYCACHEPREFIX", str(tmp_path_factory.mktemp("pycache")))
        env.delenv("PYTHONDONTWRITEBYTECODE", raising=False)
        yield


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
