"""Fail an async test whose event loop is blocked by a synchronous call.

How: while an async test runs, a beat task inside the test's own event loop
stamps the time every few milliseconds, and a watchdog thread outside it checks
the stamp. When the stamp goes stale for longer than the threshold, the
watchdog snapshots the loop thread's stack (``sys._current_frames``), so the
failure names the call that held the loop, not just the fact that it was held.

It is backend-agnostic (asyncio and trio alike) and costs one thread per async
test. The threshold is generous (``STEPD_LOOP_BLOCK_MS``, default 500 ms): a
synced LMDB commit takes ~0.2 ms (p99 ~7 ms), so a fsync on the loop shows up
in aggregate while noise on a busy CI machine does not. Mark a test
``loop_block_ok`` to turn the guard off for it.

Time the loop thread spent runnable but waiting for a core does not count:
on a loaded 2-core machine the scheduler can leave the loop thread off the CPU
for over half a second while it holds nothing, and a guard that blamed the
code for that failed tests at random. Linux's per-thread ``schedstat`` gives
that wait (``run_delay``); the guard subtracts it from the stale time. What
stays counted is what the code did: CPU work on the loop (a GC pause
included) and blocking calls (a sleep, an fsync). Without ``schedstat`` the
guard counts wall time, as before.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Generator
from typing import Any

import pytest

THRESHOLD_S = float(os.environ.get("STEPD_LOOP_BLOCK_MS", "500")) / 1000.0
BEAT_S = 0.005


class LoopWatch:
    """The shared state between the beat task and the watchdog thread."""

    def __init__(self, threshold_s: float) -> None:
        self.threshold_s = threshold_s
        self.last_beat = time.monotonic()
        self.loop_thread: int | None = None
        self.violation: str | None = None
        self.worst_s = 0.0
        self._native_id: int | None = None
        self._beat_seen = 0.0
        self._delay_at_beat = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="loop-guard", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def beat(self) -> None:
        self.loop_thread = threading.get_ident()
        self._native_id = threading.get_native_id()
        self.last_beat = time.monotonic()

    def _run_delay_s(self) -> float:
        """The loop thread's total time runnable but off the CPU (0 where unknown)."""
        try:
            with open(f"/proc/self/task/{self._native_id}/schedstat", "rb") as f:
                return int(f.read().split()[1]) / 1e9
        except (OSError, IndexError, ValueError):
            return 0.0

    def _watch(self) -> None:
        while not self._stop.wait(BEAT_S * 2):
            if self.loop_thread is None:
                continue
            beat = self.last_beat
            delay = self._run_delay_s()
            if beat != self._beat_seen:  # a fresh beat: the wait is counted from here
                self._beat_seen, self._delay_at_beat = beat, delay
            waited = delay - self._delay_at_beat
            stale = time.monotonic() - beat - waited
            self.worst_s = max(self.worst_s, stale)
            if stale > self.threshold_s and self.violation is None:
                frame = sys._current_frames().get(self.loop_thread)
                stack = "".join(traceback.format_stack(frame)) if frame else "<no frame>"
                self.violation = (
                    f"event loop blocked for more than {self.threshold_s * 1000:.0f} ms "
                    f"by a synchronous call ({stale * 1000:.0f} ms, not counting "
                    f"{waited * 1000:.0f} ms waiting for a core); loop thread stack at "
                    f"that moment:\n{stack}"
                )


def _guarded(test: Callable[..., Any], watch: LoopWatch) -> Callable[..., Any]:
    import anyio

    @functools.wraps(test)
    async def run_guarded(*args: Any, **kwargs: Any) -> Any:
        result: list[Any] = []
        failure: list[BaseException] = []

        async def beat() -> None:
            while True:
                watch.beat()
                await anyio.sleep(BEAT_S)

        watch.beat()  # arm the watchdog before the test's first synchronous stretch
        async with anyio.create_task_group() as tg:
            tg.start_soon(beat)
            try:
                result.append(await test(*args, **kwargs))
            except anyio.get_cancelled_exc_class():
                raise
            except BaseException as exc:  # re-raised below, unwrapped by the task group
                failure.append(exc)
            finally:
                tg.cancel_scope.cancel()
        if failure:
            raise failure[0]
        return result[0] if result else None

    return run_guarded


@pytest.hookimpl(hookwrapper=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> Generator[None, Any, None]:
    test = pyfuncitem.obj
    if not inspect.iscoroutinefunction(test) or pyfuncitem.get_closest_marker("loop_block_ok"):
        yield
        return
    watch = LoopWatch(THRESHOLD_S)
    pyfuncitem.obj = _guarded(test, watch)
    watch.start()
    try:
        outcome = yield
    finally:
        watch.stop()
        pyfuncitem.obj = test
    if watch.violation is not None and outcome.excinfo is None:
        pytest.fail(watch.violation, pytrace=False)
