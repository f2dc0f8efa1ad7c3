"""`Storage`: the async facade over one data directory.

``Storage.open(...)`` is an async context manager that opens the environment,
starts the writer thread, and on exit drains and stops the writer, then closes
the environment last. See ``docs/storage.md`` for the rules in full; in short:

* ``await storage.write(fn, *args)`` runs ``fn(txn, *args)`` on the writer
  thread, batched with concurrent writes, and returns only after the batch
  committed durably (persist before acknowledge).
* ``storage.write_deferred(fn, *args)`` queues a write nobody awaits; it is
  committed with the next batch (at the latest ``deferred_flush_ms`` later,
  or on close).
* ``storage.read(fn, *args)`` runs ``fn(rtxn, *args)`` in a short read
  transaction right here, in the calling thread: LMDB reads take microseconds
  and never wait for the writer (MVCC), so they are fine on the event loop.
  They are `StorageReads` (``_reads.py``), mixed in here.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from functools import partial
from typing import TypeVar, TypeVarTuple, Unpack

import anyio
import sniffio

from stepd.actors import Waiter

from . import _reads
from ._env import REGISTRY, Gate, OpenEnv, check_tables, open_env
from ._errors import StorageClosed
from ._reads import StorageReads
from ._txn import WriteTxn
from ._wal import WalFailed
from ._writer import CallSoon, Request, StorageStatistics, Writer

__all__ = ["DEFAULT_MAP_SIZE", "DEFAULT_MAX_MAP_SIZE", "Storage"]

log = logging.getLogger("stepd.storage")

Ts = TypeVarTuple("Ts")
T = TypeVar("T")

DEFAULT_MAP_SIZE = 64 << 20  # 64 MiB: grows on demand
DEFAULT_MAX_MAP_SIZE = 64 << 30  # 64 GiB: address space, not disk (the file is sparse)


def _current_call_soon() -> tuple[CallSoon, CallSoon]:
    """Return ``(threadsafe, local)`` "run this soon on this event loop" functions.

    Resolved once at open. ``threadsafe`` is how the writer thread wakes the
    loop (once per batch), so it must be the backend's cheapest thread-safe
    entry; ``local`` schedules from the loop thread itself (asyncio's plain
    ``call_soon`` skips the self-pipe write; trio has one entry for both).
    """
    library = sniffio.current_async_library()
    if library == "asyncio":
        import asyncio

        loop = asyncio.get_running_loop()
        return loop.call_soon_threadsafe, loop.call_soon
    if library == "trio":
        import trio

        run_sync_soon = trio.lowlevel.current_trio_token().run_sync_soon
        return run_sync_soon, run_sync_soon
    raise RuntimeError(f"unsupported async library {library!r} (use asyncio or trio)")


class Storage(StorageReads):
    """A durable, transactional key-value store over one LMDB environment.

    Create it with :meth:`Storage.open`; every method raises
    :class:`UsedAfterFork` in a forked child and :class:`StorageClosed` once
    the context has exited.
    """

    def __init__(
        self,
        opened: OpenEnv,
        *,
        tables: tuple[str, ...],
        max_map_size: int,
        max_batch: int,
        deferred_flush_ms: float,
        clock: Callable[[], float],
        on_deferred_error: Callable[[BaseException], object] | None,
        call_soon: CallSoon,
        local_call_soon: CallSoon,
    ) -> None:
        self._opened = opened
        self._env = opened.env
        self._dbs = opened.dbs
        self._tables = tables
        self._pid = os.getpid()
        self._forks = _reads.FORKS
        self._loop_thread = threading.get_ident()
        self._clock = clock
        self._gate = Gate()
        self._closed = False
        self._on_deferred_error = on_deferred_error
        self._fatal: BaseException | None = None
        self._body_scope: anyio.CancelScope | None = None
        self._call_soon = call_soon
        self._local_call_soon = local_call_soon
        self._staged: list[Request] = []
        # Requests submitted and not yet delivered back (committed, or failed):
        # zero means everything written so far is on record (`settled`).
        self._unsettled = 0
        self._unsettled_elsewhere = False
        self._closing = False
        self._writer_done = anyio.Event()
        self._writer_error: BaseException | None = None
        self._writer = Writer(
            env=opened.env,
            dbs=opened.dbs,
            gate=self._gate,
            max_map_size=max_map_size,
            max_batch=max_batch,
            deferred_flush_s=deferred_flush_ms / 1000.0,
            clock=clock,
            call_soon=call_soon,
            deliver=self._deliver,
            wal=opened.wal,
        )
        self._thread = threading.Thread(
            target=self._writer_main,
            name=f"stepd-storage-writer:{opened.path}",
            # The context always joins it. Daemon only matters if the context's
            # exit never runs: then interpreter exit must not hang on it, and
            # stopping it mid-commit is a crash LMDB recovers from.
            daemon=True,
        )

    # -- lifecycle ----------------------------------------------------------

    @classmethod
    @asynccontextmanager
    async def open(
        cls,
        path: str | os.PathLike[str],
        *,
        map_size: int = DEFAULT_MAP_SIZE,
        max_map_size: int = DEFAULT_MAX_MAP_SIZE,
        sync: bool = True,
        extra_tables: Iterable[str] = (),
        deferred_flush_ms: float = 5.0,
        on_deferred_error: Callable[[BaseException], object] | None = None,
        max_batch: int = 1024,
        clock: Callable[[], float] | None = None,
        commit_on_loop: bool = True,
        write_ahead_log: bool = True,
    ) -> AsyncIterator[Storage]:
        """Open the data directory at ``path`` for the duration of the context.

        Args:
            path: the data directory (created if missing).
            map_size: the initial map size in bytes (if the existing data
                needs more, LMDB opens with what it needs). Grows on demand.
            max_map_size: the map never grows beyond this; writes that do not
                fit fail with :class:`StorageFull`.
            sync: fsync every commit (the default, and the only safe setting).
                ``False`` loses acknowledged writes on power loss or OS crash;
                it exists only for benchmark comparison and logs a warning.
            extra_tables: more table names (e.g. ``"idx_runs_by_status"``).
            deferred_flush_ms: the longest a batch holding only deferred writes
                waits for an awaited write to join it.
            on_deferred_error: called on the event loop thread with the error
                of a failed deferred write. By default the error is logged and
                re-raised out of the storage context (whose body is cancelled).
                If the callback itself raises, that error is treated likewise.
            max_batch: the most requests in one write transaction.
            clock: monotonic seconds for the deferred-flush deadline (defaults
                to ``time.monotonic``); the writer still waits in real time.
            commit_on_loop: let a batch run on the event loop's thread while
                the writer thread is idle and commits are quick (the default;
                `Writer.run_inline`, the ``_writer`` module's docstring); the
                `commit_on_loop` attribute changes it later.
            write_ahead_log: with ``sync``, make each commit durable with one
                synced append to the write-ahead log (``_wal``: one device flush)
                and commit LMDB without its own sync (the default); False
                leaves the syncing to LMDB (two flushes a commit).

        Yields:
            The open :class:`Storage`.

        Raises:
            AlreadyOpen: ``path`` is already open in this process.
            SchemaMismatch: the directory holds another schema version.
            StorageFull: the tables do not fit in ``max_map_size``.
            ValueError: a bad size, table name or flush delay.
            lmdb.Error: LMDB could not open the directory.
        """
        if map_size <= 0 or max_map_size < map_size:
            raise ValueError(
                f"need 0 < map_size <= max_map_size, got {map_size} and {max_map_size}"
            )
        if deferred_flush_ms < 0 or max_batch < 1:
            raise ValueError("deferred_flush_ms must be >= 0 and max_batch >= 1")
        tables = check_tables(extra_tables)
        real = os.path.realpath(os.fspath(path))
        call_soon, local_call_soon = _current_call_soon()
        if not sync:
            log.warning(
                "storage at %r opened with sync=False: UNSAFE, acknowledged writes "
                "are lost on power loss or OS crash (use only for benchmarks)",
                real,
            )
        REGISTRY.claim(real)
        try:
            # Shielded: a cancelled open must not leave an opened environment behind.
            with anyio.CancelScope(shield=True):
                opened = await anyio.to_thread.run_sync(
                    partial(
                        open_env, real, tables=tables, map_size=map_size,
                        max_map_size=max_map_size, sync=sync,
                        write_ahead_log=write_ahead_log,
                    )
                )
            try:
                storage = cls(
                    opened,
                    tables=tables,
                    max_map_size=max_map_size,
                    max_batch=max_batch,
                    deferred_flush_ms=deferred_flush_ms,
                    clock=clock or time.monotonic,
                    on_deferred_error=on_deferred_error,
                    call_soon=call_soon,
                    local_call_soon=local_call_soon,
                )
                storage.commit_on_loop = commit_on_loop
                storage._thread.start()
            except BaseException:
                if opened.wal is not None:
                    opened.wal.close()
                opened.env.close()
                raise
            try:
                with anyio.CancelScope() as scope:
                    storage._body_scope = scope
                    yield storage
            finally:
                # Shielded: the writer must drain and the environment close even
                # when the body was cancelled.
                with anyio.CancelScope(shield=True):
                    await storage._shutdown()
            if storage._writer_error is not None:
                raise StorageClosed("the storage writer thread died") from storage._writer_error
            if storage._fatal is not None:
                raise storage._fatal
        finally:
            REGISTRY.release(real)

    async def _shutdown(self) -> None:
        """Drain and stop the writer, join its thread, close the environment last."""
        self._closing = True
        self._flush_staged()
        self._writer.request_stop()
        await self._writer_done.wait()
        self._thread.join()  # returns at once: the thread's last act was to signal
        await anyio.to_thread.run_sync(self._close_env)

    def _close_env(self) -> None:
        with self._gate.exclusive():  # wait out readers in other threads
            self._closed = True
            wal = self._opened.wal
            try:
                if wal is not None:  # a last checkpoint: the next open replays nothing
                    wal.close()
            except WalFailed:
                log.exception("storage at %r: the last checkpoint failed; the next open "
                              "replays the log", self._opened.path)
            finally:
                self._env.close()

    def _writer_main(self) -> None:
        try:
            self._writer.run()
        except BaseException as exc:  # noqa: BLE001 - re-raised by the context's exit
            self._writer_error = exc
            self._call_soon(self._fail_loudly, exc)
        finally:
            self._call_soon(self._writer_done.set)

    def _fail_loudly(self, exc: BaseException) -> None:
        """On the loop thread: remember the first fatal error, cancel the body."""
        if self._fatal is None:
            self._fatal = exc
        if self._body_scope is not None:
            self._body_scope.cancel()

    def _deliver(self, batch: list[Request]) -> None:
        """On the loop thread, once per batch: wake its callers, report deferred errors."""
        self._unsettled -= len(batch)
        for req in batch:
            if req.waiter is not None:
                req.waiter.set()
            elif req.error is not None:
                self._report_deferred_error(req.error)

    def _report_deferred_error(self, exc: BaseException) -> None:
        handler = self._on_deferred_error
        if handler is None:
            log.error("a deferred storage write failed", exc_info=exc)
            self._fail_loudly(exc)
            return
        try:
            handler(exc)
        except Exception as handler_exc:  # must not escape into the loop's callback machinery
            log.error("on_deferred_error raised", exc_info=handler_exc)
            self._fail_loudly(handler_exc)

    # -- writes -------------------------------------------------------------

    async def write(self, fn: Callable[[WriteTxn, Unpack[Ts]], T], *args: *Ts) -> T:
        """Run ``fn(txn, *args)`` in the next batch; return its value once durable.

        The batch runs on the writer thread, or on this (the event loop's)
        thread when the writer is idle and commits are quick (`commit_on_loop`).

        ``fn`` runs inside the next batch's write transaction, in its own nested
        transaction, after every write submitted before it. It must be a pure
        function of ``txn`` and its arguments: it may run more than once (the
        batch is re-run after the map grows) and must not block.

        Cancelling the caller does not cancel the write: once submitted it runs
        and commits; only its outcome is dropped.

        Args:
            fn: the request function; its return value is returned.
            *args: positional arguments for ``fn`` (for keyword arguments,
                use ``functools.partial``).

        Returns:
            ``fn``'s return value, after the transaction that holds it committed.

        Raises:
            Exception: whatever ``fn`` raised (its changes rolled back, its
                batch-mates committed), delivered after the batch's commit.
            CommitFailed: the batch's commit failed; nothing of it is visible.
            StorageFull: the write does not fit even at ``max_map_size``.
            StorageClosed: the storage is closing or closed.
            UsedAfterFork: called in a forked child.
            RuntimeError: called from another thread than the event loop's.
        """
        if _reads.FORKS != self._forks:
            self._check_pid()
        if threading.get_ident() != self._loop_thread:
            raise RuntimeError(
                "await storage.write() from the event loop that opened the storage"
            )
        if self._closing:
            raise StorageClosed("the storage is closed or closing; no more writes")
        event = Waiter()  # one waiter, set on this loop: no anyio.Event machinery
        req = Request(fn, args, event, self._clock())
        # `_submit`'s loop-thread half, spelled out (two writes a step)
        self._unsettled += 1
        staged = self._staged
        staged.append(req)
        if len(staged) == 1:
            self._local_call_soon(self._flush_staged)
        await event.wait()
        if req.error is not None:
            raise req.error
        return req.value  # type: ignore[no-any-return]

    def write_deferred(self, fn: Callable[[WriteTxn, Unpack[Ts]], object], *args: *Ts
                       ) -> Request:
        """Queue ``fn(txn, *args)`` as a write that nobody awaits.

        It is ordered after every write submitted before it and before every
        write submitted after it, and committed with the next batch: at the
        latest together with the next awaited write, or ``deferred_flush_ms``
        after it was queued, or on close. A burst of deferred writes thus costs
        one fsync. Its return value is dropped; its error goes to
        ``on_deferred_error``. The same purity rule as :meth:`write` applies.
        Thread-safe.

        Returns:
            A handle for `withdraw` (nothing else of it is for the caller).

        Raises:
            StorageClosed: the storage is closing or closed.
            UsedAfterFork: called in a forked child.
        """
        if _reads.FORKS != self._forks:  # the guard without a syscall, as `write`'s
            self._check_pid()
        req = Request(fn, args, None, self._clock())
        self._submit(req)
        return req

    def withdraw(self, handle: Request) -> bool:
        """Take back a deferred write (`write_deferred`'s handle) that no batch took yet.

        True: it will never run; the caller owns its content again and must
        write it itself, in a later write (which then holds it in that later
        place in the order: withdraw only what nothing submitted in between
        depends on). False: a batch took it (it committed, or will, in its
        place). A run actor folds its deferred offer into the `complete` that
        follows it this way, one write where there were two (docs/storage.md).
        Loop thread only, as `write` is.
        """
        return self._writer.withdraw(handle)

    def _submit(self, req: Request) -> None:
        """Queue a request for the writer.

        From the loop thread, requests are staged and handed to the writer
        thread once per loop iteration (one callback scheduled by the first
        request staged): everything the loop's tasks submit in one iteration
        becomes one batch, whatever the writer thread and the GIL are doing,
        and the writer is notified once per iteration, not once per request.
        Other threads (``write_deferred`` only) queue directly.
        """
        if self._closing:
            raise StorageClosed("the storage is closed or closing; no more writes")
        if threading.get_ident() != self._loop_thread:
            self._writer.submit([req])
            self._unsettled_elsewhere = True  # counted on no thread: `settled` stays False
            return
        self._unsettled += 1
        self._staged.append(req)
        if len(self._staged) == 1:
            self._local_call_soon(self._flush_staged)

    def _flush_staged(self) -> None:
        """On the loop thread: hand the staged requests to the writer thread, in order."""
        staged, self._staged = self._staged, []
        if not staged:
            return
        try:
            if not self._writer.run_inline(staged):  # idle thread, quick commits: here
                self._writer.submit(staged)
        except StorageClosed as exc:  # the writer died meanwhile: fail them here
            for req in staged:
                req.error = StorageClosed("the storage writer stopped")
                req.error.__cause__ = exc.__cause__
            self._deliver(staged)

    def settled(self) -> bool:
        """True when every write submitted from the event loop so far is on record.

        A reader that must see what was written before it (a run actor loading
        its record after an earlier incarnation's deferred writes) can skip the
        barrier write then. Loop thread only; after a write from another thread
        it is False for good (that thread's writes are not counted).
        """
        return self._unsettled == 0 and not self._unsettled_elsewhere

    # -- introspection -------------------------------------------------------

    @property
    def path(self) -> str:
        """The data directory (real path)."""
        return self._opened.path

    @property
    def tables(self) -> tuple[str, ...]:
        """Every table name: the built-in ones, then the extra ones."""
        return self._tables

    def statistics(self) -> StorageStatistics:
        """Return a snapshot of the writer's counters and the map size."""
        stats = self._writer.statistics()
        if self._staged:
            stats = dataclasses.replace(stats, queued=stats.queued + len(self._staged))
        return stats

    @property
    def commit_on_loop(self) -> bool:
        """Whether a batch may run on the event loop's thread (see `Storage.open`).

        Off for a test that holds the writer inside a request function: on the
        loop, that request would hold the loop instead.
        """
        return self._writer.inline_enabled

    @commit_on_loop.setter
    def commit_on_loop(self, on: bool) -> None:
        self._writer.inline_enabled = bool(on)

    @property
    def writer_thread_id(self) -> int | None:
        """The writer thread's ``threading.get_ident()`` (for tests and debugging)."""
        return self._writer.thread_id

    def _inject_commit_failure(self, exc: BaseException) -> None:
        """Test hook: the next batch to start fails at its commit with ``exc``.

        Not LMDB mocked: the real transaction runs and is then aborted instead
        of committed, exactly as a failed ``mdb_txn_commit`` leaves it.
        """
        self._writer.fail_next_commit(exc)

