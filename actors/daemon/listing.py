"""Run listing by secondary indexes: every page costs O(limit), never O(runs).

Why: listing once scanned and decoded whole run records (input, state,
result) on the event loop, up to 512 of them even for ``limit=1``; twenty
concurrent ``?status=failed`` calls against a few runs with MB-sized inputs
kept ``/healthz`` unanswered for 10 s. Now a small summary record per run is
the only thing a listing decodes, and the indexes below lead straight to the
runs a filter asks for, newest first.

Tables (their names live in `store`; all written in the run's own
transaction by `index_txn`, so a listing never sees a run its indexes miss):

| table | key | value |
|---|---|---|
| run_summaries | run id | `summary()`: the listing's fields, nothing big |
| idx_runs_created | created ms (8, BE), run id | `None` |
| idx_runs_status | status (1), created, run id | `None` |
| idx_runs_workflow | workflow hash (8), created, run id | `None` |
| idx_runs_wf_status | workflow hash, status, created, run id | `None` |
| idx_runs_correlation | correlation hash (8), created, run id | `None` |

Fixed-width prefixes (a status code, 8 bytes of BLAKE2b for a workflow name
or a correlation's canonical JSON) keep every key under LMDB's 511 bytes with
the longest run id (400). A hash can collide: a page re-checks every filter on
the summary it decodes, so a collision costs a skipped entry, never a wrong
answer. The idempotency key filter needs no index of its own: the
``dispatch_keys`` table already maps it to its run.

A page examines at most `SCAN_BUDGET` index entries beyond what it returns
(only filters that no index covers whole can skip entries: the correlation
with a workflow or a status); past it, the page ends early with a cursor, so a
page may hold fewer runs than `limit` while more follow. The cursor is opaque:
base64url of the index, the order and the last key examined.
"""

from __future__ import annotations

import base64
import hashlib
from dataclasses import dataclass
from typing import Any, Final

from stepd.sansio.canonical import canonical_json
from stepd.sansio.errors import Invalid
from stepd.storage import ReadTxn, WriteTxn, decode, encode, prefix_end, u64be

from . import tables as store

__all__ = [
    "SCAN_BUDGET",
    "Query",
    "count_by_status_txn",
    "index_txn",
    "list_txn",
    "rebuild_txn",
    "summary",
    "unindex_txn",
]

#: Index entries a page may examine without returning them (see the module docstring).
SCAN_BUDGET: Final = 1000

STATUS_CODES: Final = {
    "running": 1, "waiting": 2, "sleeping": 3, "completed": 4, "failed": 5,
    "cancelled": 6, "timed_out": 7,
}

_SUMMARY_KEYS: Final = ("run_id", "workflow", "status", "version", "hash", "idempotency_key",
                        "created_at", "updated_at")


def _h8(text: str | bytes) -> bytes:
    data = text.encode() if isinstance(text, str) else text
    return hashlib.blake2b(data, digest_size=8).digest()


_WF_HASHES: dict[str, bytes] = {}
_WF_HASHES_MAX: Final = 4096


def _wf_hash(workflow: str) -> bytes:
    """`_h8` of a workflow name, kept: every run's start and end index it (two writes
    on the writer thread, four C calls each), under a few names. Bounded (cleared when
    full)."""
    found = _WF_HASHES.get(workflow)
    if found is None:
        if len(_WF_HASHES) >= _WF_HASHES_MAX:
            _WF_HASHES.clear()
        found = _WF_HASHES[workflow] = _h8(workflow)
    return found


def correlation_hash(correlation: Any) -> bytes | None:
    """The index prefix of a correlation value (None: the run has none)."""
    if correlation is None:
        return None
    try:
        return _h8(canonical_json(correlation))
    except Invalid:
        return None  # not canonical JSON (cannot happen through the API): not indexed


def summary(record: dict[str, Any]) -> dict[str, Any]:
    """What a listing shows of a run: small and fixed, never the input or the state."""
    out = {k: record[k] for k in _SUMMARY_KEYS}
    parent = record.get("parent")
    out["parent_run_id"] = parent.get("run_id") if isinstance(parent, dict) else None
    return out


