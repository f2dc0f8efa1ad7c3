"""How a batch runs, once taken: `Batches`, the writer's half that runs transactions.

`Writer` (``_writer``) owns the queue, the thread and the choice of where a
batch runs (its thread, or the event loop's: `Writer.run_inline`); this half
runs one batch on whichever thread it is given: each request in its nested
transaction, the log's append (``_wal``), the commit, a map growth and its
retry, the split at the maximum map size, and the outcomes. Everything here
holds for both threads, one batch at a time (LMDB's writer lock orders them).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import lmdb

from ._env import Gate
from ._errors import CommitFailed, StorageFull
from ._txn import WriteTxn
from ._wal import Wal, WalFailed

__all__ = ["Batches", "Request"]

log = logging.getLogger("stepd.storage")


class Request:
    """One queued write: ``fn(txn, *args)`` and where its outcome goes."""

    __slots__ = ("args", "deferred", "enqueued_at", "error", "fn", "taken", "value", "waiter",
                 "withdrawn")

    def __init__(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        waiter: Any,  # a stepd.actors.Waiter (awaited) or None (deferred)
        enqueued_at: float,
    ) -> None:
        self.fn = fn
        self.args = args
        self.waiter = waiter
        self.deferred = waiter is None
        self.enqueued_at = enqueued_at
        self.value: Any = None
        self.error: BaseException | None = None
        # A batch took it (set under the writer's queue lock, or on the loop by the
        # batch that runs it there): `Storage.withdraw` can no longer take it back.
        self.taken = False
        self.withdrawn = False  # taken back before any batch took it: runs as a no-op


class _MapFull(Exception):
    """Internal: the batch hit ``MapFullError``."""


class _CommitError(Exception):
    """Internal: the batch's commit raised ``cause``."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(cause)
        self.cause = cause


class Batches:
    """The batch-running half of `Writer` (its base): see the module docstring.

    The attributes below are `Writer`'s, set in its ``__init__``.
    """

    _env: lmdb.Environment
    _dbs: dict[str, lmdb._Database]
    _gate: Gate
    _wal: Wal | None
    _max_map_size: int
    _map_size: int
    _commits: int
    _failed_commits: int
    _failed_requests: int
    _map_growths: int

    def _run_batch(self, batch: list[Request], done: Callable[[list[Request]], None],
                   injected: BaseException | None = None) -> None:
        while True:
            try:
                self._attempt(batch, injected)
            except _MapFull:
                if self._grow():
                    continue  # re-run the whole batch in the bigger map
                if len(batch) > 1:  # at the maximum: let whatever fits commit
                    mid = len(batch) // 2
                    self._run_batch(batch[:mid], done, injected)
                    self._run_batch(batch[mid:], done)
                    return
                self._fail(
                    batch,
                    lambda: StorageFull(
                        f"the write does not fit in max_map_size={self._max_map_size} bytes"
                    ),
                    None,
                    done,
                )
                return
            except _CommitError as exc:
                self._failed_commits += 1
                log.error("storage commit failed: %r", exc.cause)
                self._fail(batch, lambda: CommitFailed("the batch's commit failed"), exc.cause,
                           done)
                return
            self._commits += 1
            for r in batch:
                if r.error is not None:
                    self._failed_requests += 1
            done(batch)
            return

    def _fail(
        self,
        batch: list[Request],
        make: Callable[[], BaseException],
        cause: BaseException | None,
        done: Callable[[list[Request]], None],
    ) -> None:
        for req in batch:
            err = make()  # one exception object per caller: tracebacks are per raise
            err.__cause__ = cause
            req.value = None
            req.error = err
        done(batch)

    def _attempt(self, batch: list[Request], injected: BaseException | None) -> None:
        """One try at a batch: run every request, commit. Outcomes land on the requests.

        Inside the gate (shared), as a reader is: a map growth on the other thread
        (the loop's or the writer's) waits for this batch's transaction to end, and
        no batch slips in between a growth's release of the log's pin and its
        checkpoint (`_grow`).

        Raises:
            _MapFull: the map is full; the batch was aborted.
            _CommitError: the commit failed; the batch was aborted.
        """
        map_full = False

        def on_map_full() -> None:
            nonlocal map_full
            map_full = True

        env = self._env
        wal = self._wal
        gate = self._gate
        gate.enter_shared()
        try:
            txn = env.begin(write=True)
        except BaseException:
            gate.exit_shared()
            raise
        # The batch's writes for the write-ahead log (`_wal`), in order; a request
        # that fails has its own cut off again.
        ops: list[tuple[Any, ...]] | None = None
        finished = False
        try:
            if wal is not None:
                if wal.due:  # under LMDB's writer lock: nothing commits meanwhile
                    try:
                        wal.checkpoint()
                    except WalFailed as exc:
                        raise _CommitError(exc) from exc
                ops = []
            for req in batch:
                req.value = None
                req.error = None
                if req.withdrawn:  # its content rides a later write (`Storage.withdraw`)
                    continue
                child = env.begin(write=True, parent=txn)
                wtxn = WriteTxn(child, self._dbs, on_map_full, ops, env)
                mark = 0 if ops is None else len(ops)
                try:
                    value = req.fn(wtxn, *req.args)
                except Exception as exc:
                    wtxn._txn = None  # `_finish`, spelled out: invalid from here on
                    child.abort()
                    if map_full or isinstance(exc, lmdb.MapFullError):
                        raise _MapFull from exc
                    req.error = exc
                    if ops is not None:
                        del ops[mark:]
                    continue
                wtxn._txn = None
                if map_full:  # the function swallowed a MapFullError
                    child.abort()
                    raise _MapFull
                try:
                    child.commit()
                except lmdb.MapFullError as exc:
                    raise _MapFull from exc
                except lmdb.Error as exc:
                    req.error = exc
                    if ops is not None:
                        del ops[mark:]
                    continue
                req.value = value
            if injected is not None:  # the test hook: fail exactly where a commit can
                raise _CommitError(injected)
            txnid = 0
            if ops:  # durable from here: appended and synced before LMDB commits
                txnid = txn.id()
                try:
                    wal.append(txnid, ops)  # type: ignore[union-attr]  # ops: wal is set
                except WalFailed as exc:
                    raise _CommitError(exc) from exc
            try:
                finished = True  # committed, or freed by the failed commit
                txn.commit()
            except lmdb.MapFullError as exc:
                if txnid:
                    wal.not_committed(txnid)  # type: ignore[union-attr]  # logged: wal is set
                raise _MapFull from exc
            except Exception as exc:
                if txnid:
                    wal.not_committed(txnid)  # type: ignore[union-attr]
                raise _CommitError(exc) from exc
        finally:
            if not finished:
                txn.abort()
            gate.exit_shared()

    def _grow(self) -> bool:
        """Double the map (up to the maximum); False if already at the maximum."""
        current = self._env.info()["map_size"]
        if current >= self._max_map_size:
            return False
        new = min(current * 2, self._max_map_size)
        started = time.monotonic()
        wal = self._wal
        with self._gate.exclusive():  # set_mapsize: no transaction may be open
            if wal is not None:
                wal.unpin()  # the pin too; `checkpoint_locked` below takes it again
            self._env.set_mapsize(new)
            if wal is not None:
                wal.checkpoint_locked()
        self._map_size = self._env.info()["map_size"]
        self._map_growths += 1
        log.info(
            "storage map grown from %d to %d bytes in %.1f ms",
            current, self._map_size, (time.monotonic() - started) * 1000,
        )
        return True
