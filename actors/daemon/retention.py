"""Retention: finished runs are deleted after a while, in bounded slices off the hot path.

What a run's deletion removes, in one transaction per slice of runs: its
record, summary and listing index entries, its journal, the leases its
journal names, its inbox, its crash count, its worker sessions' records
(closed when the run ended: they hold no worker's slot), and its idempotency key once the
key is past its own retention (``key_before_ms``; a key younger than that
stays, still answering the pruned run's id, so a retried start inside the
key's retention never starts a second run). A key left behind is deleted by
`prune_keys_txn` once it is old enough.

Which runs: terminal (completed, failed, cancelled, timed out), ended
(``updated_at``) before ``before_ms``, and not the child of a run still in
progress (the parent may still read it). They are found through
``idx_runs_created``, oldest first: a run created after ``before_ms`` cannot
have ended before it, so the scan stops there.

A slice examines at most `SCAN_BUDGET` index entries and deletes at most
`SLICE` runs, so one transaction holds the single writer for a bounded time;
between slices the caller yields (the retention actor sends itself the next
slice as a message; `Daemon.prune_runs` awaits each slice's commit). The
audit log is kept: it has its own life.

LMDB reuses freed pages but never shrinks its file: the data directory's
size (``stepd_data_dir_bytes``) stops growing rather than falling.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Final

from stepd.actors import Actor
from stepd.storage import WriteTxn, journal_prefix, parse_u64be

from . import listing
from .messages import Due
from .services import Services
from .tables import (
    DISPATCH_KEYS,
    IDX_ACTIVE,
    IDX_RUNS_CREATED,
    INBOX,
    JOURNAL,
    LEASES,
    RUN_CRASHES,
    RUN_SUMMARIES,
    RUNS,
    WORK_SESSIONS,
)

__all__ = [
    "SCAN_BUDGET",
    "SLICE",
    "RetentionActor",
    "Slice",
    "counted_out",
    "data_dir_bytes",
    "prune_keys_txn",
    "prune_txn",
]

#: Runs deleted per transaction at most.
SLICE: Final = 64
#: Index entries (or idempotency keys) examined per transaction at most.
SCAN_BUDGET: Final = 1024
#: How often the retention actor sweeps when a sweep found nothing more to do (seconds).
SWEEP_EVERY_S: Final = 60.0

_TERMINAL: Final = frozenset({"completed", "failed", "cancelled", "timed_out"})


@dataclass(slots=True)
class Slice:
    """What one slice deleted, and where the next one goes on (None: done)."""

    deleted: int = 0
    by_status: dict[str, int] = field(default_factory=dict)
    cursor: bytes | None = None


def _parent_in_progress(txn: WriteTxn, summary: dict[str, Any]) -> bool:
    parent = summary.get("parent_run_id")
    if not parent:
        return False
    raw = txn.get(RUN_SUMMARIES, parent)
    return isinstance(raw, dict) and raw.get("status") not in _TERMINAL


def prune_txn(txn: WriteTxn, before_ms: int, key_before_ms: int, after: bytes | None,
              limit: int = SLICE, budget: int = SCAN_BUDGET) -> Slice:
    """Delete up to `limit` finished runs that ended before `before_ms`, from `after` on."""
    out = Slice()
    start = None if after is None else after + b"\x00"
    # Materialised first: deleting under a live cursor of the same table is not safe.
    keys = [k for k, _ in txn.scan_raw(IDX_RUNS_CREATED, start=start, limit=budget)]
    for key in keys:
        if parse_u64be(key[:8]) >= before_ms:
            out.cursor = None  # created after the cutoff: could not have ended before it
            return out
        out.cursor = key
        run_id = key[8:].decode()
        summary = txn.get(RUN_SUMMARIES, run_id)
        if not isinstance(summary, dict):
            continue
        status = summary.get("status")
        if status not in _TERMINAL or summary["updated_at"] >= before_ms:
            continue
        if _parent_in_progress(txn, summary):
            continue
        delete_run_txn(txn, run_id, status, key_before_ms)
        out.deleted += 1
        out.by_status[status] = out.by_status.get(status, 0) + 1
        if out.deleted >= limit:
            return out
    if len(keys) < budget:
        out.cursor = None  # the index is exhausted
    return out


def delete_run_txn(txn: WriteTxn, run_id: str, status: str, key_before_ms: int) -> None:
    """Delete one run and everything that is only its (see the module docstring)."""
    record = txn.get(RUNS, run_id)
    if not isinstance(record, dict):
        return
    prefix = journal_prefix(run_id)
    entries = list(txn.scan(JOURNAL, prefix=prefix))
    for key, entry in entries:
        lease_id = entry.get("lease_id") if isinstance(entry, dict) else None
        if isinstance(lease_id, str):
            txn.delete(LEASES, lease_id)
        txn.delete(JOURNAL, key)
    for inbox_key in [k for k, _ in txn.scan_raw(INBOX, prefix=run_id.encode() + b"\x00")]:
        txn.delete(INBOX, inbox_key)
    listing.unindex_txn(txn, record, status)
    txn.delete(RUNS, run_id)
    txn.delete(IDX_ACTIVE, run_id)
    txn.delete(RUN_CRASHES, run_id)
    for ws_key in [k for k, _ in txn.scan_raw(WORK_SESSIONS, prefix=f"ws_{run_id}.".encode())]:
        txn.delete(WORK_SESSIONS, ws_key)
    idem = record.get("idempotency_key")
    if isinstance(idem, str):
        taken = txn.get(DISPATCH_KEYS, idem)
        if (isinstance(taken, dict) and taken.get("run_id") == run_id
                and int(taken.get("at") or 0) < key_before_ms):
            txn.delete(DISPATCH_KEYS, idem)


def prune_keys_txn(txn: WriteTxn, key_before_ms: int, after: bytes | None,
                   budget: int = SCAN_BUDGET) -> tuple[int, bytes | None]:
    """Delete idempotency keys older than `key_before_ms` whose run is gone.

    Returns:
        (keys deleted, where the next slice goes on or None when done).
    """
    start = None if after is None else after + b"\x00"
    rows = list(txn.scan(DISPATCH_KEYS, start=start, limit=budget))
    deleted = 0
    for key, taken in rows:
        if (isinstance(taken, dict) and int(taken.get("at") or 0) < key_before_ms
                and not txn.exists(RUNS, str(taken.get("run_id")))):
            txn.delete(DISPATCH_KEYS, key)
            deleted += 1
    return deleted, (rows[-1][0] if len(rows) == budget else None)


def data_dir_bytes(path: str) -> int:
    """The bytes the data directory's files take (LMDB's data and lock files)."""
    total = 0
    with os.scandir(path) as entries:
        for entry in entries:
            if entry.is_file(follow_symlinks=False):
                total += entry.stat(follow_symlinks=False).st_size
    return total


def counted_out(s: Services, done: Slice) -> None:
    """The deleted runs leave the daemon's counts (``/metrics``, ``/v1/api/stats``)."""
    s.stats.runs_pruned += done.deleted
    for status, n in done.by_status.items():
        s.stats.status_counts[status] = s.stats.status_counts.get(status, n) - n


