"""The transaction objects handed to request functions.

:class:`ReadTxn` wraps a read-only ``lmdb.Transaction``; :class:`WriteTxn`
adds the mutations. Both speak in table names (the named sub-databases
declared at open) and decoded values (the msgpack codec), with ``*_raw``
variants for bytes. Keys are bytes; ``str`` keys are accepted and encoded as
UTF-8.

A txn object is valid only while the function it was handed to runs: it is
invalidated when that function returns, so it cannot leak into another thread
(LMDB write transactions must not cross threads) or outlive its transaction.
Iterators from :meth:`ReadTxn.scan` are lazy, so consume them inside the
function too (or use ``list(...)``).

Helpers that take a txn are named ``*_txn`` (e.g. :func:`journal_txn`), so
the same helper serves a read and a write transaction.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

import lmdb

from ._codec import _local as _codec_local
from ._codec import decode, encode
from ._errors import UnknownTable
from ._keys import Key, journal_key, journal_prefix, parse_u64be, prefix_end, to_key

T = TypeVar("T")

__all__ = ["ReadTxn", "WriteTxn", "journal_txn", "last_journal_seq_txn"]


class ReadTxn:
    """Reads inside one LMDB transaction (read-only or the writer's).

    Not thread-safe and not to be kept: valid only during the call of the
    function it was handed to.
    """

    __slots__ = ("_dbs", "_txn")

    def __init__(self, txn: lmdb.Transaction[bytes], dbs: Mapping[str, lmdb._Database]) -> None:
        self._txn: lmdb.Transaction[bytes] | None = txn
        self._dbs = dbs

    # -- plumbing ---------------------------------------------------------

    def _live(self) -> lmdb.Transaction[bytes]:
        txn = self._txn
        if txn is None:
            raise RuntimeError(
                "this txn was used after its function returned; "
                "a txn is valid only inside the function it was handed to"
            )
        return txn

    def _db(self, table: str) -> lmdb._Database:
        try:
            return self._dbs[table]
        except KeyError:
            raise UnknownTable(
                f"unknown table {table!r}; declare it in Storage.open(extra_tables=...)"
            ) from None

    def _finish(self) -> None:
        """Invalidate: called by the storage when the function returns."""
        self._txn = None

    # -- reads ------------------------------------------------------------

    def get_raw(self, table: str, key: Key) -> bytes | None:
        """Return the stored bytes under ``key``, or ``None`` if absent.

        Raises:
            UnknownTable: ``table`` was not declared.
        """
        # `_live`, `_db` and `to_key` spelled out for a str or bytes key in a declared
        # table (a run's write reads its lease and run records); anything unusual
        # takes them for their errors.
        txn = self._txn
        db = self._dbs.get(table)
        if type(key) is str:
            key = key.encode()
        if txn is None or db is None or type(key) is not bytes:
            return self._live().get(to_key(key), db=self._db(table))
        return txn.get(key, db=db)

    def get(self, table: str, key: Key) -> object | None:
        """Return the decoded value under ``key``, or ``None`` if absent.

        A stored ``None`` also reads as ``None``; use :meth:`exists` to tell.

        Raises:
            UnknownTable: ``table`` was not declared.
        """
        raw = self.get_raw(table, key)
        return None if raw is None else decode(raw)

    def exists(self, table: str, key: Key) -> bool:
        """Return whether ``key`` is present in ``table``.

        Raises:
            UnknownTable: ``table`` was not declared.
        """
        return self.get_raw(table, key) is not None

    def count(self, table: str) -> int:
        """Return the number of entries in ``table`` (O(1): from LMDB's stats).

        Raises:
            UnknownTable: ``table`` was not declared.
        """
        return self._live().stat(self._db(table))["entries"]

    def scan_raw(
        self,
        table: str,
        *,
        prefix: Key = b"",
        start: Key | None = None,
        stop: Key | None = None,
        reverse: bool = False,
        limit: int | None = None,
    ) -> Iterator[tuple[bytes, bytes]]:
        """Iterate ``(key, raw value)`` in key order; see :meth:`scan`."""
        txn = self._live()
        db = self._db(table)
        lower, upper = _bounds(to_key(prefix), start, stop)
        if limit is not None and limit < 0:
            raise ValueError(f"limit must be >= 0, got {limit}")
        return _walk(txn, db, lower, upper, reverse, limit)

    def scan(
        self,
        table: str,
        *,
        prefix: Key = b"",
        start: Key | None = None,
        stop: Key | None = None,
        reverse: bool = False,
        limit: int | None = None,
    ) -> Iterator[tuple[bytes, object]]:
        """Iterate ``(key, decoded value)`` over a key range, using ``set_range``.

        The range is the intersection of "starts with ``prefix``" and
        ``start <= key < stop`` (``start`` inclusive, ``stop`` exclusive, each
        optional). ``reverse`` walks it from the top; ``limit`` caps the count.
        Lazy: consume it inside the function that received the txn.

        Raises:
            UnknownTable: ``table`` was not declared.
            ValueError: ``limit`` is negative.
        """
        for key, raw in self.scan_raw(
            table, prefix=prefix, start=start, stop=stop, reverse=reverse, limit=limit
        ):
            yield key, decode(raw)


class WriteTxn(ReadTxn):
    """Reads and writes inside the writer's (nested) write transaction."""

    __slots__ = ("_env", "_log", "_on_map_full")

    def __init__(
        self,
        txn: lmdb.Transaction[bytes],
        dbs: Mapping[str, lmdb._Database],
        on_map_full: Callable[[], None],
        log: list[tuple[Any, ...]] | None,
        env: lmdb.Environment,
    ) -> None:
        self._txn = txn  # `ReadTxn.__init__`, spelled out: one per write request
        self._dbs = dbs
        self._env = env  # for `savepoint`
        # Called when LMDB reports the map full, so the writer grows the map
        # and re-runs the batch even if the request function swallows the error.
        self._on_map_full = on_map_full
        # Every write that changed something, for the write-ahead log (`_wal`):
        # ``(PUT, table, key, value, overwrite)`` or ``(DELETE, table, key)``.
        self._log = log

    def put_raw(self, table: str, key: Key, value: bytes, *, overwrite: bool = True) -> bool:
        """Store bytes under ``key``.

        Args:
            table: a declared table.
            key: the key (``str`` is encoded as UTF-8); 1 to 511 bytes.
            value: the bytes to store.
            overwrite: if false, leave an existing value alone.

        Returns:
            Whether the value was written (false only when ``overwrite`` is
            false and the key existed).

        Raises:
            UnknownTable: ``table`` was not declared.
            lmdb.BadValsizeError: the key is empty or too long.
        """
        # `_live`, `_db` and `to_key` spelled out for a str or bytes key in a declared
        # table (~9 puts a step); anything unusual takes them for their errors.
        txn = self._txn
        db = self._dbs.get(table)
        raw = key.encode() if type(key) is str else key
        if txn is None or db is None or type(raw) is not bytes:
            txn = self._live()
            db = self._db(table)
            raw = to_key(key)
        try:
            done = txn.put(raw, value, overwrite=overwrite, db=db)
        except lmdb.MapFullError:
            self._on_map_full()
            raise
        log = self._log
        if done and log is not None:
            log.append((0, table, raw, value, overwrite))
        return done

    def put(self, table: str, key: Key, value: object, *, overwrite: bool = True) -> bool:
        """Encode ``value`` (msgpack) and store it under ``key``; see :meth:`put_raw`.

        Raises:
            UnknownTable: ``table`` was not declared.
            TypeError: ``value`` is not msgpack-serialisable.
        """
        # `encode` spelled out (~7 puts a step): this thread's packer, made by
        # `encode` the first time.
        try:
            data = _codec_local.packer.pack(value)
        except AttributeError:
            data = encode(value)
        # `put_raw` spelled out for a str or bytes key in a declared table (a call
        # a put fewer); anything unusual takes `put_raw` for its errors.
        txn = self._txn
        db = self._dbs.get(table)
        raw = key.encode() if type(key) is str else key
        if txn is None or db is None or type(raw) is not bytes:
            return self.put_raw(table, key, data, overwrite=overwrite)
        try:
            done = txn.put(raw, data, overwrite=overwrite, db=db)
        except lmdb.MapFullError:
            self._on_map_full()
            raise
        log = self._log
        if done and log is not None:
            log.append((0, table, raw, data, overwrite))
        return done

    def savepoint(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(self, *args)`` in a transaction nested in this one.

        If it raises, its changes alone are rolled back (in LMDB and in what the
        write-ahead log will hold) and the exception propagates: what this
        request wrote before stands, and it may go on. A map that fills up
        inside still re-runs the whole batch (the writer hears of it either way).

        Raises:
            Exception: whatever ``fn`` raised, after the rollback.
        """
        outer = self._live()
        log = self._log
        mark = 0 if log is None else len(log)
        child = self._env.begin(write=True, parent=outer)
        self._txn = child
        try:
            value = fn(self, *args)
        except BaseException:
            self._txn = outer
            child.abort()
            if log is not None:
                del log[mark:]
            raise
        self._txn = outer
        try:
            child.commit()
        except lmdb.MapFullError:
            self._on_map_full()
            raise
        return value

    def delete(self, table: str, key: Key) -> bool:
        """Delete ``key``; return whether it existed.

        Raises:
            UnknownTable: ``table`` was not declared.
        """
        txn = self._live()
        db = self._db(table)
        raw = to_key(key)
        try:
            done = txn.delete(raw, db=db)
        except lmdb.MapFullError:  # deletes copy pages too (copy-on-write)
            self._on_map_full()
            raise
        if done and self._log is not None:
            self._log.append((1, table, raw))
        return done


def _bounds(prefix: bytes, start: Key | None, stop: Key | None) -> tuple[bytes, bytes | None]:
    """Intersect the prefix range with ``[start, stop)``: ``(lower, upper)``."""
    lower = prefix
    upper = prefix_end(prefix)
    if start is not None:
        lower = max(lower, to_key(start))
    if stop is not None:
        s = to_key(stop)
        upper = s if upper is None else min(upper, s)
    return lower, upper


def _walk(
    txn: lmdb.Transaction[bytes],
    db: lmdb._Database,
    lower: bytes,
    upper: bytes | None,
    reverse: bool,
    limit: int | None,
) -> Iterator[tuple[bytes, bytes]]:
    if limit == 0 or (upper is not None and upper <= lower):
        return
    cursor = txn.cursor(db)
    try:
        if reverse:
            if upper is None:
                found = cursor.last()
            elif cursor.set_range(upper):  # first key >= upper: step back below it
                found = cursor.prev()
            else:  # every key is < upper
                found = cursor.last()
            step = cursor.prev
        else:
            found = cursor.set_range(lower) if lower else cursor.first()
            step = cursor.next
        n = 0
        while found:
            key = cursor.key()
            if reverse:
                if key < lower:
                    return
            elif upper is not None and key >= upper:
                return
            yield key, cursor.value()
            n += 1
            if limit is not None and n >= limit:
                return
            found = step()
    finally:
        cursor.close()


def journal_txn(
    txn: ReadTxn, run_id: Key, *, after_seq: int = 0, limit: int | None = None
) -> list[tuple[int, object]]:
    """Return ``run_id``'s journal entries with ``seq > after_seq``, in seq order.

    Sequence numbers start at 1, so ``after_seq=0`` returns the whole journal.

    Raises:
        ValueError: ``run_id`` contains NUL or ``after_seq`` is negative.
    """
    if after_seq < 0:
        raise ValueError(f"after_seq must be >= 0, got {after_seq}")
    return [
        (parse_u64be(key[-8:]), value)
        for key, value in txn.scan(
            "journal",
            prefix=journal_prefix(run_id),
            start=journal_key(run_id, after_seq + 1),
            limit=limit,
        )
    ]


def last_journal_seq_txn(txn: ReadTxn, run_id: Key) -> int:
    """Return the highest journal seq of ``run_id``, or 0 if it has none.

    Raises:
        ValueError: ``run_id`` contains NUL.
    """
    for key, _ in txn.scan_raw("journal", prefix=journal_prefix(run_id), reverse=True, limit=1):
        return parse_u64be(key[-8:])
    return 0
