"""The daemon's tables and the transactions the run actors commit.

Every change to a run is one `RunWrite` applied by `apply_txn` in one write
transaction: the run record, its journal entries, the durable timer index,
the active-run index, lease records, the lease guard, child runs created by
the same transition, and messages to other runs' inboxes. Persist-then-ack
(DESIGN.md) is the run actor awaiting `storage.write(apply_txn, write)` before
it answers anyone.

Tables (storage/ opens them; `EXTRA_TABLES` are this layer's additions):

| table | key | value |
|---|---|---|
| runs | run id | `RunRecord.to_dict()` |
| journal | run id, seq (big-endian) | journal entry |
| leases | lease id | `LeaseRecord.to_dict()` |
| dispatch_keys | idempotency key | `{"run_id", "at"}` |
| timers | due ms (big-endian), run id, tag | `{}`: a run's next deadline, for passivated runs |
| idx_active | run id | `1`: runs with work in flight, activated at start |
| inbox | target run id, NUL, source | a message for a run that may be passivated |
| definitions | definition hash | `{"json", "order", "registered_at"}` |
| workers | worker id | registration |
| work_sessions, idx_ws_holder | see `work_store` | worker sessions and their holders' slots |
| run_crashes | run id | `{"at": [ms, ...], "error"}`: recent crashes of the run's actor |
| run_summaries, idx_runs_* | see `listing` | the listing's summaries and indexes |
| run_forks | source run id, NUL, fork run id | `{"step_id", "at"}`: the source's side of a fork's link |

Every table name is declared in `tables`.
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass, field
from typing import Any

from stepd.sansio.errors import AlreadyApplied, Conflict, Fenced, NotStarted, RunTerminal
from stepd.sansio.lease import LeaseRecord, Op, reject_reason
from stepd.sansio.record import slot_key
from stepd.sansio.status import TERMINAL_STATUSES, RunStatus
from stepd.storage import (
    ReadTxn,
    WriteTxn,
    decode,
    encode,
    journal_prefix,
    journal_txn,
    timer_key,
)

from . import listing
from .audit import AuditEntry, append_txn
from .tables import (  # re-exported: callers name them store.RUNS, ...
    DISPATCH_KEYS,
    EXTRA_TABLES,
    IDX_ACTIVE,
    INBOX,
    JOURNAL,
    LEASES,
    RUN_CRASHES,
    RUN_FORKS,
    RUN_SUMMARIES,
    RUNS,
    SCHEDULES,
    TIMERS,
    WORK_SESSIONS,
    WORKERS,
)

__all__ = [
    "DISPATCH_KEYS",
    "EXTRA_TABLES",
    "IDX_ACTIVE",
    "INBOX",
    "JOURNAL",
    "LEASES",
    "RUNS",
    "RUN_CRASHES",
    "RUN_FORKS",
    "RUN_SUMMARIES",
    "SCHEDULES",
    "TIMERS",
    "TIMER_TAG",
    "WORKERS",
    "WORK_SESSIONS",
    "LeaseGuard",
    "Refused",
    "RunWrite",
    "apply_txn",
    "audit_only_txn",
    "barrier_txn",
    "count_crash_txn",
    "deferred",
    "durable_reason",
    "fork_source_txn",
    "forks_txn",
    "inbox_key",
    "inbox_prefix",
    "inbox_txn",
    "lease_and_run_txn",
    "live_leases_txn",
    "load_run_txn",
    "merge",
    "mergeable",
    "run_is_terminal",
]


TIMER_TAG = b"run"

_CONFLICTS: dict[str, type[Conflict]] = {
    "already_applied": AlreadyApplied,
    "fenced": Fenced,
    "run_terminal": RunTerminal,
    "not_started": NotStarted,
}
_TERMINAL_VALUES = frozenset(s.value for s in TERMINAL_STATUSES)

_GUARD_MEMO: dict[str, tuple[bytes, dict[str, int]]] = {}
"""What the lease guard needs of a run record (its fences; it is not ended), by run id, with
the exact bytes it was read from: the record this process last wrote for the run.
The guard reads the record's stored bytes and uses the memo only when they are
the same bytes, so it still judges from the durable record alone (STYLE.md rule
16) but decodes a whole run record (input, state, step outputs) only when the
memo is stale (written by an earlier incarnation, a failed batch, another
process). ~13 us a step in an embedded seq(20). Bounded: see `_memo`."""
_GUARD_MEMO_BYTES = 8 << 20
_GUARD_MEMO_ENTRY_BYTES = 64 << 10
_guard_memo_size = 0


def inbox_key(target_run_id: str, source: str) -> bytes:
    return target_run_id.encode() + b"\x00" + source.encode()


def inbox_prefix(target_run_id: str) -> bytes:
    return target_run_id.encode() + b"\x00"


@dataclass(slots=True)
class LeaseGuard:
    """Check the durable lease before applying a worker call (STYLE.md rule 16)."""

    lease_id: str
    op: Op


@dataclass(slots=True)
class RunWrite:
    """Everything one run transition writes, applied atomically by `apply_txn`."""

    run_id: str
    record: dict[str, Any]
    journal: list[dict[str, Any]]
    # The record already encoded, for a write nobody awaits: `record` shares
    # dicts with the live machine (its `steps`, `fences`, `signals`), which the
    # next transition mutates before the writer thread gets to a deferred
    # write; encoding at submission keeps exactly the state of this transition.
    record_raw: bytes | None = None
    due_old: int | None = None
    due_new: int | None = None
    active_old: bool = False
    active_new: bool = False
    create: bool = False  # the run must not exist yet
    status_old: str | None = None  # the status before this write, when the writer knows it
    dispatch_key: str | None = None  # with create: the idempotency key to claim
    guard: LeaseGuard | None = None
    leases: list[dict[str, Any]] = field(default_factory=list)  # lease records to put
    lease_status: list[tuple[str, str, int]] = field(default_factory=list)  # (id, status, at)
    children: list[RunWrite] = field(default_factory=list)
    inbox: list[tuple[str, str, dict[str, Any]]] = field(default_factory=list)  # (target, source, msg)
    inbox_done: list[bytes] = field(default_factory=list)
    # The audit entry of the start, signal or cancel this write applies, and its
    # sequence number: written in the same transaction, its target the run (for a
    # start whose `dispatch_key` was taken: the existing run, status 200).
    audit: tuple[AuditEntry, int] | None = None
    # Set by `deferred`: the record's fences as `record_raw` holds them (a copy:
    # `record` shares them with the live machine). A later guarded write that
    # takes this one in (`merged`) judges its lease call on them, as it would on
    # this write's durable record; the guard's memo pairs them with those bytes.
    fences_then: dict[str, int] | None = None
    # The deferred write of the same run this one took in (`merge`): what is
    # written alone if this one's own part is refused or fails.
    merged: RunWrite | None = None


@dataclass(frozen=True, slots=True)
class Refused:
    """`apply_txn`'s answer when a merged write's own part raised `exc` (its guard
    refused the call, or it could not be written): that part was rolled back and
    the deferred write it had taken in was written alone, as it would have been
    on its own. `_commit` raises `exc`."""

    exc: Exception


def mergeable(w: RunWrite) -> bool:
    """Whether a deferred write (`deferred`) may be taken into the next write of its
    run: only an offer's or a `started`'s shape (its record, journal and lease
    records), nothing that creates, ends leases, tells other runs or audits."""
    return not (w.create or w.guard is not None or w.children or w.inbox or w.inbox_done
                or w.lease_status or w.audit is not None or w.merged is not None
                or w.fences_then is None)


def merge(old: RunWrite, new: RunWrite) -> RunWrite:
    """One write of `old` (a `mergeable` deferred write, taken back before any batch
    took it: `Storage.withdraw`) followed by `new`, the next write of the same run.

    What applying `old` and then `new` would leave: `new`'s record (it supersedes),
    both journals and lease records in order, the indexes moved from where `old`
    found them. `new`'s guard judges on `old`'s fences and lease records, as it
    would on `old`'s record committed first. If `new`'s part refuses or fails,
    `old` is written alone (`apply_txn`), as it would have been.
    """
    # `dataclasses.replace`, without its loop over the fields in Python (~30 calls):
    # `new` copied field by field in C, then the merged fields set. A copy, not
    # `new` itself: the caller still holds `new` (`RunOffers._commit` exports it).
    out = RunWrite(*_ALL_FIELDS(new))
    out.journal = [*old.journal, *new.journal]
    out.due_old = old.due_old
    out.active_old = old.active_old
    out.status_old = old.status_old
    out.leases = [*old.leases, *new.leases]
    out.merged = old
    return out


#: Every field of `RunWrite`, in the order its ``__init__`` takes them (`merge`).
_ALL_FIELDS = operator.attrgetter(*(f.name for f in dataclasses.fields(RunWrite)))


def apply_txn(txn: WriteTxn, w: RunWrite) -> str | Refused | None:
    """Apply one run transition. Returns the existing run id when `dispatch_key` was taken.

    Returns:
        The existing run's id when `dispatch_key` was taken; `Refused` when the
        own part of a `merge`d write refused or failed (its deferred part then
        written alone).

    Raises:
        Conflict: the guard's lease check refused the call (nothing is written).
        KeyError: `create` and the run id exists already.
    """
    old = w.merged
    if old is not None:
        try:  # the own part in a savepoint: if it raises, the deferred part still stands
            return txn.savepoint(_apply_txn, w)
        except Exception as exc:  # noqa: BLE001 - any failure: the caller raises it
            apply_txn(txn, old)
            return Refused(exc)
    return _apply_txn(txn, w)


def _apply_txn(txn: WriteTxn, w: RunWrite) -> str | None:
    """`apply_txn` of one write, a `merge`d one's whole content included."""
    if w.create:
        if w.dispatch_key is not None:
            taken = txn.get(DISPATCH_KEYS, w.dispatch_key)
            if isinstance(taken, dict):
                if w.audit is not None:
                    _audit_txn(txn, w.audit, str(taken["run_id"]), 200)
                return str(taken["run_id"])
            txn.put(DISPATCH_KEYS, w.dispatch_key, {"run_id": w.run_id, "at": w.record["created_at"]})
        if not txn.put(RUNS, w.run_id, w.record, overwrite=False):
            raise KeyError(f"run {w.run_id} exists already")
        origin = w.record.get("forked_from")
        if isinstance(origin, dict):  # a fork: the link from its source, in its own write
            txn.put(RUN_FORKS, inbox_key(origin["run_id"], w.run_id),
                    {"step_id": origin["step_id"], "at": w.record["created_at"]})
    else:
        if w.guard is not None:
            _check_guard_txn(txn, w)
        raw = w.record_raw
        if raw is None:
            raw = encode(w.record)
        txn.put_raw(RUNS, w.run_id, raw)
        _memo(w.run_id, raw, w.record, w.fences_then)
    listing.index_txn(txn, w.record, w.create, w.status_old,
                      w.record.get("correlation") if w.create else None)
    if w.journal:  # the run's key prefix once, not once an entry (~4 a step)
        prefix = journal_prefix(w.run_id)
        for entry in w.journal:  # `u64be(seq)` as one C call (the machine's seqs are >= 1)
            txn.put(JOURNAL, prefix + entry["seq"].to_bytes(8, "big"), entry)
    if w.due_old != w.due_new:
        if w.due_old is not None:
            txn.delete(TIMERS, timer_key(w.due_old, w.run_id, TIMER_TAG))
        if w.due_new is not None:
            txn.put(TIMERS, timer_key(w.due_new, w.run_id, TIMER_TAG), {})
    if w.active_old != w.active_new or w.create:
        if w.active_new:
            txn.put(IDX_ACTIVE, w.run_id, 1)
        else:
            txn.delete(IDX_ACTIVE, w.run_id)
    for lease in w.leases:
        txn.put(LEASES, lease["lease_id"], lease)
    for lease_id, status, at in w.lease_status:
        current = txn.get(LEASES, lease_id)
        if isinstance(current, dict) and current["status"] in ("offered", "started"):
            current["status"] = status
            current["ended_at"] = at
            txn.put(LEASES, lease_id, current)
    for target, source, msg in w.inbox:
        txn.put(INBOX, inbox_key(target, source), msg)
    for key in w.inbox_done:
        txn.delete(INBOX, key)
    for child in w.children:
        apply_txn(txn, child)
    if w.audit is not None:
        _audit_txn(txn, w.audit, w.run_id, 201 if w.create else 200)
    return None


