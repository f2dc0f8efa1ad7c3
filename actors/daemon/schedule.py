"""The schedule actor: one per schedule (``/schedules/<id>``), holding its next fire's timer.

It rebuilds from its record (`schedule_store`) when it starts, arms its timer
for the cursor's deadline (a deadline already past fires at once), and on
each wake asks the pure `stepd.sansio.schedule.next_start` which fire to
start, starts it (`starting.start_run`, under the fire's idempotency key),
writes the cursor, and asks again, until nothing is due. It is the only
writer of its record after creation: pause, resume and delete are messages
to it.

Why nothing is lost or doubled across a kill, a crash or a SIGKILL of the
daemon: the cursor is written after each start, and a start whose cursor
write was lost is started again under the same key, which answers the run
the first start created (docs/schedules.md "Exactly once per fire").

Recovery starts every schedule's actor after a (re)start of the tree; the
schedules supervisor restarts a killed one, which then catches up whatever
fell due while it was down, within the schedule's catch-up window.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from stepd.actors import Actor
from stepd.sansio.errors import StepdError, Unavailable
from stepd.sansio.schedule import Cursor, ScheduleSpec, deadline, fire_key, next_start

from . import peers, starting
from .messages import Due
from .schedule_store import (
    Audit,
    DeleteSchedule,
    PauseSchedule,
    ResumeSchedule,
    delete_txn,
    load_txn,
    save_txn,
)
from .services import Services
from .tables import RUN_SUMMARIES

__all__ = ["BATCH", "ScheduleActor"]

log = logging.getLogger("stepd.schedules")

#: Fires started per turn; more due (a catch-up after downtime) continue at the next turn.
BATCH = 32

_TERMINAL = frozenset({"completed", "failed", "cancelled", "timed_out"})


class ScheduleActor(Actor):
    kind = "schedule"

    def __init__(self, services: Services, schedule_id: str) -> None:
        self.s = services
        self.schedule_id = schedule_id
        self.record: dict[str, Any] = {}
        self.spec: ScheduleSpec | None = None
        self.cursor = Cursor(0)

    async def on_start(self) -> None:
        record = self.s.storage.read(load_txn, self.schedule_id)
        if record is None:
            raise LookupError(f"schedule {self.schedule_id!r} not found")
        self.record = record
        self.spec = ScheduleSpec.from_dict(record["spec"])
        self.cursor = Cursor.from_dict(record["cursor"])
        self._arm()

    async def receive(self, message: Any) -> Any:
        if isinstance(message, Due):
            await self._fire()
            return None
        if isinstance(message, PauseSchedule):
            cur = dataclasses.replace(self.cursor, paused=True, buffered_ms=None)
            await self._save(cur, message.audit)
            return self.record
        if isinstance(message, ResumeSchedule):
            cur = self.cursor
            if cur.paused:
                assert self.spec is not None
                cur = dataclasses.replace(
                    cur, paused=False, next_fire_ms=self.spec.next_after(self.s.clock.time_ms()))
            await self._save(cur, message.audit)
            return self.record
        if isinstance(message, DeleteSchedule):
            await self.s.storage.write(delete_txn, self.schedule_id, message.audit)
            self.cancel_timer("due")
            self.stop()
            return None
        raise TypeError(f"schedule: unexpected message {message!r}")

    def _previous_running(self) -> bool:
        run_id = self.cursor.last_run_id
        if run_id is None:
            return False
        summary = self.s.storage.get(RUN_SUMMARIES, run_id)
        return isinstance(summary, dict) and summary.get("status") not in _TERMINAL

    async def _fire(self) -> None:
        """Start what is due, a fire at a time, each one's cursor on record before the next."""
        spec = self.spec
        assert spec is not None
        now = self.s.clock.time_ms()
        for _ in range(BATCH):
            cur, fire = next_start(spec, self.cursor, now, self._previous_running())
            if fire is None:
                if cur != self.cursor:
                    await self._save(cur)  # skips, a buffered fire, dropped fires
                self._arm()
                return
            error = None
            try:
                run_id, _created = await starting.start_run(
                    self.s, spec.workflow, spec.input, version=spec.version,
                    correlation={"schedule_id": self.schedule_id},
                    idempotency_key=fire_key(self.schedule_id, fire))
                cur = cur.started_fire(fire, run_id)
            except Unavailable:
                return  # shutting down: the fire stays due; the next start catches it up
            except StepdError as exc:
                # The start was refused (its workflow is no longer registered, its input
                # breaks a budget): the fire is counted as skipped and says why, and the
                # schedule keeps going, rather than crash-looping its actor on every fire.
                error = str(exc)
                cur = dataclasses.replace(cur, skipped=cur.skipped + 1)
                log.warning("schedule %s: fire %d not started: %s", self.schedule_id, fire, exc)
            if not await self._save(cur, error=error):
                return
        self._arm()
        peers.tell_ref(self.ref, Due())  # a catch-up longer than a batch: the next turn goes on

    async def _save(self, cur: Cursor, audit: Audit | None = None, *,
                    error: str | None = None) -> bool:
        record = dict(self.record, cursor=cur.to_dict(), updated_at=self.s.clock.time_ms())
        if error is not None:
            record["last_error"] = error
        if not await self.s.storage.write(save_txn, record, audit):
            self.stop()  # deleted under us (cannot happen while we are its only writer)
            return False
        self.record, self.cursor = record, cur
        self._arm()
        return True

    def _arm(self) -> None:
        peers.arm_due(self.s, self, deadline(self.cursor, self.s.clock.time_ms()))