class RetentionActor(Actor):
    """Sweeps finished runs past ``DaemonConfig.retention_ms``, a slice per message.

    With no retention configured it sleeps forever. A sweep starts at once
    after a (re)start, then every `SWEEP_EVERY_S`; each slice is one
    transaction, and the next slice is a message to itself, so the daemon's
    event loop (and this actor's mailbox) turns between slices.
    """

    kind = "retention"

    def __init__(self, services: Services) -> None:
        self.s = services
        self.cursor: bytes | None = None
        self.keys_cursor: bytes | None = None
        self.phase = "runs"

    async def on_start(self) -> None:
        if self.s.config.retention_ms > 0:
            self.arm_timer("due", self.s.clock.now(), Due())

    async def receive(self, message: Any) -> Any:
        if not isinstance(message, Due):
            raise TypeError(f"retention: unexpected message {message!r}")
        config = self.s.config
        now = self.s.clock.time_ms()
        before = now - config.retention_ms
        key_before = now - (config.idempotency_retention_ms or config.retention_ms)
        if self.phase == "runs":
            done: Slice = await self.s.storage.write(prune_txn, before, key_before, self.cursor)
            counted_out(self.s, done)
            self.cursor = done.cursor
            if done.cursor is None:
                self.phase = "keys"
        else:
            _n, self.keys_cursor = await self.s.storage.write(
                prune_keys_txn, key_before, self.keys_cursor)
            if self.keys_cursor is None:
                self.phase = "runs"
                self.arm_timer("due", self.s.clock.now() + SWEEP_EVERY_S, Due())
                return None
        self.ref.tell_nowait(Due())  # the next slice, after whatever else is queued
        return None