def _audit_txn(txn: WriteTxn, audit: tuple[AuditEntry, int], run_id: str, status: int) -> None:
    entry, seq = audit
    append_txn(txn, dataclasses.replace(entry, target=run_id, status=status), seq)


def deferred(w: RunWrite) -> RunWrite:
    """`w`, its record encoded now: for `Storage.write_deferred` (see `RunWrite.record_raw`).

    Raises:
        OverflowError, TypeError: the record holds what the codec cannot store
            (on the caller's side: a bug in the transition, not a daemon stop).
    """
    record = w.record
    w.record_raw = encode(record)
    fences = record.get("fences")
    w.fences_then = dict(fences) if fences else {}  # a copy: the machine's own dict
    return w


def _memo(run_id: str, raw: bytes, record: dict[str, Any],
          fences_then: dict[str, int] | None = None) -> None:
    """Remember what the guard needs of the run record just put as `raw` (see
    `_GUARD_MEMO`): nothing for an ended run (a lease call on it is refused from
    its record, memo or not) or a record over 64 KiB, and all of it forgotten
    once 8 MiB of records were added since the last time (100,000 sleeping runs
    must not be kept here: it only serves runs that take steps).

    `fences_then`: the fences as `raw` holds them, for a write encoded when it
    was queued (`deferred`). Its `record` shares `fences` with the live machine,
    which may have moved on (a retry's new fence) by the time the writer puts it:
    a copy taken now would pair those bytes with fences they do not hold."""
    global _guard_memo_size
    memo = _GUARD_MEMO
    if record["status"] in _TERMINAL_VALUES or len(raw) > _GUARD_MEMO_ENTRY_BYTES:
        memo.pop(run_id, None)
        return
    if _guard_memo_size > _GUARD_MEMO_BYTES:
        memo.clear()
        _guard_memo_size = 0
    if fences_then is None:
        fences = record.get("fences")
        # A copy: the record shares `fences` with the live machine (`RunWrite.record_raw`).
        fences_then = dict(fences) if fences else {}
    memo[run_id] = (raw, fences_then)
    _guard_memo_size += len(raw)


