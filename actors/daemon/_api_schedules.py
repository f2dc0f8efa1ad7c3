"""The daemon API, schedule side: create, list, get, pause, resume, delete (see `api`,
docs/schedules.md).

A create validates (`ScheduleSpec.parse`; the workflow must be registered),
writes the record with its audit entry in one transaction, and starts the
schedule's actor. Everything after that goes through the actor, the record's
only writer.
"""

from __future__ import annotations

from typing import Any

import anyio

from stepd.actors import ActorDead
from stepd.sansio.errors import Invalid, NotFound, Unavailable
from stepd.sansio.schedule import ScheduleSpec

from . import audit as _audit
from . import ids, peers
from ._api_base import ApiBase
from .schedule_store import (
    DeleteSchedule,
    PauseSchedule,
    ResumeSchedule,
    create_txn,
    load_txn,
    new_record,
    view,
)
from .tables import SCHEDULES

__all__ = ["ScheduleOps"]


class ScheduleOps(ApiBase):
    """`Daemon`'s schedule operations."""

    async def create_schedule(self, body: Any, *,
                              audit: _audit.AuditEntry | None = None) -> dict[str, Any]:
        """Create a schedule; its first fire is the first after now.

        Raises:
            Invalid: naming the field (cron, timezone, workflow, overlap,
                catchup_window_ms; ``workflow`` also when it is not registered).
            Unavailable: the daemon is shutting down.
        """
        spec = ScheduleSpec.parse(body)
        if self.catalog.resolve(spec.workflow, spec.version) is None:
            what = f"workflow {spec.workflow!r}" + (
                f" version {spec.version!r}" if spec.version else "")
            raise Invalid(f"{what} is not registered", field="workflow")
        if not self.services.serving:
            raise Unavailable("the daemon is shutting down")
        now = self.clock.time_ms()
        record = new_record(ids.schedule_id(now), spec, now)
        entry = None if audit is None else (audit, self.audit.next_seq())
        await self.storage.write(create_txn, record, entry)
        try:
            await peers.ensure_schedule(self.services, record["schedule_id"])
        except ActorDead:
            pass  # /schedules is restarting: recovery starts its actor after it
        return view(record)

    def list_schedules(self, *, limit: int = 100,
                       after: str | None = None) -> tuple[list[dict[str, Any]], str | None]:
        """A page of schedules, oldest first, and the next page's cursor (the last id)."""
        start = None if after is None else after.encode("utf-8", "surrogatepass") + b"\x00"
        rows = self.storage.scan(SCHEDULES, start=start, limit=limit + 1)
        page = [view(raw) for _, raw in rows[:limit] if isinstance(raw, dict)]
        more = len(rows) > limit
        return page, (page[-1]["schedule_id"] if more and page else None)

    def schedule(self, schedule_id: str) -> dict[str, Any]:
        """Raises: NotFound."""
        record = self.storage.read(load_txn, schedule_id)
        if record is None:
            raise NotFound(f"schedule {schedule_id!r} not found")
        return view(record)

    async def pause_schedule(self, schedule_id: str, *,
                             audit: _audit.AuditEntry | None = None) -> dict[str, Any]:
        """Stop firing until resumed. Raises: NotFound."""
        return view(await self._ask(schedule_id, PauseSchedule(self._entry(audit))))

    async def resume_schedule(self, schedule_id: str, *,
                              audit: _audit.AuditEntry | None = None) -> dict[str, Any]:
        """Fire again, from the first fire after now (a pause is not caught up). Raises: NotFound."""
        return view(await self._ask(schedule_id, ResumeSchedule(self._entry(audit))))

    async def delete_schedule(self, schedule_id: str, *,
                              audit: _audit.AuditEntry | None = None) -> None:
        """Delete it; runs it started are untouched. Raises: NotFound."""
        self.schedule(schedule_id)
        await self._ask(schedule_id, DeleteSchedule(self._entry(audit)))

    def _entry(self, audit: _audit.AuditEntry | None) -> tuple[_audit.AuditEntry, int] | None:
        return None if audit is None else (audit, self.audit.next_seq())

    async def _ask(self, schedule_id: str, message: Any) -> Any:
        """Ask the schedule's actor, starting it if needed, across its restarts.

        Raises:
            NotFound: no such schedule.
            Unavailable: its actor did not come up.
        """
        if self.storage.read(load_txn, schedule_id) is None:
            raise NotFound(f"schedule {schedule_id!r} not found")
        for attempt in range(peers.RETRIES):
            try:
                ref = await peers.ensure_schedule(self.services, schedule_id)
                return await ref.ask(message)
            except ActorDead:
                await anyio.sleep(0.001 * attempt)
        raise Unavailable(f"schedule {schedule_id} did not come up")
