"""The schedule machine, pure: no event loop, no storage, time passed in."""

from __future__ import annotations

import dataclasses
from datetime import datetime
from zoneinfo import ZoneInfo

import pytest

from stepd.sansio.errors import Invalid
from stepd.sansio.schedule import (
    BUFFER_POLL_MS,
    Cursor,
    Overlap,
    ScheduleSpec,
    deadline,
    fire_key,
    next_start,
)

MIN = 60_000
T0 = 1_700_000_040_000  # a whole minute


def spec(overlap: str = "skip", catchup: int = 0, cron: str = "* * * * *",
         tz: str = "UTC") -> ScheduleSpec:
    return ScheduleSpec.parse({"cron": cron, "workflow": "w", "timezone": tz,
                               "overlap": overlap, "catchup_window_ms": catchup})


def drain(s: ScheduleSpec, cur: Cursor, now: int, running: bool) -> tuple[Cursor, list[int]]:
    """Ask until nothing more starts; each run started is still running if `running`
    (nothing runs before the first)."""
    started = []
    prev = False
    for _ in range(1000):
        cur, fire = next_start(s, cur, now, prev)
        if fire is None:
            return cur, started
        started.append(fire)
        cur = cur.started_fire(fire, f"r{fire}")
        prev = running
    raise AssertionError("no end")


def test_nothing_is_due_before_the_next_fire() -> None:
    cur = Cursor(next_fire_ms=T0 + MIN)
    assert next_start(spec(), cur, T0 + MIN - 1, False) == (cur, None)
    assert deadline(cur, T0) == T0 + MIN


def test_a_due_fire_starts_and_the_cursor_moves_past_it() -> None:
    cur, started = drain(spec(), Cursor(next_fire_ms=T0), T0, False)
    assert started == [T0] and cur.next_fire_ms == T0 + MIN
    assert cur.last_fire_ms == T0 and cur.started == 1


@pytest.mark.parametrize(("overlap", "started", "skipped", "buffered"), [
    ("allow", [T0, T0 + MIN, T0 + 2 * MIN], 0, None),
    ("skip", [T0], 2, None),
    ("buffer_one", [T0], 1, T0 + MIN),
])
def test_overlap_policies_while_the_previous_run_runs(
        overlap: str, started: list[int], skipped: int, buffered: int | None) -> None:
    # Three fires due at once (2 minutes late, window 1 h): each run started keeps running.
    s = spec(overlap, catchup=3_600_000)
    cur, got = drain(s, Cursor(next_fire_ms=T0), T0 + 2 * MIN, True)
    assert got == started and cur.skipped == skipped and cur.buffered_ms == buffered
    assert cur.next_fire_ms == T0 + 3 * MIN


def test_a_buffered_fire_starts_once_the_previous_run_ends() -> None:
    s = spec("buffer_one")
    cur = Cursor(next_fire_ms=T0 + 3 * MIN, buffered_ms=T0 + MIN, last_run_id="r")
    assert next_start(s, cur, T0 + 2 * MIN, True) == (cur, None)
    assert deadline(cur, T0 + 2 * MIN) == T0 + 2 * MIN + BUFFER_POLL_MS
    after, fire = next_start(s, cur, T0 + 2 * MIN, False)
    assert fire == T0 + MIN and after.buffered_ms is None


def test_fires_older_than_the_window_are_dropped_in_one_jump() -> None:
    s = spec("allow", catchup=5 * MIN)
    # A year down, every minute: one jump to the window, then the five minutes in it.
    now = T0 + 365 * 24 * 60 * MIN
    cur, started = drain(s, Cursor(next_fire_ms=T0), now, False)
    assert started == [now - 5 * MIN + i * MIN for i in range(6)]
    assert cur.dropped == 1 and cur.next_fire_ms == now + MIN


def test_no_window_drops_everything_missed_but_a_fire_due_now() -> None:
    cur, started = drain(spec("allow"), Cursor(next_fire_ms=T0), T0 + 10 * MIN, False)
    assert started == [T0 + 10 * MIN] and cur.dropped == 1


def test_paused_decides_nothing_and_sleeps() -> None:
    cur = Cursor(next_fire_ms=T0, paused=True, buffered_ms=None)
    assert next_start(spec(), cur, T0 + 10 * MIN, False) == (cur, None)
    assert deadline(cur, T0) is None


def test_time_zones_and_daylight_saving() -> None:
    riga = ZoneInfo("Europe/Riga")
    s = spec(cron="30 3 * * *", tz="Europe/Riga")
    # 2026-03-29 03:30 does not exist in Riga (03:00 -> 04:00): cronsim fires at the gap's end.
    before = int(datetime(2026, 3, 28, 12, tzinfo=riga).timestamp() * 1000)
    first = s.next_after(before)
    assert datetime.fromtimestamp(first / 1000, riga).replace(tzinfo=None) == datetime(
        2026, 3, 29, 4, 0)
    second = s.next_after(first)
    assert datetime.fromtimestamp(second / 1000, riga).hour == 3


def test_seconds_field_first() -> None:
    s = spec(cron="*/10 * * * * *")
    assert s.next_after(T0) == T0 + 10_000


@pytest.mark.parametrize(("body", "field"), [
    ({"cron": "* * *", "workflow": "w"}, "cron"),
    ({"cron": "0 0 30 2 *", "workflow": "w"}, "cron"),
    ({"cron": 5, "workflow": "w"}, "cron"),
    ({"cron": "* * * * *", "workflow": "w", "timezone": "Nowhere/Land"}, "timezone"),
    ({"cron": "* * * * *", "workflow": "w", "timezone": "/etc/passwd"}, "timezone"),
    ({"cron": "* * * * *", "workflow": ""}, "workflow"),
    ({"cron": "* * * * *", "workflow": "w", "overlap": "all"}, "overlap"),
    ({"cron": "* * * * *", "workflow": "w", "catchup_window_ms": "8d"}, "catchup_window_ms"),
    ({"cron": "* * * * *", "workflow": "w", "catchup_window_ms": 1.5}, "catchup_window_ms"),
    ({"cron": "* * * * *", "workflow": "w", "extra": 1}, "extra"),
    ([], "body"),
])
def test_parse_refuses_naming_the_field(body: object, field: str) -> None:
    with pytest.raises(Invalid) as info:
        ScheduleSpec.parse(body)
    assert info.value.field == field


def test_spec_and_cursor_round_trip() -> None:
    s = spec("buffer_one", catchup=MIN)
    assert ScheduleSpec.from_dict(s.to_dict()) == s and s.overlap is Overlap.BUFFER_ONE
    cur = dataclasses.replace(Cursor(T0), buffered_ms=T0, skipped=2)
    assert Cursor.from_dict(cur.to_dict()) == cur
    assert fire_key("s_X", T0) == f"schedule:s_X:{T0}"