def _check_guard_txn(txn: WriteTxn, w: RunWrite) -> None:
    """STYLE.md rule 16's guard: refuse `w`'s lease call unless the durable records
    allow it. For a write that took a deferred one in (`merge`), "durable" is what
    that one's commit would have left: its lease records (the last of the lease
    wins, as its puts would) and its fences as `deferred` kept them."""
    guard = w.guard
    assert guard is not None
    old = w.merged
    lease_raw: Any = None
    if old is not None:
        for lease in old.leases:
            if lease["lease_id"] == guard.lease_id:
                lease_raw = lease
    if lease_raw is None:
        lease_raw = txn.get(LEASES, guard.lease_id)
    if not isinstance(lease_raw, dict):
        raise Fenced(f"lease {guard.lease_id} is not on record")
    if old is not None:  # its record's status: top level of `to_dict`'s own dict
        reason = _reason(lease_raw, old.record["status"] in _TERMINAL_VALUES,
                         old.fences_then or {}, guard.op)
    else:
        run_bytes = txn.get_raw(RUNS, w.run_id)
        if run_bytes is None:
            raise Fenced(f"lease {guard.lease_id} is not on record")
        known = _GUARD_MEMO.get(w.run_id)
        if known is not None and known[0] == run_bytes:  # the durable bytes, compared whole
            reason = _reason(lease_raw, False, known[1], guard.op)  # ended runs are never kept
        else:
            run_raw = decode(run_bytes)
            if not isinstance(run_raw, dict):
                raise Fenced(f"lease {guard.lease_id} is not on record")
            reason = durable_reason(lease_raw, run_raw, guard.op)
    if reason is not None:
        raise _CONFLICTS[reason](f"lease {guard.lease_id}: {reason}")