def _suffix(created_at: int, run_id: str) -> bytes:
    return u64be(created_at) + run_id.encode()


def _status_key(status: str, suffix: bytes) -> bytes:
    return bytes((STATUS_CODES.get(status, 0),)) + suffix


def index_txn(txn: WriteTxn, record: dict[str, Any], created: bool, status_old: str | None,
              correlation: Any) -> None:
    """Keep the summary and the indexes of one run current, in the run's own write.

    Args:
        record: the run record as written (`RunRecord.to_dict`).
        created: the write creates the run.
        status_old: the status before this write (None: unknown, read it here).
        correlation: the run's correlation (only used when `created`).
    """
    run_id = record["run_id"]
    status = record["status"]
    if not created and status_old is None:
        old = txn.get(store.RUN_SUMMARIES, run_id)
        status_old = old.get("status") if isinstance(old, dict) else status
    txn.put(store.RUN_SUMMARIES, run_id, summary(record))
    if not created and status_old == status:
        return
    suffix = _suffix(record["created_at"], run_id)
    wf = _wf_hash(record["workflow"])
    if created:
        txn.put(store.IDX_RUNS_CREATED, suffix, None)
        txn.put(store.IDX_RUNS_WORKFLOW, wf + suffix, None)
        corr = correlation_hash(correlation)
        if corr is not None:
            txn.put(store.IDX_RUNS_CORRELATION, corr + suffix, None)
    else:
        assert status_old is not None
        old_key = _status_key(status_old, suffix)
        txn.delete(store.IDX_RUNS_STATUS, old_key)
        txn.delete(store.IDX_RUNS_WF_STATUS, wf + old_key)
    new_key = _status_key(status, suffix)
    txn.put(store.IDX_RUNS_STATUS, new_key, None)
    txn.put(store.IDX_RUNS_WF_STATUS, wf + new_key, None)


def unindex_txn(txn: WriteTxn, record: dict[str, Any], status: str) -> None:
    """Remove one run's summary and every index entry (retention deletes the run)."""
    run_id = record["run_id"]
    suffix = _suffix(record["created_at"], run_id)
    wf = _h8(record["workflow"])
    txn.delete(store.RUN_SUMMARIES, run_id)
    txn.delete(store.IDX_RUNS_CREATED, suffix)
    txn.delete(store.IDX_RUNS_WORKFLOW, wf + suffix)
    txn.delete(store.IDX_RUNS_STATUS, _status_key(status, suffix))
    txn.delete(store.IDX_RUNS_WF_STATUS, wf + _status_key(status, suffix))
    corr = correlation_hash(record.get("correlation"))
    if corr is not None:
        txn.delete(store.IDX_RUNS_CORRELATION, corr + suffix)


def rebuild_txn(txn: WriteTxn, after: bytes | None, batch: int) -> bytes | None:
    """Index up to `batch` runs after key `after` (a data directory from before the
    indexes existed); returns the last run key done, or None when all are."""
    start = None if after is None else after + b"\x00"
    last = None
    for key, raw in txn.scan(store.RUNS, start=start, limit=batch):
        last = key
        if isinstance(raw, dict) and txn.get(store.RUN_SUMMARIES, raw["run_id"]) is None:
            index_txn(txn, raw, True, None, raw.get("correlation"))
    return last


def count_by_status_txn(txn: ReadTxn) -> dict[str, int]:
    """Runs by status, from the status index's keys alone (nothing decoded)."""
    counts: dict[str, int] = {}
    for status, code in STATUS_CODES.items():
        n = 0
        for _ in txn.scan_raw(store.IDX_RUNS_STATUS, prefix=bytes((code,))):
            n += 1
        if n:
            counts[status] = n
    return counts


# --------------------------------------------------------------------------- queries


