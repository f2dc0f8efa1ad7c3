"""The timer index actor: wakes passivated runs when their next deadline comes.

Active run actors keep their own timers. A passivated run has no actor, so its
next deadline lives in the durable `timers` table (written by the same
transaction that passivated it). This actor sleeps until the earliest entry,
then re-activates every run that is due; the run's own `on_start` arms its
timer and fires it, and its transaction moves or deletes the index entry.

Run actors tell it `TimerIndexChanged` when they persist an earlier deadline
than the one it sleeps towards; after a restart it rescans the table, so a lost
tell costs nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from stepd.actors import Actor
from stepd.storage import parse_timer_key

from . import store
from .messages import Due

if TYPE_CHECKING:
    from .engine import Engine


@dataclass(frozen=True, slots=True)
class TimerIndexChanged:
    due_ms: int


#: Wake at most this many runs per turn, so a burst of due timers does not hold
#: the actor (and its mailbox) for long; the next turn follows at once.
BATCH = 256


class TimerActor(Actor):
    kind = "timers"

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.armed_for: int | None = None
        self.woken: dict[str, int] = {}  # run id -> the due time we woke it for

    async def on_start(self) -> None:
        self._rearm()

    async def receive(self, message: Any) -> Any:
        if isinstance(message, TimerIndexChanged):
            if self.armed_for is None or message.due_ms < self.armed_for:
                self._arm_at(message.due_ms)
            return None
        if isinstance(message, Due):
            await self._fire()
            return None
        raise TypeError(f"timers: unexpected message {message!r}")

    def _scan(self, limit: int) -> list[tuple[int, str]]:
        rows = self.engine.storage.scan(store.TIMERS, limit=limit)
        out = []
        for key, _ in rows:
            due, run_id, _tag = parse_timer_key(key)
            out.append((due, run_id))
        return out

    async def _fire(self) -> None:
        now = self.engine.clock.time_ms()
        due_rows = [(d, r) for d, r in self._scan(BATCH + len(self.woken)) if d <= now]
        seen = set()
        for due, run_id in due_rows:
            seen.add(run_id)
            if self.woken.get(run_id) == due:
                continue  # woken already; its own actor handles the deadline
            self.woken[run_id] = due
            await self.engine.wake_run(run_id, None)
        for run_id in [r for r in self.woken if r not in seen]:
            del self.woken[run_id]
        self._rearm()

    def _rearm(self) -> None:
        for due, run_id in self._scan(BATCH + len(self.woken) + 1):
            if self.woken.get(run_id) != due:
                self._arm_at(due)
                return
        self.armed_for = None
        self.cancel_timer("due")

    def _arm_at(self, due_ms: int) -> None:
        clock = self.clock
        self.armed_for = due_ms
        self.arm_timer("due", clock.now() + max(0, due_ms - clock.time_ms()) / 1000.0, Due())
