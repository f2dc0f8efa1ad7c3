"""The scheduler: a ready queue of actors with work, and a pool of dispatcher tasks.

Actors own no task. An incarnation (`Runtime`) with pending work (a told
message, a queued ask, a fired timer, a child's exit, a stop request, an
`on_start` to run) and nobody running it is put on the ready queue; a
dispatcher task takes it, marks it busy (one handler at a time), serves a turn
(`Runtime.turn`: stop requests, then its system queue, then its mailbox, up
to `TURN` items), and puts it back at the end of the queue if work remains,
so one busy actor cannot starve the others.

The pool grows on demand and shrinks when idle:

* `awake` counts the dispatchers that are running turns (or were just woken or
  started to): not parked, and not waiting inside a handler. New work wakes (or
  starts) a dispatcher only when none is awake: handlers that never wait are
  served one after another by a single dispatcher, with no task switch
  between actors.
* A handler that waits (a storage commit, an ask to a busy actor) takes its
  dispatcher out of `awake` until it returns (`blocked` / `unblocked`, called
  by the driver); if work is ready meanwhile another dispatcher is woken or
  started. So as many handlers wait at once as there are actors with work,
  up to `max_dispatchers` (a storage writer batches their commits).
* A dispatcher that finds nothing to do parks on a `Waiter` (woken in LIFO
  order, the warmest first), or ends if `KEEP_IDLE` are parked already.

Every dispatcher is a task of one task group that the `ActorSystem` owns and
cancels when it stops. A dispatcher yields to the event loop (an anyio
checkpoint) after `YIELD_EVERY` handled items, so actors that keep each other
busy cannot hold the loop.
"""

from __future__ import annotations

from collections import deque

import anyio.lowlevel
from anyio.abc import TaskGroup

from ._runtime import Runtime
from ._turn import TURN
from ._turn import turn as _turn
from ._waiter import Waiter, cancel_scope_token

__all__ = ["DEFAULT_MAX_DISPATCHERS", "KEEP_IDLE", "TURN", "YIELD_EVERY", "Scheduler"]

#: Items a dispatcher handles before it yields to the event loop.
YIELD_EVERY = 128
#: Dispatchers kept parked when idle; any more end.
KEEP_IDLE = 8
#: The default bound on dispatchers (handlers waiting at once, plus one).
DEFAULT_MAX_DISPATCHERS = 1024

_checkpoint = anyio.lowlevel.checkpoint


class Scheduler:
    """The ready queue and the dispatcher pool of one `ActorSystem`."""

    __slots__ = ("awake", "count", "idle", "max", "peak", "ready", "started", "tg")

    def __init__(self, max_dispatchers: int = DEFAULT_MAX_DISPATCHERS) -> None:
        if isinstance(max_dispatchers, bool) or not isinstance(max_dispatchers, int) or (
            max_dispatchers < 1
        ):
            raise ValueError(f"max_dispatchers must be an int >= 1, got {max_dispatchers!r}")
        self.ready: deque[Runtime] = deque()
        self.idle: list[Waiter] = []  # parked dispatchers, the last parked woken first
        self.awake = 0
        self.count = 0  # dispatcher tasks alive
        self.max = max_dispatchers
        self.tg: TaskGroup | None = None  # set while the system runs
        self.started = 0  # dispatcher tasks started so far (introspection, tests)
        self.peak = 0  # the most dispatchers alive at once

    def schedule(self, rt: Runtime) -> None:
        """Queue `rt` (not busy, not queued) for a dispatcher; wake one if none is awake."""
        rt.scheduled = True
        self.ready.append(rt)
        if self.awake <= 0:
            self._wake()

    def blocked(self) -> None:
        """A dispatcher's handler waits: let another dispatcher serve the queue."""
        self.awake -= 1
        if self.awake <= 0 and self.ready:
            self._wake()

    def unblocked(self) -> None:
        """The handler that waited has returned: its dispatcher is awake again."""
        self.awake += 1

    def _wake(self) -> None:
        if self.idle:
            self.awake += 1
            self.idle.pop().set()
        elif self.count < self.max and self.tg is not None:
            self.count += 1
            self.awake += 1
            self.started += 1
            self.peak = max(self.peak, self.count)
            self.tg.start_soon(self._dispatch, name="stepd.actors dispatcher")

    async def _dispatch(self) -> None:
        turn = _turn
        base = cancel_scope_token()
        ready = self.ready
        handled = 0
        try:
            while True:
                while ready:
                    rt: Runtime | None = ready.popleft()
                    assert rt is not None
                    rt.scheduled = False
                    if rt.busy or rt.done:
                        continue
                    rt.busy = True
                    handled += await turn(rt, self, base)
                    rt = None  # hold no finished incarnation while parked (GC)
                    if handled >= YIELD_EVERY:
                        handled = 0
                        await _checkpoint()
                handled = 0
                if len(self.idle) >= KEEP_IDLE:
                    return
                waiter = Waiter()
                self.idle.append(waiter)
                self.awake -= 1
                try:
                    await waiter.wait()  # whoever woke us counted us awake again
                except BaseException:
                    if not waiter.is_set():
                        self.idle.remove(waiter)
                        self.awake += 1
                    raise
        finally:
            self.count -= 1
            self.awake -= 1

    def close(self) -> None:
        """The system stops: start no more dispatchers (its task group cancels the rest)."""
        self.tg = None
        self.ready.clear()
