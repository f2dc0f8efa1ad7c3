"""Sticky execution, the pure half: history cursors, their hash, and deltas (AFFINITY.md
"Sticky execution"; docs/affinity.md "Sticky execution").

A run's *history*, as a lease carries it, is two maps: ``steps`` (earlier
steps' outputs by step id) and ``state`` (the run's public state). Both only
ever gain or replace top-level keys, never lose one, so a history is fully
described by its (kind, key) -> value entries, and what changed since a point
is the entries written after it.

A *cursor* names one point of a run's history: ``seq``, the journal sequence
number of the last history change it includes, and ``hash``, the digest of the
history at that point. The digest is a multiset hash: the sum, modulo 2**256,
of ``sha256(canonical_json([kind, key, value]))`` over every entry, as 64 hex
digits. It depends on the content only (not on how it was reached), and both
sides keep it up to date in time proportional to what changed: replacing an
entry subtracts the old entry's digest and adds the new one's. So the daemon
never rehashes a 100 KB history to issue a 2 KB delta, and the worker can check
a delta against the cursor the lease names before it counts a hit.

The daemon's bookkeeping lives in the run record's ``sticky`` map (absent on a
run no sticky worker ever took: such a run's record is as it always was):

* ``s``, ``h``: the cursor of the current history;
* ``ks``, ``kk``: for steps and state keys, the seq that last wrote them (a key
  absent there was written before tracking began, before any cursor handed out);
* ``hold``: the worker that ran the previous step and cached the history
  (``w`` worker id, ``b`` build id, ``c``/``ch`` its cursor, ``ms`` its
  ``sticky_schedule_ms``; ``x``, once the holder lost the run's worker session: the
  reason a lease to another worker is cold), or None.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from .canonical import canonical_json

__all__ = [
    "EMPTY_HASH",
    "KINDS",
    "MISSING",
    "StickyClaim",
    "StickyWorker",
    "apply_delta",
    "claim_holder",
    "cold_reason",
    "cursor_of",
    "delta_since",
    "entry_digest",
    "holder_of",
    "mark_holder_lost",
    "start_tracking",
    "track",
    "update_hash",
    "view_hash",
]

KINDS: Final = ("steps", "state")
_MOD: Final = 1 << 256
EMPTY_HASH: Final = "0" * 64
_MISSING: Final[Any] = object()


@dataclass(frozen=True, slots=True)
class StickyWorker:
    """What an offer knows of a worker that declared sticky execution."""

    worker_id: str
    build_id: str | None
    schedule_ms: int


@dataclass(frozen=True, slots=True)
class StickyClaim:
    """A completion's sticky cursor, its identity (workflow, run, build id) already checked
    by the capability gate (`stepd.sansio.capabilities.check_completion`): the run checks
    seq and hash."""

    seq: int
    hash: str
    workflow: str
    build_id: str | None
    schedule_ms: int


_GIL_CHUNK: Final = 2047


def entry_digest(kind: str, key: str, value: Any) -> int:
    """One history entry's share of the hash.

    Fed to sha256 in pieces under 2 KiB: hashlib releases the GIL for a bigger
    buffer, and taking it back behind the storage writer's thread cost more
    than the hashing itself (bench workload G).
    """
    data = canonical_json([kind, key, value], check_keys=False)
    h = hashlib.sha256()
    for i in range(0, len(data), _GIL_CHUNK):
        h.update(data[i:i + _GIL_CHUNK])
    return int.from_bytes(h.digest(), "big")


def view_hash(steps: Mapping[str, Any], state: Mapping[str, Any]) -> str:
    """The hash of a whole history (a cold start; the worker's check of a fetched history)."""
    total = 0
    for kind, entries in (("steps", steps), ("state", state)):
        for key, value in entries.items():
            total += entry_digest(kind, key, value)
    return f"{total % _MOD:064x}"


def update_hash(h: str, kind: str, key: str, old: Any, new: Any) -> str:
    """`h` after entry (kind, key) went from `old` (`_MISSING`: absent) to `new`."""
    total = int(h, 16) + entry_digest(kind, key, new)
    if old is not _MISSING:
        total -= entry_digest(kind, key, old)
    return f"{total % _MOD:064x}"


def apply_delta(steps: dict[str, Any], state: dict[str, Any], h: str,
                delta: Mapping[str, Mapping[str, Any]]) -> str:
    """Apply a delta (``{"steps": {...}, "state": {...}}``) in place; the new hash."""
    for kind, target in (("steps", steps), ("state", state)):
        for key, value in (delta.get(kind) or {}).items():
            h = update_hash(h, kind, key, target.get(key, _MISSING), value)
            target[key] = value
    return h


# --------------------------------------------------------------------------- the daemon's side


def start_tracking(steps: Mapping[str, Any], state: Mapping[str, Any], seq: int) -> dict[str, Any]:
    """The record's ``sticky`` map when a sticky worker first takes a step of the run."""
    return {"s": seq, "h": view_hash(steps, state), "ks": {}, "kk": {}, "hold": None}


def track(sticky: dict[str, Any], kind: str, key: str, old: Any, new: Any, seq: int) -> None:
    """An entry was written at journal `seq` (`old` is `MISSING` when it was absent)."""
    sticky["h"] = update_hash(sticky["h"], kind, key, old, new)
    sticky["s"] = seq
    sticky["ks" if kind == "steps" else "kk"][key] = seq


MISSING: Final = _MISSING


def cursor_of(sticky: Mapping[str, Any]) -> dict[str, Any]:
    return {"seq": sticky["s"], "hash": sticky["h"]}


def delta_since(sticky: Mapping[str, Any], steps: Mapping[str, Any], state: Mapping[str, Any],
                base: int) -> dict[str, dict[str, Any]]:
    """What changed after journal seq `base`, in each map's own order (so a worker
    that applies it with ``dict.update`` builds maps ordered as the daemon's)."""
    ks, kk = sticky["ks"], sticky["kk"]
    return {
        "steps": {k: v for k, v in steps.items() if ks.get(k, 0) > base},
        "state": {k: v for k, v in state.items() if kk.get(k, 0) > base},
    }


def holder_of(sticky: Mapping[str, Any] | None) -> dict[str, Any] | None:
    return None if sticky is None else sticky.get("hold")


def claim_holder(sticky: dict[str, Any], worker_id: str, claim: StickyClaim | None) -> bool:
    """A task step completed: its worker becomes the holder if it cached the history
    at the current cursor; None (it cached nothing) clears the holder.

    Returns False when the claimed cursor is not the current one (the caller
    refuses the completion with a 400: a worker claims only what it verified).
    """
    if claim is None:
        sticky["hold"] = None
        return True
    if claim.seq != sticky["s"] or claim.hash != sticky["h"]:
        return False
    sticky["hold"] = {"w": worker_id, "b": claim.build_id, "c": claim.seq, "ch": claim.hash,
                      "ms": claim.schedule_ms}
    return True


def mark_holder_lost(sticky: dict[str, Any] | None, worker_id: str | None) -> None:
    """Worker `worker_id` lost a worker session of the run: if it is the sticky holder, the
    session's next step goes to another worker with a cold lease."""
    hold = None if sticky is None else sticky["hold"]
    if hold is not None and hold["w"] == worker_id:
        hold["x"] = "session_holder_lost"


def cold_reason(hold: Mapping[str, Any], *, session: bool) -> str | None:
    """Why a lease to a worker other than the holder `hold` is cold (the worker fetches the
    history and counts a forced cold replay), or None: it carries the full history (a miss).

    A holder that lost the run's worker session: ``session_holder_lost``. A step
    of no session: the registry held it for the holder for its
    ``sticky_schedule_ms``, or offered it at once because it forgot the holder; either
    way the holder did not take it (SIGKILLed, expired, partitioned, or busy past its
    schedule): ``holder_unavailable``. A session's step pinned to its session holder,
    which is simply not the sticky holder (an earlier step ran elsewhere), is routing the
    daemon chose, not a loss: None.
    """
    lost = hold.get("x")
    if lost is not None:
        return str(lost)
    return None if session else "holder_unavailable"
