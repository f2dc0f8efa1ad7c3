"""Schedules as pure logic: the spec a client sends, and which fire to start next.

A schedule starts a run of a workflow at each time its cron expression names
in its time zone (docs/schedules.md). This module holds no clock, no storage
and no actor: `ScheduleSpec.parse` validates what a client sent (a refusal
names the field), and `next_start` decides, from the schedule's durable
`Cursor`, the time `now_ms` passed in, and whether the run of the previous
fire is still running, which fire (if any) must start now. The actor shell
(`stepd.actors.daemon.schedule`) performs the start, records the new cursor
and sleeps until `deadline`.

Why a cursor and not a "last fired" flag: the cursor is the next fire not yet
handled. Every fire before it was started, skipped, buffered or dropped, and
is never considered again; every fire from it on is. A start carries the
idempotency key `fire_key(schedule_id, fire_ms)`, so a start whose cursor
update was lost (a SIGKILL between the two) is started again under the same
key and answers the run it started the first time: no double fire, no drop.

Cron expressions are parsed and iterated by cronsim (5 fields, or 6 with
seconds first), in the schedule's IANA time zone (zoneinfo), so daylight
saving transitions follow cronsim's rules (a fire in a skipped hour runs at
the end of the gap; a repeated hour fires once).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cronsim import CronSim, CronSimError

from stepd.sansio.durations import parse_duration
from stepd.sansio.enums import IdentityEnum
from stepd.sansio.errors import Invalid

__all__ = [
    "BUFFER_POLL_MS",
    "MAX_CATCHUP_MS",
    "Cursor",
    "Overlap",
    "ScheduleSpec",
    "deadline",
    "fire_key",
    "next_start",
]

#: The longest catch-up window: a week of missed fires at most is started after downtime.
MAX_CATCHUP_MS: Final = 7 * 86_400_000
#: While a buffered fire waits for the previous run to end, look again this often.
BUFFER_POLL_MS: Final = 1_000
_OVERLAPS: Final = frozenset(("skip", "buffer_one", "allow"))
_FIELDS: Final = frozenset({"cron", "timezone", "workflow", "version", "input", "overlap",
                            "catchup_window_ms"})


class Overlap(IdentityEnum):
    """What a fire does while the previous fire's run is still running."""

    SKIP = "skip"  # the fire is skipped (counted)
    BUFFER_ONE = "buffer_one"  # the first such fire waits and starts when that run ends
    ALLOW = "allow"  # the fire starts anyway


def fire_key(schedule_id: str, fire_ms: int) -> str:
    """The idempotency key of one fire: the same fire always starts the same run."""
    return f"schedule:{schedule_id}:{fire_ms}"


@dataclass(frozen=True, slots=True)
class ScheduleSpec:
    """What a schedule does, as validated (`parse`) and stored (`to_dict`)."""

    cron: str
    timezone: str
    workflow: str
    version: str | None
    input: Any
    overlap: Overlap
    catchup_window_ms: int

    @classmethod
    def parse(cls, body: Any) -> ScheduleSpec:
        """Validate a create request's body.

        Raises:
            Invalid: naming the field: a bad cron, an unknown time zone, a bad
                overlap policy or catch-up window, an unknown field.
        """
        if not isinstance(body, dict):
            raise Invalid("must be a JSON object", field="body")
        for name in body:
            if name not in _FIELDS:
                raise Invalid(f"unknown field {name!r}", field=str(name))
        cron = body.get("cron")
        if not isinstance(cron, str) or not cron.strip() or len(cron) > 200:
            raise Invalid("must be a cron expression of 5 fields (or 6, seconds first)",
                          field="cron")
        zone = body.get("timezone", "UTC")
        if not isinstance(zone, str) or not zone or len(zone) > 64:
            raise Invalid("must be an IANA time zone name such as Europe/Paris", field="timezone")
        try:
            ZoneInfo(zone)
        except (ZoneInfoNotFoundError, ValueError, OSError) as exc:
            raise Invalid(f"unknown time zone {zone!r}", field="timezone") from exc
        workflow = body.get("workflow")
        if not isinstance(workflow, str) or not workflow or len(workflow) > 200:
            raise Invalid("must be a non-empty string", field="workflow")
        version = body.get("version")
        if version is not None and (not isinstance(version, str) or not version):
            raise Invalid("must be a non-empty string", field="version")
        overlap = body.get("overlap", "skip")
        if not isinstance(overlap, str) or overlap not in _OVERLAPS:
            raise Invalid("must be one of skip, buffer_one, allow", field="overlap")
        window = body.get("catchup_window_ms", 0)
        catchup = parse_duration(window, field="catchup_window_ms", allow_zero=True)
        if catchup > MAX_CATCHUP_MS:
            raise Invalid(f"must be at most {MAX_CATCHUP_MS} (7 days)", field="catchup_window_ms")
        spec = cls(cron.strip(), zone, workflow, version, body.get("input"), Overlap(overlap),
                   catchup)
        spec.next_after(0)  # a valid expression that never fires is refused too
        return spec

    def next_after(self, t_ms: int) -> int:
        """The first fire strictly after `t_ms` (epoch ms).

        Raises:
            Invalid: (field ``cron``) the expression is malformed or never fires.
        """
        start = datetime.fromtimestamp(t_ms / 1000, ZoneInfo(self.timezone))
        try:
            fire = next(iter(CronSim(self.cron, start)))
        except (CronSimError, StopIteration) as exc:
            raise Invalid(f"not a cron expression that fires: {exc}", field="cron") from exc
        return int(fire.timestamp() * 1000)

    def to_dict(self) -> dict[str, Any]:
        return {"cron": self.cron, "timezone": self.timezone, "workflow": self.workflow,
                "version": self.version, "input": self.input, "overlap": self.overlap.value,
                "catchup_window_ms": self.catchup_window_ms}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ScheduleSpec:
        return cls(d["cron"], d["timezone"], d["workflow"], d.get("version"), d.get("input"),
                   Overlap(d["overlap"]), int(d["catchup_window_ms"]))


