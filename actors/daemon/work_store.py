"""Worker sessions' transactions and the holder choice (AFFINITY.md "Worker sessions").

Tables (`tables`): ``work_sessions`` (session id -> `WorkSessionRecord.to_dict()`)
and ``idx_ws_holder`` (worker id, NUL, session id -> 1): one entry per slot of
a worker's ``max_sessions`` in use. A slot is taken by `acquire_txn`, which
counts the worker's entries and takes one only below its limit, in the same
transaction as the session's record: the storage writer runs transactions one
at a time, so two sessions can never both take a worker's last slot.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from stepd.sansio.capabilities import WorkerCapabilities
from stepd.sansio.session_spec import resources_match
from stepd.storage import ReadTxn, WriteTxn

from .tables import IDX_WS_HOLDER, WORK_SESSIONS, WORKERS

__all__ = ["Candidate", "acquire_txn", "candidates_txn", "held_txn", "save_txn",
           "session_capable"]

#: A worker whose manifest supports sessions but names no ``max_sessions`` holds one.
DEFAULT_MAX_SESSIONS = 1


@dataclass(frozen=True, slots=True)
class Candidate:
    worker_id: str
    max_sessions: int
    used: int


def _slot_key(worker_id: str, session_id: str) -> bytes:
    return worker_id.encode() + b"\x00" + session_id.encode()


def session_capable(info: Any) -> dict[str, Any] | None:
    """The worker's ``sessions`` manifest entry if it may hold sessions, else None.

    Routing asks what the capability gate (`stepd.sansio.capabilities`) would:
    negotiated 1.18 or later, the flat capability declared, its manifest entry
    ``supported``.
    """
    if not isinstance(info, dict) or not WorkerCapabilities.from_record(info).supports("sessions"):
        return None
    entry = info["manifest"]["sessions"]
    return entry if isinstance(entry, dict) else None


def candidates_txn(txn: ReadTxn, requirements: dict[str, Any], queue: str | None,
                   workflow: tuple[str, str | None], excluded: list[str]) -> list[Candidate]:
    """Workers that may hold a session: they registered the workflow, their manifest
    supports sessions with matching resources (and queue, when they list queues),
    and a slot of their ``max_sessions`` is free. Fewest slots in use first."""
    out = []
    for key, info in txn.scan(WORKERS):
        worker_id = key.decode()
        entry = session_capable(info)
        if entry is None or worker_id in excluded:
            continue
        assert isinstance(info, dict)
        if not any((k[0], k[1]) == workflow for k in info.get("keys") or ()):
            continue
        if not resources_match(requirements, entry.get("resources") or {}):
            continue
        queues = entry.get("queues")
        if queue is not None and isinstance(queues, list) and queue not in queues:
            continue
        limit = entry.get("max_sessions", DEFAULT_MAX_SESSIONS)
        used = sum(1 for _ in txn.scan_raw(IDX_WS_HOLDER, prefix=worker_id.encode() + b"\x00"))
        if used < limit:
            out.append(Candidate(worker_id, limit, used))
    out.sort(key=lambda c: c.used)
    return out


def acquire_txn(txn: WriteTxn, record: dict[str, Any], worker_id: str, max_sessions: int) -> bool:
    """Take a slot of `worker_id` and store the session's record, or do nothing (False)."""
    used = sum(1 for _ in txn.scan_raw(IDX_WS_HOLDER, prefix=worker_id.encode() + b"\x00"))
    if used >= max_sessions:
        return False
    txn.put(IDX_WS_HOLDER, _slot_key(worker_id, record["session_id"]), 1)
    txn.put(WORK_SESSIONS, record["session_id"], record)
    return True


def save_txn(txn: WriteTxn, record: dict[str, Any], freed: list[str]) -> None:
    """Store the session's record; the slots of workers that no longer hold it are freed."""
    for worker_id in freed:
        txn.delete(IDX_WS_HOLDER, _slot_key(worker_id, record["session_id"]))
    txn.put(WORK_SESSIONS, record["session_id"], record)


def held_txn(txn: ReadTxn, worker_id: str) -> list[dict[str, Any]]:
    """The records of the sessions whose slots `worker_id` holds (the workers API), by id."""
    out = []
    prefix = worker_id.encode() + b"\x00"
    for key, _ in txn.scan_raw(IDX_WS_HOLDER, prefix=prefix):
        record = txn.get(WORK_SESSIONS, key[len(prefix):].decode())
        if isinstance(record, dict):
            out.append(record)
    return out