@dataclass(frozen=True, slots=True)
class Query:
    """One page's filters (validated by the protocol layer)."""

    workflow: str | None = None
    status: str | None = None
    created_after: int | None = None  # inclusive, epoch ms
    created_before: int | None = None  # exclusive, epoch ms
    correlation: Any = None  # a JSON value other than null; None: no filter
    idempotency_key: str | None = None
    order: str = "desc"
    limit: int = 100
    cursor: str | None = None

    def index(self) -> tuple[str, bytes]:
        """The index that covers most of the filters, and the key prefix to scan."""
        if self.correlation is not None:
            corr = correlation_hash(self.correlation)
            return store.IDX_RUNS_CORRELATION, corr if corr is not None else b"\xff" * 9
        if self.workflow is not None and self.status is not None:
            return (store.IDX_RUNS_WF_STATUS,
                    _h8(self.workflow) + bytes((STATUS_CODES[self.status],)))
        if self.workflow is not None:
            return store.IDX_RUNS_WORKFLOW, _h8(self.workflow)
        if self.status is not None:
            return store.IDX_RUNS_STATUS, bytes((STATUS_CODES[self.status],))
        return store.IDX_RUNS_CREATED, b""

    def matches(self, s: dict[str, Any]) -> bool:
        """Every filter, checked on the summary (a hash collision fails here)."""
        if self.workflow is not None and s["workflow"] != self.workflow:
            return False
        if self.status is not None and s["status"] != self.status:
            return False
        created = s["created_at"]
        if self.created_after is not None and created < self.created_after:
            return False
        return not (self.created_before is not None and created >= self.created_before)


def _cursor(index: str, order: str, key: bytes) -> str:
    raw = encode([index, order, key])
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _uncursor(cursor: str, index: str, order: str) -> bytes:
    try:
        got = decode(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
    except Exception:  # noqa: BLE001 - any malformed cursor is the same 400
        got = None
    if not (isinstance(got, list) and len(got) == 3 and isinstance(got[2], bytes)
            and got[0] == index and got[1] == order):
        raise Invalid("must be the next_cursor of an earlier page of the same query",
                      field="cursor")
    return bytes(got[2])


def list_txn(txn: ReadTxn, q: Query) -> tuple[list[dict[str, Any]], str | None]:
    """One page of run summaries and the cursor of the next (None: no more).

    Raises:
        Invalid: the cursor is not one of this query's.
    """
    if q.idempotency_key is not None:
        return _by_idempotency_key(txn, q), None
    index, prefix = q.index()
    lower = prefix + (u64be(q.created_after) if q.created_after is not None else b"")
    upper = (prefix + u64be(q.created_before) if q.created_before is not None
             else prefix_end(prefix) if prefix else None)
    desc = q.order == "desc"
    if q.cursor is not None:
        last = _uncursor(q.cursor, index, q.order)
        if desc:
            upper = last  # exclusive: continue below the last key examined
        else:
            lower = last + b"\x00"
    runs: list[dict[str, Any]] = []
    examined = 0
    budget = q.limit + SCAN_BUDGET
    last_key: bytes | None = None
    plen = len(prefix)
    for key, _ in txn.scan_raw(index, start=lower or None, stop=upper, reverse=desc):
        last_key = key
        examined += 1
        run_id = key[plen + 8:].decode()
        s = txn.get(store.RUN_SUMMARIES, run_id)
        if isinstance(s, dict) and q.matches(s):
            runs.append(s)
            if len(runs) == q.limit:
                break
        if examined >= budget:
            break
    else:
        return runs, None  # the range is exhausted
    assert last_key is not None
    if len(runs) < q.limit and examined < budget:
        return runs, None
    return runs, _cursor(index, q.order, last_key)


def _by_idempotency_key(txn: ReadTxn, q: Query) -> list[dict[str, Any]]:
    taken = txn.get(store.DISPATCH_KEYS, q.idempotency_key)  # type: ignore[arg-type]
    if not isinstance(taken, dict):
        return []
    s = txn.get(store.RUN_SUMMARIES, str(taken["run_id"]))
    if not isinstance(s, dict) or not q.matches(s):
        return []
    if q.correlation is not None:
        run = txn.get(store.RUNS, s["run_id"])
        corr = run.get("correlation") if isinstance(run, dict) else None
        if correlation_hash(corr) != correlation_hash(q.correlation):
            return []
    return [s]
