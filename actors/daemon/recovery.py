"""The recovery actor: makes the live actors match what storage holds.

It starts last under the root supervisor (`rest_for_one`), so it runs after
the daemon starts and again whenever an actor before it restarts (the
registry, the runs or leases supervisor): every run with work in flight
(`idx_active`) is activated and resynchronised (it re-announces its queued
slots and restarts the actors of its live leases, with a full TTL), and every
run with messages in its inbox is woken to read them. Timers of passivated
runs are the timer actor's job.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from stepd.actors import Actor, ActorDead

from . import store
from .messages import InboxChanged, Resync

if TYPE_CHECKING:
    from .engine import Engine

log = logging.getLogger("stepd.recovery")


class RecoveryActor(Actor):
    kind = "recovery"

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.recovered = 0

    async def on_start(self) -> None:
        e = self.engine
        active = [k.decode() for k, _ in e.storage.scan(store.IDX_ACTIVE)]
        for run_id in active:
            await self._wake(run_id, Resync())
        targets: list[str] = []
        for key, _ in e.storage.scan(store.INBOX):
            target = key.split(b"\x00", 1)[0].decode()
            if not targets or targets[-1] != target:
                targets.append(target)
        for run_id in targets:
            await self._wake(run_id, InboxChanged())
        self.recovered = len(active) + len(targets)
        e.resubscribe_sessions()

    async def _wake(self, run_id: str, message: Any) -> None:
        try:
            await self.engine.wake_run(run_id, message)
        except ActorDead:
            raise  # a supervisor before us is down: rest_for_one restarts us after it
        except Exception:  # noqa: BLE001 - one bad run must not keep every other run down
            log.exception("recovery could not activate run %s; it stays on record", run_id)

    async def receive(self, message: Any) -> Any:
        return None