@dataclass(frozen=True, slots=True)
class Cursor:
    """A schedule's durable progress.

    Attributes:
        next_fire_ms: the next fire not yet handled.
        paused: a paused schedule decides nothing.
        buffered_ms: a fire held back by ``buffer_one`` until the previous run ends.
        last_fire_ms, last_run_id: the last fire started and its run (overlap is about it).
        started, skipped, dropped: fires started; skipped by the overlap policy;
            dropped because they were older than the catch-up window.
    """

    next_fire_ms: int
    paused: bool = False
    buffered_ms: int | None = None
    last_fire_ms: int | None = None
    last_run_id: str | None = None
    started: int = 0
    skipped: int = 0
    dropped: int = 0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Cursor:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def started_fire(self, fire_ms: int, run_id: str) -> Cursor:
        """The cursor once `fire_ms`'s run `run_id` is on record."""
        return dataclasses.replace(self, last_fire_ms=fire_ms, last_run_id=run_id,
                                   started=self.started + 1)


def next_start(spec: ScheduleSpec, cur: Cursor, now_ms: int,
               previous_running: bool) -> tuple[Cursor, int | None]:
    """Which fire must start now, and the cursor past every decision taken on the way.

    Fires older than the catch-up window are dropped (the cursor jumps to the
    first fire inside it); a due fire while the previous run is running is
    skipped, buffered or started by the overlap policy. Call again after each
    start (with ``previous_running`` for the run just started) until it
    returns None.

    Returns:
        (the new cursor, the fire time to start or None).
    """
    if cur.paused:
        return cur, None
    if cur.buffered_ms is not None and not previous_running:
        return dataclasses.replace(cur, buffered_ms=None), cur.buffered_ms
    window_start = now_ms - spec.catchup_window_ms
    while cur.next_fire_ms <= now_ms:
        fire = cur.next_fire_ms
        if fire < window_start:
            # Everything before the window is dropped at once (a year of
            # minutely fires is one jump, not half a million steps); the count
            # says one per jump when they were many.
            first_inside = spec.next_after(window_start - 1)
            cur = dataclasses.replace(cur, next_fire_ms=first_inside, dropped=cur.dropped + 1)
            continue
        cur = dataclasses.replace(cur, next_fire_ms=spec.next_after(fire))
        if not previous_running or spec.overlap is Overlap.ALLOW:
            return cur, fire
        if spec.overlap is Overlap.BUFFER_ONE and cur.buffered_ms is None:
            cur = dataclasses.replace(cur, buffered_ms=fire)
        else:
            cur = dataclasses.replace(cur, skipped=cur.skipped + 1)
    return cur, None


def deadline(cur: Cursor, now_ms: int) -> int | None:
    """When the schedule must look again: its next fire, or sooner while a fire is buffered."""
    if cur.paused:
        return None
    if cur.buffered_ms is not None:
        return min(cur.next_fire_ms, now_ms + BUFFER_POLL_MS)
    return cur.next_fire_ms
