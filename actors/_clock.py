"""Clocks: where actors read the time and wait for deadlines.

Domain time (lease expiry, run timers) is read through a `Clock` object passed
into the `ActorSystem`, never from `time` directly, so tests swap in a
`ManualClock` and check expiry logic in milliseconds of wall time. Operational
timeouts (an ask's `timeout`, a child's `shutdown` grace period) are not domain
time and use the event loop's own clock through anyio cancel scopes.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from typing import Protocol, runtime_checkable

import anyio
import anyio.lowlevel

from ._waiter import current_time as _current_time

__all__ = ["Clock", "ManualClock", "SystemClock"]

_NS = 1_000_000_000


@runtime_checkable
class Clock(Protocol):
    """The time source of an actor system.

    `now()` is monotonic seconds (the scale of deadlines given to
    `Actor.arm_timer`); `time_ms()` is wall-clock epoch milliseconds (for
    records such as `ActorStatistics.started_at`). The two are independent
    scales: never compare one with the other.
    """

    def now(self) -> float:
        """Return the monotonic time in seconds."""
        ...

    def time_ms(self) -> int:
        """Return the wall-clock time in milliseconds since the Unix epoch."""
        ...

    async def sleep_until(self, deadline: float) -> None:
        """Return once `now()` has reached `deadline` (at once if it already has).

        `deadline` may be `math.inf` (sleep until cancelled). It is a
        cancellation point.
        """
        ...


class SystemClock:
    """The real clock: the event loop's monotonic time and the system's wall time.

    `now()` is `anyio.current_time()` rather than `time.monotonic()` so that
    `sleep_until` and `now` share one scale on every backend (trio's clock has
    a random offset, and may be a `trio.testing.MockClock`). It must therefore
    be called from inside the event loop.
    """

    __slots__ = ()

    #: Return the event loop's monotonic time in seconds (`anyio.current_time()`
    #: without its backend lookup, and without a method of our own around it).
    #: Raises RuntimeError outside an event loop.
    now = staticmethod(_current_time)

    def time_ms(self) -> int:
        """Return the system wall-clock time in epoch milliseconds."""
        return time.time_ns() // 1_000_000

    async def sleep_until(self, deadline: float) -> None:
        """Sleep until the event loop's clock reaches `deadline`."""
        await anyio.sleep_until(deadline)

    def __repr__(self) -> str:
        return "SystemClock()"


class _Sleeper:
    __slots__ = ("deadline", "event")

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self.event = anyio.Event()


class ManualClock:
    """A virtual clock that moves only when told to, for tests.

    `advance(seconds)` / `advance_to(deadline)` move `now()` and `time_ms()`
    together and wake exactly the sleepers whose deadline is due by then, in
    deadline order (ties in arrival order). Time is kept as integer
    nanoseconds, so ``advance(0.999)`` then ``advance(0.001)`` lands on exactly
    ``start + 1.0`` and a deadline of ``now() + 1.0`` is due then, not a
    rounding error later.

    The order holds on every backend because wake-ups are relayed: `advance`
    wakes only the earliest due sleeper, and each woken sleeper wakes the next
    due one as it resumes. (Waking them all at once would leave the order to
    the scheduler, and trio deliberately shuffles tasks woken together.) Every
    woken sleeper sees the final `now()`. The woken tasks run at the event
    loop's next turns: `advance` itself does not wait for them.

    It is backend-agnostic (anyio events only), so it works on asyncio and trio.

    Args:
        start: the initial `now()`, in seconds.
        wall_ms: the initial `time_ms()` (epoch milliseconds).

    Raises:
        ValueError: if `start` is not finite or `wall_ms` is negative.
    """

    def __init__(self, start: float = 0.0, *, wall_ms: int = 1_700_000_000_000) -> None:
        if not math.isfinite(start):
            raise ValueError(f"start must be a finite number of seconds, got {start!r}")
        if wall_ms < 0:
            raise ValueError(f"wall_ms must be non-negative, got {wall_ms!r}")
        self._start_ns = round(start * _NS)
        self._now_ns = self._start_ns
        self._wall_ms = int(wall_ms)
        self._sleepers: list[tuple[float, int, _Sleeper]] = []
        self._seq = itertools.count()
        # A sleeper has been woken and has not resumed yet: it holds the relay.
        self._relay_held = False

    def now(self) -> float:
        """Return the virtual monotonic time in seconds."""
        return self._now_ns / _NS

    def time_ms(self) -> int:
        """Return the virtual wall-clock time in epoch milliseconds."""
        return self._wall_ms + (self._now_ns - self._start_ns) // 1_000_000

    def advance(self, seconds: float) -> None:
        """Move time forward by `seconds` and wake the sleepers now due.

        Raises:
            ValueError: if `seconds` is negative or not finite.
        """
        if not (math.isfinite(seconds) and seconds >= 0):
            raise ValueError(f"seconds must be a finite non-negative number, got {seconds!r}")
        self._set_ns(self._now_ns + round(seconds * _NS))

    def advance_to(self, deadline: float) -> None:
        """Move time forward to `deadline` and wake the sleepers now due.

        Raises:
            ValueError: if `deadline` is earlier than `now()` or not finite.
        """
        if not math.isfinite(deadline):
            raise ValueError(f"deadline must be finite, got {deadline!r}")
        target = round(deadline * _NS)
        if target < self._now_ns:
            raise ValueError(f"cannot move a clock backwards (now {self.now()}, asked {deadline})")
        self._set_ns(target)

    def next_deadline(self) -> float | None:
        """Return the earliest deadline anyone sleeps until, or `None` (for autojumps)."""
        for deadline, _, _ in sorted(self._sleepers):
            if math.isfinite(deadline):
                return deadline
        return None

    async def sleep_until(self, deadline: float) -> None:
        """Wait until the clock is advanced to `deadline` or beyond.

        A cancellation point even when `deadline` has passed already.
        """
        if deadline <= self.now():
            await anyio.lowlevel.checkpoint()
            return
        sleeper = _Sleeper(deadline)
        entry = (deadline, next(self._seq), sleeper)
        heapq.heappush(self._sleepers, entry)
        try:
            await sleeper.event.wait()
        finally:
            if sleeper.event.is_set():
                # Woken (even if cancelled right after): pass the relay on.
                self._relay_held = False
                self._wake_next()
            else:
                # Cancelled: forget it now (few sleepers, so O(n) is fine), or
                # the heap would fill with sleepers nobody waits for.
                self._sleepers.remove(entry)
                heapq.heapify(self._sleepers)

    def _set_ns(self, now_ns: int) -> None:
        self._now_ns = now_ns
        self._wake_next()

    def _wake_next(self) -> None:
        sleepers = self._sleepers
        if self._relay_held or not sleepers or sleepers[0][0] > self.now():
            return
        self._relay_held = True
        heapq.heappop(sleepers)[2].event.set()

    def __repr__(self) -> str:
        return f"ManualClock(now={self.now()!r}, sleepers={len(self._sleepers)})"
