"""The start and result paths' shortcuts (branch `run-fixed`, issue 16) answer exactly what
the general code answers: the start body's parser, the query string, audit entries,
the status view's times and a record's statuses."""

from __future__ import annotations

import datetime
from typing import Any
from urllib.parse import parse_qsl

import pytest

from stepd.actors.daemon.audit import AuditAction, AuditEntry, AuditLog
from stepd.sansio import _run_base
from stepd.sansio._run_base import iso_ms
from stepd.sansio.errors import Invalid
from stepd.sansio.record import RunRecord, Slot
from stepd.sansio.status import RunStatus, SlotPhase
from stepd.transport._validate_api import _parse_start_run, parse_start_run
from stepd.transport.http import _query

START_BODIES: list[Any] = [
    {"workflow": "w", "input": 1},
    {"workflow": "w", "input": None, "idempotency_key": "k" * 64},
    {"workflow": "w", "input": None, "idempotency_key": "k" * 65},
    {"workflow": "w" * 32, "input": [1], "version": "v1", "correlation": {"a": 1}},
    {"workflow": "w" * 33, "input": 1},
    {"workflow": "é" * 40, "input": 1},
    {"workflow": "\U0001f600" * 33, "input": 1},
    {"workflow": "w", "input": 1, "version": "\U0001f600" * 40},
    {"workflow": "w", "input": 1, "idempotency_key": "\U0001f600" * 65},
    {"workflow": "", "input": 1},
    {"workflow": 3, "input": 1},
    {"workflow": "w"},
    {"input": 1},
    {"workflow": "w", "input": 1, "extra": 2},
    {"workflow": "w", "input": 1, "deadline_ms": 5},
    {"workflow": "w", "input": 1, "deadline_ms": 0},
    {"workflow": "w", "input": 1, "deadline_ms": 2.5},
    {"workflow": "w", "input": 1, "version": ""},
    {"workflow": "w", "input": 1, "version": 2},
    {"workflow": "w", "input": 1, "idempotency_key": ""},
    {"workflow": "w", "input": 1, "idempotency_key": 7},
    {"workflow": "w", "input": 1, "idempotency_key": None, "version": None, "deadline_ms": None},
    [],
    None,
    "w",
]


def _outcome(parse: Any, body: Any) -> Any:
    try:
        return parse(body)
    except Invalid as exc:
        return ("refused", str(exc), exc.field)


@pytest.mark.parametrize("body", START_BODIES)
def test_the_start_parser_answers_as_the_field_by_field_checks(body: Any) -> None:
    assert _outcome(parse_start_run, body) == _outcome(_parse_start_run, body)


@pytest.mark.parametrize("query", [
    "timeout=30", "a=1&b=2", "a&b=", "=x", "a=1&&b=2&a=3", "a==b", "&", "x=1;y=2",
    "a=%41", "a=b+c", "n%61me=1", "a=%zz", "a=%e9", "wait_ms=25000&cursor=abc",
])
def test_the_query_reads_as_parse_qsl_reads_it(query: str) -> None:
    expected = dict(parse_qsl(query, keep_blank_values=True, errors="replace"))
    assert _query({"query_string": query.encode("latin-1")}) == expected


class _NoStorage:
    def read(self, fn: Any, *args: Any) -> Any:
        return -1  # no entry stored yet

    async def write(self, fn: Any, *args: Any) -> Any:
        raise AssertionError("not written here")


@pytest.mark.parametrize(("scope", "action", "status", "reason"), [
    (None, AuditAction.RUNS_START, 201, None),
    ("execute", AuditAction.RUNS_RESULT, 200, None),
    ("read", AuditAction.RUNS_READ, 404, "not_found"),
    ("admin", "actors.kill", 200, None),  # a string action: the validated path
])
def test_an_audit_entry_is_the_validated_entry(scope: str | None, action: Any, status: int,
                                               reason: str | None) -> None:
    log = AuditLog(_NoStorage(), clock=lambda: 1_700_000_000.123)
    made = log.new_entry(key_id="abc", scope=scope, action=action, target="r_1",
                         status=status, reason=reason)
    text = action.value if isinstance(action, AuditAction) else action
    assert made == AuditEntry(1_700_000_000_123, "abc", scope, text, "r_1", status, reason)
    assert type(made.action) is str and made.to_dict()["action"] == text


@pytest.mark.parametrize(("scope", "action", "status"), [
    ("nobody", AuditAction.RUNS_START, 201),
    (None, "runs.nothing", 201),
    (None, AuditAction.RUNS_START, 99),
    (None, AuditAction.RUNS_START, True),
])
def test_an_audit_entry_out_of_range_is_still_refused(scope: str | None, action: Any,
                                                       status: Any) -> None:
    log = AuditLog(_NoStorage(), clock=lambda: 1_700_000_000.0)
    with pytest.raises(Invalid):
        log.new_entry(key_id=None, scope=scope, action=action, target=None, status=status)


def test_iso_ms_formats_as_datetime_and_stays_bounded() -> None:
    for ms in (0, 1, 999, 1_700_000_000_123, 1_700_000_000_123, 4_102_444_800_000):
        expected = (datetime.datetime.fromtimestamp(ms / 1000, tz=datetime.UTC)
                    .isoformat(timespec="milliseconds").replace("+00:00", "Z"))
        assert iso_ms(ms) == expected
    for ms in range(_run_base._ISO_MAX + 10):
        iso_ms(ms)
    assert len(_run_base._ISO) <= _run_base._ISO_MAX


def test_a_record_reads_its_statuses_back_and_refuses_an_unknown_one() -> None:
    slot = Slot(item_index=None, input=None, cost_units=1, phase=SlotPhase.STARTED)
    assert Slot.from_dict(slot.to_dict()).phase is SlotPhase.STARTED
    for status in RunStatus:
        raw = RunRecord(run_id="r_1", workflow="w", version="1", definition_hash="h", input=None,
                        created_at=1, status=status).to_dict()
        assert RunRecord.from_dict(raw).status is status
    raw["status"] = "sleepy"
    with pytest.raises(ValueError):
        RunRecord.from_dict(raw)
    bad = dict(slot.to_dict(), p="nowhere")
    with pytest.raises(ValueError):
        Slot.from_dict(bad)
