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

Two kinds of stall are not the code's, and the guard subtracts both from the
stale time (the message says how much of each it left out):

* Time the loop thread spent runnable but waiting for a core: on a loaded
  2-core machine the scheduler can leave the loop thread off the CPU for over
  half a second while it holds nothing, and a guard that blamed the code for
  that failed tests at random. Linux's per-thread ``schedstat`` gives that
  wait (``run_delay``). Without ``schedstat`` it is counted, as before.
* Time in garbage collections, whichever thread ran them (``gc.callbacks``):
  a collection holds the GIL, so the loop waits for one run by a daemon or
  worker thread of a session fixture as much as for its own. A full
  collection walks every object of the test process, pytest's collected items
  and every session fixture's included, so its length measures the suite's
  heap, not the code under test: late in a full-suite run one took 0.5-0.6 s
  and failed whichever async test it landed in (a test's own ``gc.collect()``,
  a worker's TCP connect waiting to take the GIL back after ``os.stat``, trio's
  I/O thread waking the guest loop). The product's own collection cost is
  measured where it belongs: ``stepd.gc_policy`` and ``bench``.

What stays counted is what the code did: CPU work on the loop and blocking
calls (a sleep, an fsync).

The watchdog keeps no frame of the loop thread: it formats the stack at once
and drops it. A frame object outlives its call with all its locals while
someone holds it, so a held snapshot kept the objects of that moment alive
until the test ended (an actor that a garbage-free check then found still
reachable, with the violation itself unreported because the test had failed
first).
"""

from __future__ import annotations

import functools
import gc
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


def _stack_of(thread_id: int) -> str:
    """The formatted stack of a thread, holding none of its frames after the call."""
    frame = sys._current_frames().get(thread_id)
    return "".join(traceback.format_stack(frame)) if frame else "<no frame>"


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
        self._gc_s = 0.0  # time in finished collections since start()
        self._gc_started: float | None = None  # a collection in progress began then
        # The last beat and the collection time at that beat, set together by the
        # loop thread (one tuple: the watchdog reads them as a pair).
        self._mark = (self.last_beat, 0.0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="loop-guard", daemon=True)

    def start(self) -> None:
        gc.callbacks.append(self._on_gc)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        gc.callbacks.remove(self._on_gc)

    def beat(self) -> None:
        self.loop_thread = threading.get_ident()
        self._native_id = threading.get_native_id()
        self.last_beat = time.monotonic()
        self._mark = (self.last_beat, self._gc_s)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_started = time.monotonic()
        elif self._gc_started is not None:
            self._gc_s += time.monotonic() - self._gc_started
            self._gc_started = None

    def _collecting_s(self, now: float, beat: float, gc_at_beat: float) -> float:
        """Time in collections since `beat`, the one in progress included.

        A collection runs finalizers (Python code) after its walk, so the
        watchdog can get the GIL while one is still under way.
        """
        started = self._gc_started
        ongoing = now - max(started, beat) if started is not None else 0.0
        return self._gc_s - gc_at_beat + ongoing

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
            beat, gc_at_beat = self._mark
            delay = self._run_delay_s()
            if beat != self._beat_seen:  # a fresh beat: the wait is counted from here
                self._beat_seen, self._delay_at_beat = beat, delay
            waited = delay - self._delay_at_beat
            now = time.monotonic()
            collecting = self._collecting_s(now, beat, gc_at_beat)
            stale = now - beat - waited - collecting
            self.worst_s = max(self.worst_s, stale)
            if stale > self.threshold_s and self.violation is None:
                self.violation = (
                    f"event loop blocked for more than {self.threshold_s * 1000:.0f} ms "
                    f"by a synchronous call ({stale * 1000:.0f} ms, not counting "
                    f"{waited * 1000:.0f} ms waiting for a core and {collecting * 1000:.0f} ms "
                    f"collecting garbage); loop thread stack at that moment:\n"
                    f"{_stack_of(self.loop_thread)}"
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
            except BaseException as exc:  # noqa: BLE001 - re-raised below, unwrapped by the task group
                failure.append(exc)
            finally:
                tg.cancel_scope.cancel()
        if failure:
            raise failure[0]
        return result[0] if result else None

    return run_guarded


@pytest.hookimpl(wrapper=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> Generator[None, object, object]:
    """Run an async test under a `LoopWatch`.

    A new-style wrapper: a violation it raises is the test's failure, not a
    hook that failed in its teardown (pluggy's warning, an error here, used to
    come on top). A test that failed anyway keeps its own error and carries
    the guard's finding as a note, since the block may be why it failed.
    """
    test = pyfuncitem.obj
    if not inspect.iscoroutinefunction(test) or pyfuncitem.get_closest_marker("loop_block_ok"):
        return (yield)
    watch = LoopWatch(THRESHOLD_S)
    pyfuncitem.obj = _guarded(test, watch)
    watch.start()
    try:
        result = yield
    except BaseException as exc:
        if watch.violation is not None:
            exc.add_note(f"The loop guard also saw this: {watch.violation}")
        raise
    finally:
        watch.stop()
        pyfuncitem.obj = test
    if watch.violation is not None:
        pytest.fail(watch.violation, pytrace=False)
    return result
