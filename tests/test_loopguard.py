"""The loop-block guard catches a synchronous call that holds the event loop.

One inner pytest run (a subprocess, ~2 s) holds every case, each on both backends:
a sleep on the loop fails; the same sleep in a thread passes; garbage collections
that hold the loop for as long pass (the suite's heap, not the code: see
tests/_loopguard.py); and a block reported by the guard leaves nothing of the
blocked moment alive (the watchdog keeps no frame).
"""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_guard_fails_a_test_that_blocks_the_loop(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.setenv("STEPD_LOOP_BLOCK_MS", "150")
    pytester.makeconftest(
        """
import pytest
pytest_plugins = ["tests._loopguard"]

@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):
    return request.param
"""
    )
    pytester.makepyfile(
        test_inner="""
import gc
import time
import weakref
import anyio

async def test_blocks():
    time.sleep(0.4)   # a synchronous call on the loop, like an fsync done in place

async def test_does_not_block():
    await anyio.to_thread.run_sync(time.sleep, 0.4)

async def test_collects():
    junk = [[] for _ in range(20_000)]   # something for each collection to walk
    collections = 0
    start = time.monotonic()
    while time.monotonic() - start < 0.4:   # 0.4 s on the loop, all of it in collections
        gc.collect()
        collections += 1
    assert collections > 1 and junk

class Held:
    pass

def hold(thing):
    time.sleep(0.4)   # the watchdog snapshots the stack here, this frame included

async def test_blocks_and_keeps_nothing():
    thing = Held()
    ref = weakref.ref(thing)
    hold(thing)
    del thing
    assert ref() is None, "the guard still holds the blocked frame and its locals"
"""
    )
    pytester.makeini("[pytest]\nanyio_mode = auto\n")
    result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider", "-rf")
    result.assert_outcomes(passed=4, failed=4)
    failed = sorted(line.split()[1] for line in result.outlines if line.startswith("FAILED"))
    assert failed == [f"test_inner.py::{name}[{backend}]"
                      for name in ("test_blocks", "test_blocks_and_keeps_nothing")
                      for backend in ("asyncio", "trio")], failed
    assert result.stdout.str().count("event loop blocked for more than 150 ms") >= 4
    result.stdout.fnmatch_lines(["*ms collecting garbage); loop thread stack at that moment:*"])
    result.stdout.fnmatch_lines(["*time.sleep(0.4)*"])
    result.stdout.no_fnmatch_line("*the guard still holds the blocked frame*")
