"""Key encodings: byte order is the order LMDB sorts in, so it must be numeric.

LMDB compares keys as byte strings (memcmp). Integers are therefore stored
big-endian and fixed-width (:func:`u64be`): byte order equals numeric order, so
range scans over sequence numbers and due times are plain cursor walks.

Composite keys:

* journal: ``run_id utf-8 | 0x00 | u64be(seq)``. All of a run's entries are
  contiguous (``journal_prefix(run_id)``) and ordered by ``seq``; runs sort by
  their id's bytes. The 0x00 separator keeps run ``"a"`` from interleaving
  with run ``"ab"``, hence run ids may not contain NUL.
* timer queue: ``u64be(due_ms) | owner_id utf-8 | 0x00 | tag``. The queue
  sorts by due time first, so "what is due" is a forward scan from the start
  up to ``u64be(now_ms + 1)``; ties break by owner, then tag.
"""

from __future__ import annotations

__all__ = [
    "U64_MAX",
    "Key",
    "journal_key",
    "journal_prefix",
    "parse_journal_key",
    "parse_timer_key",
    "parse_u64be",
    "prefix_end",
    "timer_key",
    "to_key",
    "u64be",
]

#: What the storage accepts as a key: bytes, or str (encoded as UTF-8).
Key = bytes | str

U64_MAX = (1 << 64) - 1
_SEP = b"\x00"


def to_key(key: bytes | str) -> bytes:
    """Return ``key`` as bytes (``str`` is encoded as UTF-8).

    Raises:
        TypeError: ``key`` is neither ``bytes`` nor ``str``.
    """
    if isinstance(key, bytes):
        return key
    if isinstance(key, str):
        return key.encode()
    if isinstance(key, (bytearray, memoryview)):
        return bytes(key)
    raise TypeError(f"a key must be bytes or str, not {type(key).__name__}")


def u64be(n: int) -> bytes:
    """Encode a non-negative integer as 8 big-endian bytes (sorts numerically).

    Raises:
        ValueError: ``n`` is negative or needs more than 64 bits.
    """
    if not 0 <= n <= U64_MAX:
        raise ValueError(f"u64 key out of range: {n}")
    return n.to_bytes(8, "big")


def parse_u64be(data: bytes) -> int:
    """Decode 8 big-endian bytes written by :func:`u64be`.

    Raises:
        ValueError: ``data`` is not exactly 8 bytes long.
    """
    if len(data) != 8:
        raise ValueError(f"a u64 key is 8 bytes, got {len(data)}")
    return int.from_bytes(data, "big")


def _id_bytes(what: str, value: bytes | str) -> bytes:
    raw = to_key(value)
    if _SEP in raw:
        raise ValueError(f"{what} must not contain NUL: {value!r}")
    return raw


def journal_prefix(run_id: bytes | str) -> bytes:
    """The key prefix shared by all journal entries of ``run_id``.

    Raises:
        ValueError: ``run_id`` contains NUL.
    """
    if type(run_id) is str:  # `_id_bytes` spelled out for a str (once a run's write)
        raw = run_id.encode()
        if _SEP in raw:
            raise ValueError(f"run_id must not contain NUL: {run_id!r}")
        return raw + _SEP
    return _id_bytes("run_id", run_id) + _SEP


def journal_key(run_id: bytes | str, seq: int) -> bytes:
    """The journal key of entry ``seq`` of ``run_id`` (sorts by run, then seq).

    Raises:
        ValueError: ``run_id`` contains NUL, or ``seq`` is outside 0..2**64-1.
    """
    return journal_prefix(run_id) + u64be(seq)


def parse_journal_key(key: bytes) -> tuple[str, int]:
    """Split a journal key into ``(run_id, seq)``.

    Raises:
        ValueError: ``key`` is not a journal key.
    """
    if len(key) < 9 or key[-9:-8] != _SEP:
        raise ValueError(f"not a journal key: {key!r}")
    return key[:-9].decode(), parse_u64be(key[-8:])


def timer_key(due_ms: int, owner_id: bytes | str, tag: bytes | str) -> bytes:
    """The timer-queue key of a timer (sorts by due time, then owner, then tag).

    Raises:
        ValueError: ``due_ms`` is outside 0..2**64-1 or ``owner_id`` contains NUL.
    """
    return u64be(due_ms) + _id_bytes("owner_id", owner_id) + _SEP + to_key(tag)


def parse_timer_key(key: bytes) -> tuple[int, str, bytes]:
    """Split a timer key into ``(due_ms, owner_id, tag)``.

    The tag comes back as bytes (it may be binary); decode it if you stored text.

    Raises:
        ValueError: ``key`` is not a timer key.
    """
    sep = key.find(_SEP, 8)
    if len(key) < 9 or sep < 0:
        raise ValueError(f"not a timer key: {key!r}")
    return parse_u64be(key[:8]), key[8:sep].decode(), key[sep + 1 :]


def prefix_end(prefix: bytes) -> bytes | None:
    """The smallest key greater than every key starting with ``prefix``.

    ``None`` means "no upper bound" (the prefix is empty or all 0xff bytes).
    """
    trimmed = prefix.rstrip(b"\xff")
    if not trimmed:
        return None
    return trimmed[:-1] + bytes([trimmed[-1] + 1])
