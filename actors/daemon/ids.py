"""Identifiers: time-ordered, random, URL-safe (`r_01J...`, `l_01J...`, `w_01J...`).

ULID layout (48 bits of milliseconds, 80 random bits, Crockford base32,
monotonic within the process), so ids sort by creation time: a scan of the `runs` table lists runs oldest first
without an index. The time comes from the caller's clock, never read here.
"""

from __future__ import annotations

import os

_ALPHABET = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
#: Every 10-bit value as its two base32 digits: a ULID is 13 lookups, not 26
#: appends (a lease id is made on every step).
_PAIRS = tuple(a + b for a in _ALPHABET for b in _ALPHABET)


_last = 0
#: Random bytes fetched 640 at a time: one `getrandom` syscall per 64 ids, not
#: one per id (a lease id is made on every step). Same source as `os.urandom`.
_POOL_BYTES = 640
_pool = b""
_pool_at = 0


def _forked() -> None:
    """A forked child must not reuse its parent's random bytes, nor continue its
    monotonic sequence: two processes adding one to the same `_last` in the same
    millisecond would make the same id. The child's ids are monotonic among
    themselves, as the module promises ("within this process")."""
    global _last, _pool, _pool_at
    _last, _pool, _pool_at = 0, b"", 0


os.register_at_fork(after_in_child=_forked)


def ulid(time_ms: int) -> str:
    """A ULID, monotonic within this process (the ULID spec's monotonic factory).

    Two ids made in the same millisecond (or with a clock that stepped back)
    still sort in the order they were made: the second is the first plus one.
    Listings newest first rely on it, and so does anything that sorts by id.
    """
    global _last, _pool, _pool_at
    at = _pool_at
    if at + 10 > len(_pool):
        _pool = os.urandom(_POOL_BYTES)
        at = 0
    _pool_at = at + 10
    value = ((time_ms & 0xFFFF_FFFF_FFFF) << 80) | int.from_bytes(_pool[at:at + 10], "big")
    if value <= _last:
        value = _last + 1
    _last = value
    p = _PAIRS  # 13 lookups spelled out: no comprehension and join per id (one per step)
    return (p[value >> 120 & 1023] + p[value >> 110 & 1023] + p[value >> 100 & 1023]
            + p[value >> 90 & 1023] + p[value >> 80 & 1023] + p[value >> 70 & 1023]
            + p[value >> 60 & 1023] + p[value >> 50 & 1023] + p[value >> 40 & 1023]
            + p[value >> 30 & 1023] + p[value >> 20 & 1023] + p[value >> 10 & 1023]
            + p[value & 1023])


def run_id(time_ms: int) -> str:
    return "r_" + ulid(time_ms)


def lease_id(time_ms: int) -> str:
    return "l_" + ulid(time_ms)


def worker_id(time_ms: int) -> str:
    return "w_" + ulid(time_ms)


def schedule_id(time_ms: int) -> str:
    return "s_" + ulid(time_ms)
