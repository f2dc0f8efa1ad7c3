"""The worker's sticky cache, sans I/O (AFFINITY.md "Sticky execution"; docs/affinity.md).

Bounded by entries, by bytes and by age, and keyed by the exact (workflow,
run id, worker build id). An entry holds the run's durable history *encoded*
(JSON of ``{"steps", "state"}``) with the cursor it is at, never live
objects: every lease decodes a fresh copy, so a body that mutates what it was
given cannot corrupt the next step's history.

`StickyCache.resolve` turns a lease's ``sticky`` part into the history its body
sees. A full lease (``mode: "full"``) carries the history: a *miss*, cached.
A delta lease (``mode: "delta"``) is applied only if the entry exists, its
build id is the one the base names, its cursor is the base cursor, and the
delta applied to it yields exactly the lease's cursor hash: only then a *hit*.
Anything else (no entry: never cached, evicted, expired, a replacement
process; another build; a wrong base or result) answers `Fetch`, and so does
a cold lease (``mode: "cold"``: the daemon's holder of the run was lost, the
lease carries no history and says why): the worker gets the full history
(``GET /v1/api/steps/{lease}/history``) and hands it to `fetched`, which
counts a *forced_cold_replay*. Time is passed in.
"""

from __future__ import annotations

import collections
import json
from dataclasses import dataclass, field
from typing import Any

from .sticky import apply_delta, view_hash

__all__ = ["CacheStats", "Fetch", "Ready", "StickyCache"]

Key = tuple[str, str, "str | None"]  # (workflow, run_id, build_id)


@dataclass(slots=True)
class CacheStats:
    """What a worker reports in each complete (cumulative since the worker started)."""

    hit: int = 0
    miss: int = 0
    eviction: int = 0
    forced_cold_replay: int = 0

    def as_dict(self) -> dict[str, int]:
        return {"hit": self.hit, "miss": self.miss, "eviction": self.eviction,
                "forced_cold_replay": self.forced_cold_replay}


@dataclass(frozen=True, slots=True)
class Ready:
    """The history the body sees, and the cursor to report (None: not cached)."""

    steps: dict[str, Any]
    state: dict[str, Any]
    cursor: dict[str, Any] | None


@dataclass(frozen=True, slots=True)
class Fetch:
    """The cache cannot serve this lease: fetch the full history. `why` says what failed
    (``no_entry``, ``build_mismatch``, ``base_mismatch``, ``result_mismatch``, or
    ``cold:<reason>`` for a cold lease: the daemon's reason)."""

    why: str


@dataclass(slots=True)
class _Entry:
    blob: bytes
    seq: int
    hash: str
    stored_ms: int


@dataclass(slots=True)
class StickyCache:
    """See the module docstring.

    Attributes:
        capacity: most entries (runs) kept.
        max_bytes: most encoded bytes kept in all; a history bigger than this
            alone is not cached (its step reports no cursor).
        ttl_ms: an entry older than this (since it was stored) is dropped.
        build_id: this worker's build id: part of every key.
    """

    capacity: int
    max_bytes: int
    ttl_ms: int
    build_id: str | None
    stats: CacheStats = field(default_factory=CacheStats)
    _entries: collections.OrderedDict[Key, _Entry] = field(
        default_factory=collections.OrderedDict)
    _bytes: int = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes(self) -> int:
        return self._bytes

    # ------------------------------------------------------------------ leases

    def resolve(self, lease: dict[str, Any], now_ms: int) -> Ready | Fetch:
        """The history of a lease with a ``sticky`` part (see the module docstring)."""
        sticky = lease["sticky"]
        cursor = sticky["cursor"]
        key = (lease["workflow"], lease["run_id"], self.build_id)
        if sticky.get("mode") == "full":
            self.stats.miss += 1
            steps, state = dict(lease.get("steps") or {}), dict(lease.get("state") or {})
            return Ready(steps, state, self._store(key, steps, state, cursor, now_ms))
        if sticky.get("mode") == "cold":
            return Fetch(f"cold:{sticky.get('reason')}")
        base = sticky["base"]
        if base.get("build_id") != self.build_id:
            return Fetch("build_mismatch")
        entry = self._get(key, now_ms)
        if entry is None:
            return Fetch("no_entry")
        if (entry.seq, entry.hash) != (base.get("seq"), base.get("hash")):
            return Fetch("base_mismatch")
        history = json.loads(entry.blob)
        steps, state = history["steps"], history["state"]
        h = apply_delta(steps, state, entry.hash, sticky)
        if h != cursor.get("hash"):
            return Fetch("result_mismatch")
        self.stats.hit += 1
        return Ready(steps, state, self._store(key, steps, state, cursor, now_ms, checked=True))

    def fetched(self, lease: dict[str, Any], answer: dict[str, Any], now_ms: int) -> Ready:
        """The full history fetched for a lease `resolve` could not serve."""
        self.stats.forced_cold_replay += 1
        steps, state = dict(answer.get("steps") or {}), dict(answer.get("state") or {})
        key = (lease["workflow"], lease["run_id"], self.build_id)
        return Ready(steps, state, self._store(key, steps, state, answer["cursor"], now_ms))

    def forget_run(self, run_id: str) -> None:
        """The run is over: its entries go (not an eviction)."""
        for key in [k for k in self._entries if k[1] == run_id]:
            self._drop(key)

    def entry_cursor(self, workflow: str, run_id: str) -> tuple[int, str] | None:
        """The cursor this worker's entry for the run is at (diagnostics and tests)."""
        entry = self._entries.get((workflow, run_id, self.build_id))
        return None if entry is None else (entry.seq, entry.hash)

    def set_entry_hash(self, workflow: str, run_id: str, h: str) -> bool:
        """Overwrite an entry's cursor hash (fault injection: a corrupted cache must be
        caught by the cursor check and replayed cold, never served)."""
        entry = self._entries.get((workflow, run_id, self.build_id))
        if entry is None:
            return False
        entry.hash = h
        return True

    # ------------------------------------------------------------------ bounds

    def _get(self, key: Key, now_ms: int) -> _Entry | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        if now_ms - entry.stored_ms >= self.ttl_ms:
            self._drop(key)
            self.stats.eviction += 1
            return None
        return entry

    def _store(self, key: Key, steps: dict[str, Any], state: dict[str, Any],
               cursor: dict[str, Any], now_ms: int, *, checked: bool = False
               ) -> dict[str, Any] | None:
        """Keep the history at `cursor` if its hash checks out (`checked`: the delta's
        incremental hash did already) and it fits; the cursor the completion reports
        (with this worker's identity), or None."""
        self._drop(key)
        if not checked and view_hash(steps, state) != cursor.get("hash"):
            return None  # the daemon's history does not match its own cursor: never cached
        # Key order kept (not canonical JSON's sorted keys): the body sees the maps
        # ordered as a lease without sticky execution carries them.
        blob = json.dumps({"steps": steps, "state": state}, separators=(",", ":"),
                          ensure_ascii=False, allow_nan=False).encode()
        if len(blob) > self.max_bytes:
            return None
        self._entries[key] = _Entry(blob, int(cursor["seq"]), str(cursor["hash"]), now_ms)
        self._bytes += len(blob)
        while len(self._entries) > self.capacity or self._bytes > self.max_bytes:
            oldest = next(iter(self._entries))
            self._drop(oldest)
            self.stats.eviction += 1
        return {"seq": int(cursor["seq"]), "hash": str(cursor["hash"]), "workflow": key[0],
                "run_id": key[1], "build_id": self.build_id}

    def _drop(self, key: Key) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._bytes -= len(entry.blob)
