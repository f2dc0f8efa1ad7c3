"""Actor timers: one service task per actor system, one heap, no task per timer.

An actor arms a one-shot timer with ``arm_timer(key, deadline, message)``.
Rather than one task per timer, or even one per actor, a single service task
per `ActorSystem` sleeps (through the system's `Clock`) until the earliest
deadline among all live actors' timers. When a deadline passes, the service
appends the entry to the owning incarnation's *system queue* and pokes its
mailbox; the actor then handles `message` through `receive` like a told
message. Thousands of live actors with a timer each cost one sleeping task and
one heap entry apiece.

Rules the rest of the runtime relies on:

* Re-arming a key replaces its timer; cancelling forgets it; both take effect
  even if the timer has fired but the actor has not handled it yet (the entry
  is checked again at delivery), so a cancelled timer never delivers.
* When an incarnation stops or dies, all its timers are cancelled; the next
  incarnation starts with none.
* Fired timers are queued in deadline order, ahead of mailbox messages not yet
  handled (the system queue is served first).
* Cancelled entries stay in the heap until they surface (lazy deletion); the
  heap is rebuilt when they outnumber live ones, so re-arming on every
  heartbeat does not grow it without bound.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Hashable
from typing import Any, Protocol

import anyio
from anyio.abc import TaskStatus

from ._clock import Clock
from ._types import NO_ITEMS, NO_TIMERS

__all__ = ["TimerEntry", "TimerOwner", "TimerService"]

_ARMED = 0
_FIRED = 1
_CANCELLED = 2


class TimerOwner(Protocol):
    """What the timer service needs of the incarnation owning a timer (a `Runtime`)."""

    # Written: both start as the shared empties (`_types.NO_ITEMS`, `NO_TIMERS`).
    timers: dict[Hashable, TimerEntry]
    sysq: deque[Any]

    def notify(self) -> None: ...


class TimerEntry:
    """One armed timer. Lives in the heap, and in its owner's `timers` dict."""

    __slots__ = ("deadline", "key", "message", "owner", "state")

    def __init__(self, owner: TimerOwner, key: Hashable, deadline: float, message: object) -> None:
        self.owner = owner
        self.key = key
        self.deadline = deadline
        self.message = message
        self.state = _ARMED

    @property
    def cancelled(self) -> bool:
        return self.state == _CANCELLED


class TimerService:
    """The per-system timer heap and the task that sleeps until its head."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._heap: list[tuple[float, int, TimerEntry]] = []
        self._seq = itertools.count()
        self._live = 0
        # The deadline the service task sleeps until, and the scope to cancel
        # to wake it early. -inf while it is not sleeping: it re-reads the heap
        # before it sleeps again, so nobody needs to wake it.
        self._target = -math.inf
        self._wake_scope: anyio.CancelScope | None = None

    @property
    def live(self) -> int:
        """Return the number of armed timers not yet fired or cancelled."""
        return self._live

    def arm(self, owner: TimerOwner, key: Hashable, deadline: float, message: object) -> None:
        """Arm (or re-arm) `owner`'s timer `key`."""
        timers = owner.timers
        if timers is NO_TIMERS:
            timers = owner.timers = {}  # its first timer: its own dict
        elif key in timers:
            self._retire(timers.pop(key))
        entry = TimerEntry(owner, key, deadline, message)
        timers[key] = entry
        heapq.heappush(self._heap, (deadline, next(self._seq), entry))
        self._live += 1
        if deadline < self._target and self._wake_scope is not None:
            self._wake_scope.cancel()

    def cancel(self, owner: TimerOwner, key: Hashable) -> bool:
        """Cancel `owner`'s timer `key`; return whether there was one."""
        entry = owner.timers.pop(key, None)
        if entry is None:
            return False
        self._retire(entry)
        return True

    def cancel_all(self, owner: TimerOwner) -> None:
        """Cancel every timer of `owner` (its incarnation ends)."""
        timers = owner.timers
        while timers:  # `_retire()` inlined, the heap compacted once at the end
            entry = timers.popitem()[1]
            if entry.state == _ARMED:
                self._live -= 1
            entry.state = _CANCELLED
        heap = self._heap
        if len(heap) > 64 and len(heap) > 2 * self._live:
            self._compact()

    def delivered(self, entry: TimerEntry) -> bool:
        """Claim a fired entry for delivery; `False` if it was cancelled since."""
        if entry.state != _FIRED:
            return False
        owner = entry.owner
        if owner.timers.get(entry.key) is entry:
            del owner.timers[entry.key]
        entry.state = _CANCELLED
        return True

    def _retire(self, entry: TimerEntry) -> None:
        if entry.state == _ARMED:
            self._live -= 1
        entry.state = _CANCELLED
        heap = self._heap
        if len(heap) > 64 and len(heap) > 2 * self._live:
            self._compact()

    def _compact(self) -> None:
        """Drop the retired entries once they outnumber the live ones."""
        self._heap = [item for item in self._heap if item[2].state == _ARMED]
        heapq.heapify(self._heap)

    def _fire_due(self) -> None:
        now = self._clock.now()
        heap = self._heap
        while heap and heap[0][0] <= now:
            entry = heapq.heappop(heap)[2]
            if entry.state != _ARMED:
                continue
            entry.state = _FIRED
            self._live -= 1
            owner = entry.owner
            sysq = owner.sysq
            if sysq is NO_ITEMS:
                sysq = owner.sysq = deque()
            sysq.append(entry)
            owner.notify()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Fire due timers, then sleep until the next deadline; forever."""
        task_status.started()
        while True:
            self._fire_due()
            target = self._heap[0][0] if self._heap else math.inf
            with anyio.CancelScope() as scope:
                self._wake_scope = scope
                self._target = target
                await self._clock.sleep_until(target)
            self._wake_scope = None
            self._target = -math.inf
