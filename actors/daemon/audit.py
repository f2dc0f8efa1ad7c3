"""The audit log: who read, started, signalled, cancelled or killed what (PROTOCOL.md "Audit log").

Every read of runs through the runs endpoints, every start, signal, cancel and
kill, and every read of the audit log, the actor tree and the workers list is
one `AuditEntry`: time, key id, scope used, action, target, outcome. Worker
calls are never audited ("a claim loop would bury what people read").

Storage: the ``audit`` table of the daemon's LMDB. Keys are
``u64be(time_ms) + u64be(seq)`` (16 bytes), so a forward scan is oldest first
and a reverse scan newest first; ``seq`` is a counter owned by `AuditLog`,
continued from the last stored entry at start, so no two entries share a key
even when the wall clock steps back or two entries land in one millisecond.

Durability trade-off (docs/http-api.md "Audit log"): `AuditLog.record` queues
the entry with ``storage.write_deferred``, so a read request does not wait for
a synced commit of its own audit entry. The entry is ordered after every write
submitted before it and committed with the next batch, at most
``deferred_flush_ms`` (5 ms by default) later, or with the next awaited write,
or at close. A crash (of the daemon, the OS or the power) inside that window
loses the entries not yet committed, never reorders them. For
mutations, which pay for a synced commit anyway, the strongest form is to write
the entry inside the mutation's own transaction with `append_txn` (take the
``seq`` from `AuditLog.next_seq`): the entry then exists if and only if the
change does (research/anchors-reliability.md 7.3 and test Z1).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, Protocol

from stepd.sansio.enums import IdentityEnum
from stepd.sansio.errors import Invalid
from stepd.storage import ReadTxn, WriteTxn, parse_u64be, u64be

from . import tables

__all__ = [
    "AUDIT_TABLE",
    "DEFAULT_PAGE_LIMIT",
    "MAX_PAGE_LIMIT",
    "AuditAction",
    "AuditEntry",
    "AuditLog",
    "append_txn",
    "audit_key",
    "parse_cursor",
]

AUDIT_TABLE: Final = tables.AUDIT
DEFAULT_PAGE_LIMIT: Final = 100
MAX_PAGE_LIMIT: Final = 1000

_KEY_LEN: Final = 16
_MAX_PROBES: Final = 1 << 16


class AuditAction(IdentityEnum):
    """What was done (the ``action`` of an entry). One per audited endpoint."""

    RUNS_READ = "runs.read"
    RUNS_LIST = "runs.list"
    RUNS_JOURNAL = "runs.journal"
    RUNS_EXPORT = "runs.export"
    RUNS_RESULT = "runs.result"
    RUNS_START = "runs.start"
    RUNS_SIGNAL = "runs.signal"
    RUNS_CANCEL = "runs.cancel"
    RUNS_RETRY = "runs.retry"
    RUNS_FORK = "runs.fork"
    ACTORS_READ = "actors.read"
    ACTORS_KILL = "actors.kill"
    AUDIT_READ = "audit.read"
    WORKERS_READ = "workers.read"
    DEFINITIONS_READ = "definitions.read"
    STATS_READ = "stats.read"
    SCHEDULES_CREATE = "schedules.create"
    SCHEDULES_LIST = "schedules.list"
    SCHEDULES_READ = "schedules.read"
    SCHEDULES_PAUSE = "schedules.pause"
    SCHEDULES_RESUME = "schedules.resume"
    SCHEDULES_DELETE = "schedules.delete"
    RUNS_PRUNE = "runs.prune"
    DAEMON_READ = "daemon.read"


_ACTIONS: Final = frozenset(a.value for a in AuditAction)
_new_object = object.__new__
_set = object.__setattr__
_SCOPES: Final = frozenset({"admin", "write", "worker", "execute", "read"})


@dataclass(frozen=True, slots=True)
class AuditEntry:
    """One audited call.

    Attributes:
        time_ms: wall-clock epoch milliseconds when the call was answered.
        key_id: the caller's key id (`stepd.transport.auth.key_id`), never the
            key; None when the daemon runs without keys.
        scope: the scope that granted the call (``read``, ``execute``, ...), or
            None when it was refused before a scope applied.
        action: an `AuditAction` value (``runs.start``).
        target: the run id, the actor path, or None (lists, the audit log).
        status: the HTTP status answered (201, 200, 403, 404, 409, ...).
        reason: a short reason for a refusal (``insufficient_scope``,
            ``run_terminal``, ``budget_exceeded``, ``not_found``); None on success.

    Raises:
        Invalid: (at construction) an unknown action or scope, a status outside
            100..599, a negative time.
    """

    time_ms: int
    key_id: str | None
    scope: str | None
    action: str
    target: str | None
    status: int
    reason: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.action, AuditAction):
            object.__setattr__(self, "action", self.action.value)
        if isinstance(self.scope, enum.Enum):  # a stepd.transport.auth.Scope
            object.__setattr__(self, "scope", self.scope.value)
        if self.action not in _ACTIONS:
            raise Invalid(f"unknown audit action {self.action!r}", field="action")
        if self.scope is not None and self.scope not in _SCOPES:
            raise Invalid(f"unknown scope {self.scope!r}", field="scope")
        if (
            isinstance(self.status, bool)
            or not isinstance(self.status, int)
            or not (100 <= self.status <= 599)
        ):
            raise Invalid(f"not an HTTP status: {self.status!r}", field="status")
        if isinstance(self.time_ms, bool) or not isinstance(self.time_ms, int) or self.time_ms < 0:
            raise Invalid(f"must be epoch milliseconds >= 0, got {self.time_ms!r}", field="time_ms")

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (``GET /v1/api/audit``) and the stored form."""
        return {
            "time_ms": self.time_ms,
            "key_id": self.key_id,
            "scope": self.scope,
            "action": self.action,
            "target": self.target,
            "status": self.status,
            "reason": self.reason,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AuditEntry:
        """Rebuild an entry from `to_dict`'s form.

        Raises:
            KeyError: a field is missing.
            Invalid: a field is out of range.
        """
        return cls(
            time_ms=data["time_ms"],
            key_id=data["key_id"],
            scope=data["scope"],
            action=data["action"],
            target=data["target"],
            status=data["status"],
            reason=data.get("reason"),
        )


def audit_key(time_ms: int, seq: int) -> bytes:
    """The storage key of an entry: ``u64be(time_ms) + u64be(seq)``."""
    return u64be(time_ms) + u64be(seq)


def append_txn(txn: WriteTxn, entry: AuditEntry, seq: int) -> bytes:
    """Write ``entry`` under ``audit_key(entry.time_ms, seq)``; return the key used.

    Pure over ``txn`` (it may run twice when a batch is re-run after map
    growth). Never overwrites: should the key be taken (two `AuditLog`s on one
    storage, which the daemon does not do), it takes the next free ``seq`` of
    that millisecond, so an entry is never lost to a collision and the write
    never fails for it.
    """
    value = entry.to_dict()
    for probe in range(_MAX_PROBES):
        key = audit_key(entry.time_ms, seq + probe)
        if txn.put(AUDIT_TABLE, key, value, overwrite=False):
            return key
    raise RuntimeError(  # pragma: no cover - 65536 entries of one ms under one seq
        f"no free audit key at {entry.time_ms} ms from seq {seq}"
    )


def parse_cursor(cursor: str | None) -> bytes | None:
    """The storage key a page cursor stands for (32 lowercase hex digits).

    Raises:
        Invalid: not 32 hex digits (``field="cursor"``).
    """
    if cursor is None:
        return None
    try:
        key = bytes.fromhex(cursor)
    except ValueError:
        key = b""
    if len(key) != _KEY_LEN or cursor != key.hex():
        raise Invalid("must be a cursor returned by an earlier page", field="cursor")
    return key


class _Storage(Protocol):
    """What `AuditLog` needs of `stepd.storage.Storage`."""

    async def write(self, fn: Any, *args: Any) -> Any: ...

    def read(self, fn: Any, *args: Any) -> Any: ...


class AuditLog:
    """Records audit entries in storage and pages through them.

    Create one per storage (per daemon); it owns the ``seq`` counter.
    """

    def __init__(self, storage: _Storage, *, clock: Callable[[], float] = time.time) -> None:
        """Continue the ``seq`` counter after the last stored entry (one short read).

        Args:
            storage: an open `stepd.storage.Storage` (anything with the same
                ``write``/``write_deferred``/``read``).
            clock: wall-clock seconds, for `new_entry`'s ``time_ms``.
        """
        self._storage = storage
        self._clock = clock
        self._seq: int = storage.read(_last_seq_txn) + 1

    def next_seq(self) -> int:
        """Take the next sequence number (for `append_txn` inside a caller's transaction)."""
        seq = self._seq
        self._seq = seq + 1
        return seq

    def now_ms(self) -> int:
        """Wall-clock epoch milliseconds from the log's clock."""
        return int(self._clock() * 1000)

    def new_entry(
        self,
        *,
        key_id: str | None,
        scope: str | None,
        action: AuditAction | str,
        target: str | None,
        status: int,
        reason: str | None = None,
    ) -> AuditEntry:
        """An entry stamped with the log's clock (``time_ms = now``).

        Raises:
            Invalid: see `AuditEntry`.
        """
        if (type(action) is AuditAction and (scope is None or scope in _SCOPES)
                and type(status) is int and 100 <= status <= 599):
            # What the daemon makes itself (every audited request makes one or two):
            # an action of the enum, a known scope and a status in range pass
            # `__post_init__`'s checks by construction, and the clock gives a time
            # >= 0. Built without `__init__` and `__post_init__` (two Python calls
            # and ~8 C calls fewer: a start and its result read make two entries).
            entry = _new_object(AuditEntry)
            _set(entry, "time_ms", int(self._clock() * 1000))
            _set(entry, "key_id", key_id)
            _set(entry, "scope", scope)
            _set(entry, "action", action.text)
            _set(entry, "target", target)
            _set(entry, "status", status)
            _set(entry, "reason", reason)
            return entry
        return AuditEntry(
            time_ms=self.now_ms(),
            key_id=key_id,
            scope=scope,
            action=action.text if isinstance(action, AuditAction) else action,
            target=target,
            status=status,
            reason=reason,
        )

    async def record(self, entry: AuditEntry) -> None:
        """Store ``entry``; with a deferred-capable storage, without waiting for the commit.

        With ``storage.write_deferred`` (the daemon's storage) this returns at
        once; the entry commits with the next batch, in submission order (see
        the module docstring for the trade-off). Otherwise it awaits a synced
        ``storage.write``.

        Raises:
            StorageClosed: the storage is closed.
        """
        seq = self.next_seq()
        deferred = getattr(self._storage, "write_deferred", None)
        if deferred is not None:
            deferred(append_txn, entry, seq)
            return
        await self._storage.write(append_txn, entry, seq)

    async def append(self, entry: AuditEntry) -> None:
        """Store ``entry`` and return once it is committed (a mutation's own entry, e.g. a kill).

        Raises:
            StorageClosed: the storage is closed.
        """
        await self._storage.write(append_txn, entry, self.next_seq())

    def page(
        self, limit: int = DEFAULT_PAGE_LIMIT, before: str | None = None
    ) -> tuple[list[AuditEntry], str | None]:
        """A page of entries, newest first, for ``GET /v1/api/audit``.

        Reads only what is committed: an entry recorded a moment ago may not
        show until its batch commits (a few milliseconds).

        Args:
            limit: the most entries to return, 1..`MAX_PAGE_LIMIT`.
            before: the ``next_cursor`` of the previous page (entries strictly
                older than it), or None for the newest.

        Returns:
            ``(entries, next_cursor)``: ``next_cursor`` is None when no older
            entry exists.

        Raises:
            Invalid: ``limit`` out of range (``field="limit"``) or a malformed
                cursor (``field="cursor"``).
        """
        if (
            isinstance(limit, bool)
            or not isinstance(limit, int)
            or not (1 <= limit <= MAX_PAGE_LIMIT)
        ):
            raise Invalid(f"must be an integer from 1 to {MAX_PAGE_LIMIT}", field="limit")
        stop = parse_cursor(before)
        rows: list[tuple[bytes, Any]] = self._storage.read(_page_txn, stop, limit + 1)
        more = len(rows) > limit
        rows = rows[:limit]
        entries = [AuditEntry.from_dict(value) for _, value in rows]
        next_cursor = rows[-1][0].hex() if more else None
        return entries, next_cursor


def _last_seq_txn(txn: ReadTxn) -> int:
    """The largest ``seq`` among stored entries, -1 if none.

    Entries are ordered by time first, so the last key need not hold the largest
    seq after the clock stepped back; only the tail is scanned (the counter is
    shared by every entry, so a larger seq is always recent), bounded to keep
    the start fast.
    """
    best = -1
    for key, _ in txn.scan(AUDIT_TABLE, reverse=True, limit=1024):
        if len(key) == _KEY_LEN:
            best = max(best, parse_u64be(key[8:]))
    return best


def _page_txn(txn: ReadTxn, stop: bytes | None, limit: int) -> list[tuple[bytes, Any]]:
    return list(txn.scan(AUDIT_TABLE, stop=stop, reverse=True, limit=limit))