def durable_reason(lease_raw: dict[str, Any], run_raw: dict[str, Any], op: Op) -> str | None:
    """The 409 reason for `op` on a lease, judged from the durable records alone."""
    return _reason(lease_raw, run_raw["status"] in _TERMINAL_VALUES,
                   run_raw.get("fences") or {}, op)


def _reason(lease_raw: dict[str, Any], run_terminal: bool, fences: dict[str, int],
            op: Op) -> str | None:
    lease = LeaseRecord.from_dict(lease_raw)
    return reject_reason(lease, op, run_terminal=run_terminal,
                         current_fence=fences.get(slot_key(lease.step_id, lease.item_index)))


def count_crash_txn(txn: WriteTxn, run_id: str, at_ms: int, error: str, period_ms: int,
                    keep: int) -> int:
    """Record one crash of a run's actor; return how many fell within the last `period_ms`.

    Durable, so a crash loop is bounded across daemon restarts too (STYLE.md
    rule 10, DBOS's recovery attempts); its own small table, so counting does
    not depend on the run record being writable.
    """
    raw = txn.get(RUN_CRASHES, run_id)
    times = [t for t in (raw.get("at") or []) if isinstance(t, int)] if isinstance(raw, dict) else []
    times = [t for t in times if t >= at_ms - period_ms][-(keep - 1):] + [at_ms]
    txn.put(RUN_CRASHES, run_id, {"at": times, "error": error[:2000]})
    return len(times)


