"""The timer index actor: wakes passivated runs when their next deadline comes.

(It also forgets idle workers, on a timer of its own: `WorkersDue`.)

Active run actors keep their own timers. A passivated run has no actor, so its
next deadline lives in the durable `timers` table (written by the same
transaction that passivated it). This actor sleeps until the earliest entry,
then re-activates every run that is due; the run's own `on_start` arms its
timer and fires it, and its transaction moves or deletes the index entry.

A run that passivates with a deadline reports it (`Engine.timer_index_changed`,
after the entry is committed) as a hint plus one `TimerIndexChanged` poke; the
actor takes the hint on every message and re-arms if it is earlier than what
it sleeps towards. After a restart it rescans the table, so a lost poke costs
nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio

from stepd.actors import Actor
from stepd.storage import parse_timer_key

from . import store
from .messages import Due

if TYPE_CHECKING:
    from .engine import Engine


@dataclass(frozen=True, slots=True)
class TimerIndexChanged:
    """A poke: take the engine's timer hint."""


@dataclass(frozen=True, slots=True)
class WorkersDue:
    """Time to forget the workers idle past their expiry (`Engine.expire_workers`)."""


#: How often idle workers are looked for: a quarter of the expiry, within 1 s .. 60 s.
def workers_sweep_s(expiry_ms: int) -> float:
    return min(60.0, max(1.0, expiry_ms / 4000))


#: Wake at most this many runs per turn, so a burst of due timers does not hold
#: the actor (and its mailbox) for long; the next turn follows at once.
BATCH = 256

#: After a sweep, runs it woke may not have moved their index entries yet;
#: look again this much later (ms) rather than spin on them.
SETTLE_MS = 50

#: While more run actors than this are alive, a sweep waits a moment between
#: batches: waking is much cheaper than what a woken run does, and without
#: the pause a sweep of 100,000 due runs would hold them all in memory at once
#: (bench workload E: 1.5 GB).
MAX_ACTIVE_RUNS = 2000


class TimerActor(Actor):
    kind = "timers"

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.armed_for: int | None = None
        self.cursor: bytes | None = None  # where the current sweep goes on

    async def on_start(self) -> None:
        self.engine.take_timer_hint()  # the scan covers it: hints are committed first
        self._rearm(settle=False)
        self._arm_workers()

    async def receive(self, message: Any) -> Any:
        if isinstance(message, Due):
            await self._sweep()
        elif isinstance(message, WorkersDue):
            await self.engine.expire_workers()
            self._arm_workers()
            return None
        elif not isinstance(message, TimerIndexChanged):
            raise TypeError(f"timers: unexpected message {message!r}")
        hint = self.engine.take_timer_hint()
        if hint is not None and (self.armed_for is None or hint < self.armed_for):
            self._arm_at(hint)
        return None

    async def _sweep(self) -> None:
        """Wake every run whose deadline has come, in due order, a batch per turn.

        The cursor keeps a sweep of 100,000 due runs linear: each turn reads
        on from where the last stopped. Waking a run twice is harmless (an
        active run's actor is simply there), so nothing needs remembering
        beyond the cursor.
        """
        now = self.engine.clock.time_ms()
        rows = self.engine.storage.scan(store.TIMERS, start=self.cursor, limit=BATCH)
        for key, _ in rows:
            due, run_id, _tag = parse_timer_key(key)
            if due > now:
                self.cursor = None
                self._arm_at(due)
                return
            self.cursor = key + b"\x00"
            await self.engine.wake_run(run_id, None)
        if len(rows) == BATCH:
            self.armed_for = None
            for _ in range(200):  # at most ~1 s of pause per batch
                if self.engine.active_runs() <= MAX_ACTIVE_RUNS:
                    break
                await anyio.sleep(0.005)
            self.ref.tell_nowait(Due())  # more to sweep: next turn
            return
        self.cursor = None
        self._rearm(settle=True)

    def _rearm(self, *, settle: bool) -> None:
        rows = self.engine.storage.scan(store.TIMERS, limit=1)
        if not rows:
            self.armed_for = None
            self.cancel_timer("due")
            return
        due, _run_id, _tag = parse_timer_key(rows[0][0])
        now = self.engine.clock.time_ms()
        if settle and due <= now:
            due = now + SETTLE_MS  # woken runs are still moving their entries
        self._arm_at(due)

    def _arm_workers(self) -> None:
        expiry = self.engine.config.worker_expiry_ms
        if expiry > 0:
            self.arm_timer("workers", self.clock.now() + workers_sweep_s(expiry), WorkersDue())

    def _arm_at(self, due_ms: int) -> None:
        clock = self.clock
        self.armed_for = due_ms
        self.arm_timer("due", clock.now() + max(0, due_ms - clock.time_ms()) / 1000.0, Due())
