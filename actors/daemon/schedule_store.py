"""Schedules on record: the ``schedules`` table, its transactions, and the messages a
schedule actor takes (docs/schedules.md).

One record per schedule, keyed by its id::

    {"schedule_id", "spec": ScheduleSpec.to_dict(), "cursor": Cursor.to_dict(),
     "created_at", "updated_at", "last_error": str | None}

The API writes a record once, at create (with the create's audit entry, in
one transaction). Every write after that is its schedule actor's: a fire's
cursor, pause, resume, delete. One writer per record, so no write can race
another and none needs a version check.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from stepd.sansio.run import iso_ms
from stepd.sansio.schedule import Cursor, ScheduleSpec
from stepd.storage import ReadTxn, WriteTxn

from .audit import AuditEntry, append_txn
from .tables import SCHEDULES

__all__ = [
    "Audit",
    "DeleteSchedule",
    "PauseSchedule",
    "ResumeSchedule",
    "create_txn",
    "delete_txn",
    "load_txn",
    "new_record",
    "save_txn",
    "view",
]

Audit = tuple[AuditEntry, int]


@dataclass(frozen=True, slots=True)
class PauseSchedule:
    """Stop firing (the cursor stays; nothing is caught up on resume)."""

    audit: Audit | None = None


@dataclass(frozen=True, slots=True)
class ResumeSchedule:
    """Fire again from the next fire after now."""

    audit: Audit | None = None


@dataclass(frozen=True, slots=True)
class DeleteSchedule:
    """Delete the record; the actor stops once it is gone."""

    audit: Audit | None = None


def new_record(schedule_id: str, spec: ScheduleSpec, now_ms: int) -> dict[str, Any]:
    """A fresh record: its first fire is the first after its creation."""
    cursor = Cursor(next_fire_ms=spec.next_after(now_ms))
    return {"schedule_id": schedule_id, "spec": spec.to_dict(), "cursor": cursor.to_dict(),
            "created_at": now_ms, "updated_at": now_ms, "last_error": None}


def _audit_txn(txn: WriteTxn, audit: Audit | None, schedule_id: str, status: int) -> None:
    if audit is not None:
        entry, seq = audit
        append_txn(txn, dataclasses.replace(entry, target=schedule_id, status=status), seq)


def create_txn(txn: WriteTxn, record: dict[str, Any], audit: Audit | None) -> None:
    """Write a new schedule and its create's audit entry (201).

    Raises:
        KeyError: the id exists already.
    """
    if not txn.put(SCHEDULES, record["schedule_id"], record, overwrite=False):
        raise KeyError(f"schedule {record['schedule_id']} exists already")
    _audit_txn(txn, audit, record["schedule_id"], 201)


def save_txn(txn: WriteTxn, record: dict[str, Any], audit: Audit | None = None) -> bool:
    """Overwrite a schedule that still exists; False (nothing written) if it was deleted."""
    if not txn.exists(SCHEDULES, record["schedule_id"]):
        return False
    txn.put(SCHEDULES, record["schedule_id"], record)
    _audit_txn(txn, audit, record["schedule_id"], 200)
    return True


def delete_txn(txn: WriteTxn, schedule_id: str, audit: Audit | None) -> bool:
    deleted = txn.delete(SCHEDULES, schedule_id)
    if deleted:
        _audit_txn(txn, audit, schedule_id, 200)
    return deleted


def load_txn(txn: ReadTxn, schedule_id: str) -> dict[str, Any] | None:
    raw = txn.get(SCHEDULES, schedule_id)
    return raw if isinstance(raw, dict) else None


def view(record: dict[str, Any]) -> dict[str, Any]:
    """A schedule as the API shows it (times as RFC 3339)."""
    spec, cur = record["spec"], record["cursor"]
    paused = bool(cur.get("paused"))
    buffered = cur.get("buffered_ms")
    last = cur.get("last_fire_ms")
    return {
        "schedule_id": record["schedule_id"], **spec,
        "paused": paused,
        "next_fire_at": None if paused else iso_ms(cur["next_fire_ms"]),
        "buffered_fire_at": None if buffered is None else iso_ms(buffered),
        "last_fire_at": None if last is None else iso_ms(last),
        "last_run_id": cur.get("last_run_id"),
        "fires": {"started": cur.get("started", 0), "skipped": cur.get("skipped", 0),
                  "dropped": cur.get("dropped", 0)},
        "last_error": record.get("last_error"),
        "created_at": iso_ms(record["created_at"]),
        "updated_at": iso_ms(record["updated_at"]),
    }