def barrier_txn(txn: WriteTxn) -> None:
    """Write nothing: awaiting it means every write submitted before is on record."""


# --------------------------------------------------------------------------- reads


def load_run_txn(txn: ReadTxn, run_id: str) -> dict[str, Any] | None:
    raw = txn.get(RUNS, run_id)
    return raw if isinstance(raw, dict) else None


def lease_and_run_txn(txn: ReadTxn, lease_id: str) -> tuple[dict[str, Any], dict[str, Any]] | None:
    lease = txn.get(LEASES, lease_id)
    if not isinstance(lease, dict):
        return None
    run = txn.get(RUNS, lease["run_id"])
    if not isinstance(run, dict):
        return None
    return lease, run


def live_leases_txn(txn: ReadTxn, lease_ids: list[str]) -> list[dict[str, Any]]:
    out = []
    for lease_id in lease_ids:
        raw = txn.get(LEASES, lease_id)
        if isinstance(raw, dict) and raw["status"] in ("offered", "started"):
            out.append(raw)
    return out


def inbox_txn(txn: ReadTxn, run_id: str) -> list[tuple[bytes, dict[str, Any]]]:
    return [(k, v) for k, v in txn.scan(INBOX, prefix=inbox_prefix(run_id)) if isinstance(v, dict)]




def fork_source_txn(txn: ReadTxn, run_id: str) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
    """A run's record and whole journal, read together (what a fork copies), or None."""
    raw = txn.get(RUNS, run_id)
    if not isinstance(raw, dict):
        return None
    return raw, [dict(v) for _, v in journal_txn(txn, run_id)]  # type: ignore[call-overload]


#: The most forks a run's status lists (the oldest first); its export lists them all.
MAX_FORKS_SHOWN = 100


def forks_txn(txn: ReadTxn, run_id: str, limit: int | None = MAX_FORKS_SHOWN) -> list[dict[str, Any]]:
    """The runs forked from `run_id`, oldest first (run ids sort by creation time):
    ``[{"run_id", "step_id"}]``."""
    prefix = inbox_prefix(run_id)
    return [{"run_id": key[len(prefix):].decode(), "step_id": value.get("step_id")}
            for key, value in txn.scan(RUN_FORKS, prefix=prefix, limit=limit)
            if isinstance(value, dict)]


def run_is_terminal(raw: dict[str, Any]) -> bool:
    return RunStatus(raw["status"]).terminal


def audit_only_txn(txn: WriteTxn, audit: tuple[AuditEntry, int], run_id: str, status: int) -> None:
    """Write an operation's audit entry alone (a start whose idempotency key was taken)."""
    _audit_txn(txn, audit, run_id, status)
