"""The loop-block guard catches a synchronous call that holds the event loop."""

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
import time
import anyio

async def test_blocks():
    time.sleep(0.4)   # a synchronous call on the loop, like an fsync done in place

async def test_does_not_block():
    await anyio.to_thread.run_sync(time.sleep, 0.4)
"""
    )
    pytester.makeini("[pytest]\nanyio_mode = auto\n")
    result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, failed=2)
    result.stdout.fnmatch_lines(["*event loop blocked for more than 150 ms*"])
    result.stdout.fnmatch_lines(["*time.sleep(0.4)*"])
