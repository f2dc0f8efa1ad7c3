"""The timer index actor: wakes passivated runs when their next deadline comes.

Active run actors keep their own timers. A passivated run has no actor, so its
next deadline lives in the durable `timers` table (written by the same
transaction that passivated it). This actor sleeps until the earliest entry,
then re-activates every run that is due; the run's own `on_start` arms its
timer and fires it, and its transaction moves or deletes the index entry.

A run that passivates with a deadline tells it (`TimerIndexChanged`, after
the entry is committed); the actor re-arms if it is earlier than what it
sleeps towards. After a restart it rescans the table, so a message lost to a
restart costs nothing.

It also sweeps the live leases (lease.py "lazy expiry"): a fresh lease
arms no expiry timer of its own while a sweep is asked for by its deadline
(`LeasesDueBy`); at that time every live lease of the process hears `Due`,
checks its expiry and arms its own timer. Every start of this actor sweeps at
once, so a sweep timer lost with a killed incarnation leaves no lease
without an expiry.
"""

from __future__ import annotations

from typing import Any

import anyio
import anyio.lowlevel

from stepd.actors import Actor
from stepd.storage import parse_timer_key

from . import peers, store
from .messages import Due, LeasesDueBy, SweepLeases, TimerIndexChanged
from .services import Services

#: Wake at most this many runs per turn, so a burst of due timers does not hold
#: the actor (and its mailbox) for long; the next turn follows at once.
BATCH = 256
#: Wakes between two turns of the event loop within a batch.
YIELD_EVERY = 16

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
    mailbox_size = 1 << 16

    def __init__(self, services: Services) -> None:
        self.s = services
        self.armed_for: int | None = None
        self.cursor: bytes | None = None  # where the current sweep goes on
        self.leases_at: int | None = None  # the lease sweep armed (ms)

    async def on_start(self) -> None:
        self._rearm(settle=False)
        # A lease sweep asked of a killed incarnation died with its timer: sweep now
        # (each live lease arms its own timer; one left lazy asks anew).
        await peers.sweep_leases(self.s)

    async def receive(self, message: Any) -> Any:
        if isinstance(message, TimerIndexChanged):
            if self.cursor is None and (self.armed_for is None or message.due < self.armed_for):
                self._arm_at(message.due)
            return None
        if isinstance(message, Due):
            await self._sweep()
            return None
        if isinstance(message, LeasesDueBy):
            if self.leases_at is None or message.due < self.leases_at:
                self.leases_at = message.due
                peers.arm_at(self.s, self, "leases", message.due, SweepLeases())
            return None
        if isinstance(message, SweepLeases):
            self.leases_at = None
            await peers.sweep_leases(self.s)
            return None
        raise TypeError(f"timers: unexpected message {message!r}")

    async def _sweep(self) -> None:
        """Wake every run whose deadline has come, in due order, a batch per turn.

        The cursor keeps a sweep of 100,000 due runs linear: each turn reads
        on from where the last stopped. Waking a run twice is harmless (an
        active run's actor is simply there), so nothing needs remembering
        beyond the cursor.
        """
        now = self.s.clock.time_ms()
        rows = self.s.storage.scan(store.TIMERS, start=self.cursor, limit=BATCH)
        for i, (key, _) in enumerate(rows):
            due, run_id, _tag = parse_timer_key(key)
            if due > now:
                self.cursor = None
                self._arm_at(due)
                return
            self.cursor = key + b"\x00"
            if i and i % YIELD_EVERY == 0:
                # A wake of an idle run starts its actor inline (light actors): without
                # this, a batch of them holds the event loop for the whole batch.
                await anyio.lowlevel.checkpoint()
            await peers.wake_run(self.s, run_id, None)
        if len(rows) == BATCH:
            self.armed_for = None
            for _ in range(200):  # at most ~1 s of pause per batch
                if peers.active_runs(self.s) <= MAX_ACTIVE_RUNS:
                    break
                await anyio.sleep(0.005)
            self.ref.tell_nowait(Due())  # more to sweep: next turn
            return
        self.cursor = None
        self._rearm(settle=True)

    def _rearm(self, *, settle: bool) -> None:
        rows = self.s.storage.scan(store.TIMERS, limit=1)
        if not rows:
            self.armed_for = None
            self.cancel_timer("due")
            return
        due, _run_id, _tag = parse_timer_key(rows[0][0])
        now = self.s.clock.time_ms()
        if settle and due <= now:
            due = now + SETTLE_MS  # woken runs are still moving their entries
        self._arm_at(due)

    def _arm_at(self, due_ms: int) -> None:
        self.armed_for = due_ms
        peers.arm_due(self.s, self, due_ms)
