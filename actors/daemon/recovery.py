"""The recovery actor: makes the live actors match what storage holds.

It starts last under the root supervisor (`rest_for_one`), so it runs after
the daemon starts and again whenever an actor before it restarts (the
registry, the runs or leases supervisor): every run with work in flight
(`idx_active`) is activated and resynchronised (it re-announces its queued
slots and restarts the actors of its live leases, with a full TTL), and every
run with messages in its inbox is woken to read them. Timers of passivated
runs are the timer actor's job.

The work is done in small batches of messages to itself, not in `on_start`:
the root supervisor waits for `on_start`, and a recovery of thousands of runs
(or one that keeps meeting a restarting runs supervisor) must not hold the
supervisor, and with it every other restart, hostage.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from stepd.actors import Actor, ActorDead
from stepd.sansio.errors import Unavailable

from . import store
from .messages import Due, InboxChanged, Resync

if TYPE_CHECKING:
    from .engine import Engine

log = logging.getLogger("stepd.recovery")

#: Runs woken per message, so a stop request is served between batches.
BATCH = 32


@dataclass(frozen=True, slots=True)
class Continue:
    """Wake the next batch."""


class RecoveryActor(Actor):
    kind = "recovery"

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.todo: list[tuple[str, Any]] = []
        self.pending: dict[str, Any] = {}  # runs that did not come up yet, and what to tell them
        self.backoff = 0.01
        self.recovered = 0

    async def on_start(self) -> None:
        e = self.engine
        self.todo = [(k.decode(), Resync()) for k, _ in e.storage.scan(store.IDX_ACTIVE)]
        last = None
        for key, _ in e.storage.scan(store.INBOX):
            target = key.split(b"\x00", 1)[0].decode()
            if target != last:
                self.todo.append((target, InboxChanged()))
                last = target
        e.resubscribe_sessions()
        self.ref.tell_nowait(Continue())

    async def receive(self, message: Any) -> Any:
        if isinstance(message, Continue):
            batch, self.todo = self.todo[:BATCH], self.todo[BATCH:]
            for run_id, msg in batch:
                if not await self._wake(run_id, msg):
                    return None  # a supervisor before us is down; we are restarted after it
            if self.todo:
                self.ref.tell_nowait(Continue())
        elif isinstance(message, Due) and self.pending:
            self.backoff = min(self.backoff * 2, 5.0)
            retry, self.pending = self.pending, {}
            for run_id, msg in retry.items():
                if not await self._wake(run_id, msg):
                    return None
            if not self.pending:
                self.backoff = 0.01
        return None

    async def _wake(self, run_id: str, message: Any) -> bool:
        try:
            await self.engine.wake_run(run_id, message, retries=5)
            self.recovered += 1
        except ActorDead:
            return False
        except Unavailable:
            if not self.engine.supervisors_alive():
                return False
            # It keeps dying as it starts (someone is killing it): try again
            # later. A run with work in flight must end up with an actor.
            self.pending[run_id] = message
            self.arm_timer("retry", self.clock.now() + self.backoff, Due())
        except Exception:  # noqa: BLE001 - one bad run must not keep every other run down
            log.exception("recovery could not activate run %s; it stays on record", run_id)
        return True
