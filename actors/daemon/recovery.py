"""The recovery actor: makes the live actors match what storage holds.

It starts last under the root supervisor (`rest_for_one`), so it runs after
the daemon starts and again whenever an actor before it restarts (the
registry, the runs or leases supervisor): every run with work in flight
(`idx_active`) is activated and resynchronised (it re-announces its queued
slots and restarts the actors of its live leases, with a full TTL), and every
run with messages in its inbox is woken to read them, and every schedule's
actor is started (it arms its own timer). Timers of passivated
runs are the timer actor's job.

The work is done in small batches of messages to itself, not in `on_start`:
the root supervisor waits for `on_start`, and a recovery of thousands of runs
(or one that keeps meeting a restarting runs supervisor) must not hold the
supervisor, and with it every other restart, hostage.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from stepd.actors import Actor, ActorDead, ActorNotFound
from stepd.sansio.errors import NotFound, Unavailable

from . import peers, store
from .messages import Due, InboxChanged, Resubscribe, Resync, ResyncAll
from .services import Services

log = logging.getLogger("stepd.recovery")

#: Runs woken per message, so a stop request is served between batches.
BATCH = 32


@dataclass(frozen=True, slots=True)
class Continue:
    """Wake the next batch."""


class RecoveryActor(Actor):
    kind = "recovery"

    def __init__(self, services: Services) -> None:
        self.s = services
        self.todo: list[tuple[str, Any]] = []
        self.pending: dict[str, Any] = {}  # runs that did not come up yet, and what to tell them
        self.backoff = 0.01
        self.recovered = 0

    async def on_start(self) -> None:
        e = self.s
        self.todo = [(k.decode(), Resync()) for k, _ in e.storage.scan(store.IDX_ACTIVE)]
        last = None
        for key, _ in e.storage.scan(store.INBOX):
            target = key.split(b"\x00", 1)[0].decode()
            if target != last:
                self.todo.append((target, InboxChanged()))
                last = target
        # Every registered worker has its session (its expiry runs there), and
        # every session subscribes again: a restarted registry forgot them all.
        try:
            for key, _ in e.storage.scan(store.WORKERS):
                await peers.ensure_session(e, key.decode())
            for _, ref in e.system.supervisor("/sessions").which_children():
                peers.tell_ref(ref, Resubscribe())
            # Every open worker session has its actor (its timers run there).
            for key, raw in e.storage.scan(store.WORK_SESSIONS):
                if isinstance(raw, dict) and raw.get("status") in ("pending", "held"):
                    try:
                        await peers.ensure_work_session(e, key.decode())
                    except NotFound:
                        pass  # its run or definition is gone: nothing to hold
        except (ActorDead, ActorNotFound):
            # /sessions died under us (a kill): the root restarts it and, rest_for_one,
            # every sibling after it, this actor included. Failing the start here would
            # count as a crash of ours against the root's intensity.
            log.info("recovery: /sessions is restarting; sessions are resubscribed after it")
        await self._start_schedules()
        self.ref.tell_nowait(Continue())

    async def _start_schedules(self) -> None:
        """Every schedule gets its actor, which arms its timer (or catches up) itself."""
        for key, _ in self.s.storage.scan(store.SCHEDULES):
            try:
                await peers.ensure_schedule(self.s, key.decode())
            except (ActorDead, ActorNotFound):
                log.info("recovery: /schedules is restarting; its schedules start after it")
                return
            except NotFound:
                continue  # deleted meanwhile

    async def receive(self, message: Any) -> Any:
        if isinstance(message, ResyncAll):
            sweeping = bool(self.todo)
            queued = {run_id for run_id, _ in self.todo}
            self.todo += [(run_id, Resync()) for k, _ in self.s.storage.scan(store.IDX_ACTIVE)
                          if (run_id := k.decode()) not in queued]
            if not sweeping and self.todo:
                self.ref.tell_nowait(Continue())
            return None
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
            await peers.wake_run(self.s, run_id, message, retries=5)
            self.recovered += 1
        except ActorDead:
            return False
        except Unavailable:
            if not peers.supervisors_alive(self.s):
                return False
            # It keeps dying as it starts (someone is killing it): try again
            # later. A run with work in flight must end up with an actor.
            self.pending[run_id] = message
            self.arm_timer("retry", self.s.clock.now() + self.backoff, Due())
        except Exception:
            log.exception("recovery could not activate run %s; it stays on record", run_id)
        return True
