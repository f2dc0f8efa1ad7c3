"""The read side of `Storage`: short read transactions in the calling thread.

LMDB reads take microseconds and never wait for the writer (MVCC), so they
run right here, on the event loop, with no hand-off: ``storage.read(fn,
*args)`` runs ``fn(rtxn, *args)`` and ``get``, ``scan`` and ``journal`` are
that for one table. Mixed into `Storage`, which opens the environment and
owns the writer; what is here needs only the environment, the gate that
keeps a map resize and the close out of a read, and the fork guard.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import partial
from typing import TypeVar, TypeVarTuple, Unpack

import lmdb

from ._env import Gate
from ._errors import StorageClosed, UsedAfterFork
from ._keys import Key
from ._txn import ReadTxn, journal_txn

__all__ = ["StorageReads"]

Ts = TypeVarTuple("Ts")
T = TypeVar("T")

_new = object.__new__

#: How many times this process is a fork child of one that imported this module:
#: bumped in the child (``os.register_at_fork``), so a storage opened before the
#: fork sees another count than its own. A global read per operation instead of an
#: ``os.getpid()`` call (two writes a step on the event loop).
FORKS = 0


def _forked() -> None:
    global FORKS
    FORKS += 1


os.register_at_fork(after_in_child=_forked)


class StorageReads:
    """Reads of one open environment (the read half of `Storage`).

    Attributes (set by `Storage`):
        _env: the LMDB environment.
        _dbs: its tables' handles, by name.
        _gate: held shared by a read, exclusively by a map resize and the close.
        _closed: the environment is closed.
        _pid: the process that opened it (a forked child may not use it).
        _forks: `FORKS` when it was opened (the same guard without a call).
    """

    _env: lmdb.Environment
    _dbs: dict[str, lmdb._Database]
    _gate: Gate
    _closed: bool
    _pid: int

    _forks: int  # `FORKS` when it was opened

    def _check_pid(self) -> None:
        """The fork guard every entry point runs first, reads and writes alike."""
        if FORKS != self._forks or os.getpid() != self._pid:
            raise UsedAfterFork(
                f"this storage was opened by process {self._pid}; it cannot be used in "
                f"process {os.getpid()} (a fork child): open it anew there"
            )

    def read(self, fn: Callable[[ReadTxn, Unpack[Ts]], T], *args: *Ts) -> T:
        """Run ``fn(rtxn, *args)`` in a short read transaction in this thread.

        Sees the last committed state, never part of a batch (LMDB MVCC), and
        never waits for the writer, except for the rare map growth (the map
        is resized while no read transaction is open; a resize takes well under
        a millisecond). Keep ``fn`` short: a long read pins old pages and
        delays map growth. Its return value must not be a lazy iterator over
        the txn (``list(...)`` it).

        Raises:
            StorageClosed: the storage is closed.
            UsedAfterFork: called in a forked child.
            UnknownTable: ``fn`` named an undeclared table.
        """
        if FORKS != self._forks:
            self._check_pid()
        gate = self._gate  # `with gate.shared():`, spelled out: ~10 calls fewer a read
        gate.enter_shared()
        try:
            if self._closed:
                raise StorageClosed("the storage is closed")
            txn = self._env.begin(write=False)
            rtxn = _new(ReadTxn)  # `ReadTxn(txn, dbs)` without its Python `__init__`
            rtxn._txn = txn
            rtxn._dbs = self._dbs
            try:
                return fn(rtxn, *args)
            finally:
                rtxn._txn = None  # `_finish()`: invalid once `fn` returned
                txn.abort()
        finally:
            gate.exit_shared()

    def get(self, table: str, key: Key) -> object | None:
        """Return the decoded value under ``key`` in ``table``, or ``None``.

        Raises:
            StorageClosed, UsedAfterFork, UnknownTable: see :meth:`read`.
        """
        return self.read(ReadTxn.get, table, key)

    def get_raw(self, table: str, key: Key) -> bytes | None:
        """Return the raw bytes under ``key`` in ``table``, or ``None``.

        Raises:
            StorageClosed, UsedAfterFork, UnknownTable: see :meth:`read`.
        """
        return self.read(ReadTxn.get_raw, table, key)

    def scan(
        self,
        table: str,
        *,
        prefix: Key = b"",
        start: Key | None = None,
        stop: Key | None = None,
        reverse: bool = False,
        limit: int | None = None,
    ) -> list[tuple[bytes, object]]:
        """Return ``(key, value)`` pairs of a key range; see :meth:`ReadTxn.scan`.

        Raises:
            StorageClosed, UsedAfterFork, UnknownTable: see :meth:`read`.
            ValueError: ``limit`` is negative.
        """

        def scan_txn(txn: ReadTxn) -> list[tuple[bytes, object]]:
            return list(
                txn.scan(
                    table, prefix=prefix, start=start, stop=stop, reverse=reverse, limit=limit
                )
            )

        return self.read(scan_txn)

    def journal(
        self, run_id: Key, after_seq: int = 0, limit: int | None = None
    ) -> list[tuple[int, object]]:
        """Return ``run_id``'s journal entries with ``seq > after_seq``, in order.

        Raises:
            StorageClosed, UsedAfterFork: see :meth:`read`.
            ValueError: ``run_id`` contains NUL or ``after_seq`` is negative.
        """
        return self.read(partial(journal_txn, run_id=run_id, after_seq=after_seq, limit=limit))
