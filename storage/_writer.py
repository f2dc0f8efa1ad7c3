"""The group-commit writer: one thread, one write transaction per batch.

Why one dedicated thread: LMDB write transactions must begin, run and commit
on one thread (its writer mutex belongs to the thread that took it), and a
synced commit costs ~0.2 ms (p99 ~7 ms here), which must never stall the event
loop. So every write transaction of a storage runs on its writer thread, which
lives exactly as long as the storage context (started and joined by it).

How a batch runs:

1. The thread takes everything queued when it becomes free (up to
   ``max_batch`` requests), so batches grow with load by themselves. If only
   deferred requests are queued, it first waits up to ``deferred_flush_s``
   for an awaited one to join them.
2. It begins one write transaction and runs each request's function, in
   submission order, inside its own nested transaction: a request that raises
   is rolled back alone and its batch-mates still commit.
3. It commits once (durable when ``sync`` is on: by default the batch's writes
   are first appended to the write-ahead log and synced, `_wal`, and LMDB
   then commits without its own sync), then resolves the whole batch with ONE
   callback on the event loop thread.

On the event loop, when the thread is idle: a batch that someone awaits,
submitted while the writer thread sleeps (nothing queued, or only deferred
writes, which join it first), runs on the event loop's own thread instead
(`Writer.run_inline`), in the same transaction-per-batch way. Handing a batch
to the thread and its outcome back costs two OS wake-ups (~0.1-0.2 ms each on a loaded 2-vCPU machine) on a
commit that itself takes ~0.3-0.5 ms; at light load that hop was a sixth of a
sequential step. The loop then waits for the commit's fsync (the GIL is
released meanwhile), so this happens only while commits are quick: not while
the moving average of the last commits exceeds ``INLINE_MAX_COMMIT_S``, not
for ``INLINE_BACKOFF_S`` after a commit slower than ``INLINE_SLOW_S``, never
for a batch of more than ``INLINE_MAX_BATCH`` requests, and never while the
thread has work (under load every batch goes to the thread, which keeps
batching) or checkpoints the log (`Writer._idle`). ``Storage.commit_on_loop =
False`` turns it off (a test that holds the writer inside a request needs the
thread).

Outcomes are delivered only after the commit (or its failure), including a
request's own exception: an answer may depend on state a batch-mate wrote,
which must be durable before anyone acts on it. If the commit fails, every
caller gets :class:`CommitFailed` and nothing of the batch is visible.

Map growth: ``MapFullError`` (at a put, or at commit) aborts the batch; the
thread doubles the map (up to ``max_map_size``) while no read transaction is
open (the :class:`~._env.Gate`) and re-runs the whole batch. Request functions
therefore must be pure functions of the transaction (and their arguments): no
side effects outside it, since they may run more than once. At the maximum, a
batch of several requests is split in halves and retried, so only the requests
that really do not fit get :class:`StorageFull`.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import lmdb

from ._batch import Batches, Request
from ._env import Gate
from ._errors import CommitFailed, StorageClosed
from ._wal import Wal

__all__ = ["Request", "StorageStatistics", "Writer"]

log = logging.getLogger("stepd.storage")

#: A thread-safe "call soon on the event loop thread" (``fn, *args``).
CallSoon = Callable[..., object]

#: `Writer.run_inline` runs a batch on the loop only while the moving average of
#: the last commits' durations (the batch's functions and the fsync) is below this...
INLINE_MAX_COMMIT_S = 0.002
#: ...and not for `INLINE_BACKOFF_S` after one commit slower than this (a disk that
#: stalls must not stall the loop twice in a row).
INLINE_SLOW_S = 0.02
INLINE_BACKOFF_S = 5.0
#: The most requests of a batch run on the loop (a bigger one goes to the thread).
INLINE_MAX_BATCH = 64

_monotonic = time.monotonic


@dataclass(frozen=True, slots=True)
class StorageStatistics:
    """A snapshot of the storage's counters (for tests, ``/metrics`` and the API).

    Attributes:
        requests: requests executed (awaited and deferred; a re-run counts once).
        deferred_requests: of which deferred.
        failed_requests: requests whose function raised (rolled back alone).
        batches: batches taken off the queue.
        commits: successful commits (one per batch, unless it failed or split).
        failed_commits: commits that failed (every caller got ``CommitFailed``).
        map_growths: times the map was grown on ``MapFullError``.
        max_batch_size: the largest batch run, in requests.
        batch_sizes: how many batches had each size, bucketed by powers of two:
            ``batch_sizes[i]`` counts batches of size in ``(2**(i-1), 2**i]``
            (index 0: size 1), for a histogram of commit batch sizes.
        queued: requests waiting for the writer at the time of the snapshot.
        map_size: the current map size in bytes.
        max_map_size: the configured maximum map size in bytes.
        inline_batches: of ``batches``, those run on the event loop's thread
            (`Writer.run_inline`).
        log_appends: batches appended to the write-ahead log (one synced write
            each; `_wal`), aborted ones' markers included.
        checkpoints: checkpoints of the write-ahead log (each syncs LMDB's file).
    """

    requests: int
    deferred_requests: int
    failed_requests: int
    batches: int
    commits: int
    failed_commits: int
    map_growths: int
    max_batch_size: int
    batch_sizes: tuple[int, ...]
    queued: int
    map_size: int
    max_map_size: int
    inline_batches: int = 0
    log_appends: int = 0
    checkpoints: int = 0


class Writer(Batches):
    """The writer thread's state and loop; see the module docstring.

    ``run`` is the thread's target. Everything else is called from other
    threads (the event loop's, mostly) and only touches the queue under its
    lock (``_mutex``), or reads counters.
    """

    def __init__(
        self,
        *,
        env: lmdb.Environment,
        dbs: dict[str, lmdb._Database],
        gate: Gate,
        max_map_size: int,
        max_batch: int,
        deferred_flush_s: float,
        clock: Callable[[], float],
        call_soon: CallSoon,
        deliver: Callable[[list[Request]], None],
        inline: bool = True,
        wal: Wal | None = None,
    ) -> None:
        self._env = env
        self._wal = wal
        self._dbs = dbs
        self._gate = gate
        self._max_map_size = max_map_size
        self._max_batch = max_batch
        self._flush_s = deferred_flush_s
        self._clock = clock
        self._call_soon = call_soon
        self._deliver = deliver
        # The queue's lock, and the writer's wake-up: a plain lock it blocks on
        # (held = no wake-up pending), released by whoever queues work while it
        # sleeps. Not a `threading.Condition`: its notify and context manager are
        # ~8 Python calls per batch on the event loop (see `_take`).
        self._mutex = threading.Lock()
        self._wake = threading.Lock()
        self._wake.acquire()
        self._sleeping = False  # the writer blocks (or is about to) on `_wake`
        # The thread holds no batch: asleep, about to be, just woken, or keeping the
        # log (`Wal.maintain`). `run_inline` asks this, not `_sleeping`: a thread
        # woken only for upkeep may need the GIL for milliseconds (the loop holds
        # it) before it sleeps again, and the loop's batches need not wait for that.
        self._idle = False
        self._preflush = False  # `run_inline` asks the thread for `Wal.maintain`
        self._queue: collections.deque[Request] = collections.deque()
        self._awaited_queued = 0
        self._stopping = False
        self._dead: BaseException | None = None
        self._fail_next_commit: BaseException | None = None
        self.thread_id: int | None = None
        # counters: written by the writer thread only
        self._requests = 0
        self._deferred_requests = 0
        self._failed_requests = 0
        self._batches = 0
        self._commits = 0
        self._failed_commits = 0
        self._map_growths = 0
        self._max_batch_size = 0
        self._taken_deferred = 0  # of the batch `_take` returned last
        self._batch_sizes = [0] * 12  # sizes up to 2**11 = 2048 > max_batch
        self._map_size = env.info()["map_size"]
        # Batches on the loop (`run_inline`): allowed at all, how many ran, and
        # the commit times that decide (written by whichever thread ran the last
        # batch; only one runs at a time).
        self.inline_enabled = inline
        self._inline_batches = 0
        self._commit_avg = 0.0
        self._slow_until = 0.0

    # -- called from other threads ---------------------------------------

    def submit(self, requests: list[Request]) -> None:
        """Queue requests, in order, after every request queued before them.

        Raises:
            StorageClosed: the storage is closing or its writer has stopped
                (then none of ``requests`` is queued).
        """
        with self._mutex:
            if self._dead is not None:
                raise StorageClosed("the storage writer thread died") from self._dead
            if self._stopping:
                raise StorageClosed("the storage is closed or closing; no more writes")
            self._queue.extend(requests)
            for r in requests:
                if not r.deferred:
                    self._awaited_queued += 1
            if self._sleeping:
                self._sleeping = False
                self._wake.release()

    def request_stop(self) -> None:
        """Refuse new requests; the thread drains the queue, commits, and exits."""
        with self._mutex:
            self._stopping = True
            if self._sleeping:
                self._sleeping = False
                self._wake.release()

    def withdraw(self, req: Request) -> bool:
        """Take back `req` if no batch took it yet (see `Storage.withdraw`)."""
        if req.taken:  # once taken it stays taken: no lock needed to say no
            return False
        with self._mutex:
            if req.taken:
                return False
            req.withdrawn = True
            return True

    def fail_next_commit(self, exc: BaseException) -> None:
        """Test hook: the next batch to start fails at its commit with ``exc``.

        The batch runs for real and is aborted instead of committed, which is
        what a failed ``mdb_txn_commit`` leaves behind.
        """
        with self._mutex:
            self._fail_next_commit = exc

    def statistics(self) -> StorageStatistics:
        with self._mutex:
            queued = len(self._queue)
        return StorageStatistics(
            requests=self._requests,
            deferred_requests=self._deferred_requests,
            failed_requests=self._failed_requests,
            batches=self._batches,
            commits=self._commits,
            failed_commits=self._failed_commits,
            map_growths=self._map_growths,
            max_batch_size=self._max_batch_size,
            batch_sizes=tuple(self._batch_sizes),
            queued=queued,
            map_size=self._map_size,
            max_map_size=self._max_map_size,
            inline_batches=self._inline_batches,
            log_appends=0 if self._wal is None else self._wal.appends,
            checkpoints=0 if self._wal is None else self._wal.checkpoints,
        )

    def run_inline(self, requests: list[Request]) -> bool:
        """Run `requests` as one batch on the calling (the event loop's) thread, now.

        Only when the writer thread sleeps (nothing queued, or only deferred
        writes waiting for company, which join this batch ahead of `requests`)
        and commits are quick (module docstring); otherwise return False and
        run nothing: the caller `submit`s them. Outcomes are delivered by the
        `deliver` the writer was made with, called here, before this returns.

        The thread's wake-up protocol is left as it is: a write another thread
        queues meanwhile wakes it as usual, and its transaction waits for this
        one's commit on LMDB's own writer lock, so it commits after it.
        """
        n = len(requests)
        if not self.inline_enabled or n > INLINE_MAX_BATCH:
            return False
        if self._commit_avg > INLINE_MAX_COMMIT_S or (
                self._slow_until and _monotonic() < self._slow_until):
            return False
        deferred = 0
        for r in requests:
            deferred += r.deferred
        if deferred == n:  # only deferred writes: they wait for company anyway
            return False
        with self._mutex:
            queue = self._queue
            if (not self._idle or self._awaited_queued or self._dead is not None
                    or self._stopping or self._fail_next_commit is not None):
                return False
            if queue:  # deferred writes the sleeping thread keeps for company: theirs first
                if len(queue) + n > INLINE_MAX_BATCH:
                    return False
                deferred += len(queue)
                requests = [*queue, *requests]
                queue.clear()
        for r in requests:  # on the loop, as `Storage.withdraw` is: no lock needed
            r.taken = True
        self._inline_batches += 1
        try:
            self._execute(requests, self._deliver, deferred)
        except Exception as exc:  # a bug in the batch's machinery: fail this batch alone
            log.exception("a storage batch on the event loop failed")
            self._fail(requests, lambda: CommitFailed("the batch's commit failed"), exc,
                       self._deliver)
        wal = self._wal
        if wal is not None and (wal.preflush_due or wal.due):  # the sleeping thread's job
            wal.preflush_asked()
            with self._mutex:
                self._preflush = True
                if self._sleeping:
                    self._sleeping = False
                    self._wake.release()
        return True

    # -- the thread -------------------------------------------------------

    def run(self) -> None:
        """The writer thread's body: take batches until stopped and drained."""
        self.thread_id = threading.get_ident()
        batch: list[Request] = []
        try:
            while True:
                batch = self._take()
                if not batch:
                    return
                outcomes: list[list[Request]] = []
                self._execute(batch, outcomes.append, self._taken_deferred)
                batch = []
                with self._mutex:
                    if not self._queue:  # idle before the outcomes go: the loop's next
                        self._idle = True  # batch, made by them, may run on the loop
                for done in outcomes:
                    self._call_soon(self._deliver, done)
        except BaseException as exc:  # a bug: fail every waiter, then propagate
            log.critical("storage writer thread died", exc_info=True)
            with self._mutex:
                self._dead = exc
                pending = batch + list(self._queue)
                self._queue.clear()
                self._awaited_queued = 0
            for req in pending:
                req.value = None
                req.error = StorageClosed("the storage writer thread died")
                req.error.__cause__ = exc
            if pending:
                self._call_soon(self._deliver, pending)
            raise

    def _take(self) -> list[Request]:
        """Wait for work; return the next batch, or ``[]`` once stopped and drained.

        The wake-up protocol: under ``_mutex`` the writer finds nothing to take
        and sets ``_sleeping``, then blocks on ``_wake``; a submitter that finds
        ``_sleeping`` set clears it and releases ``_wake``, under ``_mutex``, so
        there is at most one release per sleep and it is consumed by that sleep
        (by the acquire, or below when the acquire timed out just before it).
        """
        mutex = self._mutex
        wake = self._wake
        while True:
            timeout = -1.0  # until woken
            with mutex:
                queue = self._queue
                if queue:
                    if self._awaited_queued or self._stopping:
                        return self._pop_batch()
                    # Only deferred writes: give an awaited one a chance to join
                    # them, but no longer than the flush delay of the oldest.
                    timeout = queue[0].enqueued_at + self._flush_s - self._clock()
                    if timeout <= 0:
                        return self._pop_batch()
                    timeout = min(timeout, threading.TIMEOUT_MAX)
                elif self._stopping:
                    return []
                self._sleeping = True
                preflush, self._preflush = self._preflush, False
                # Not idle for a checkpoint: it holds LMDB's writer lock for a sync
                # of LMDB's file (1-2 ms), which a batch on the loop would wait out
                # blocking the loop; the thread runs that batch after it instead.
                self._idle = not (preflush and self._wal.due)  # type: ignore[union-attr]
            if preflush:
                # Counted as asleep meanwhile, and as idle unless it checkpoints
                # (above): then settle the wake-up protocol as after a timed-out sleep.
                self._wal.maintain(self._gate)  # type: ignore[union-attr]  # asked with a log only
                with mutex:
                    if self._sleeping:
                        self._sleeping = False
                    else:
                        wake.acquire(blocking=False)
                continue
            if not wake.acquire(timeout=timeout):
                with mutex:
                    if self._sleeping:  # nobody woke it
                        self._sleeping = False
                    else:  # woken right after the timeout: consume that release
                        wake.acquire(blocking=False)

    def _pop_batch(self) -> list[Request]:
        """Under ``_mutex``: take up to ``max_batch`` queued requests."""
        self._idle = False
        queue = self._queue
        if len(queue) <= self._max_batch:  # the usual case: take it all
            batch = list(queue)
            queue.clear()
        else:
            batch = [queue.popleft() for _ in range(self._max_batch)]
        deferred = 0
        for r in batch:
            deferred += r.deferred
            r.taken = True  # under the lock `Storage.withdraw` takes
        self._awaited_queued -= len(batch) - deferred
        self._taken_deferred = deferred
        return batch

    def _execute(self, batch: list[Request], done: Callable[[list[Request]], None],
                 deferred: int) -> None:
        """Run one batch (`deferred` of it deferred) to its end, commit or failure;
        `done` delivers its outcomes."""
        n = len(batch)
        self._batches += 1
        if n > self._max_batch_size:  # noqa: PLR1730 - `max` is a call a batch
            self._max_batch_size = n
        self._batch_sizes[(n - 1).bit_length()] += 1
        self._requests += n
        self._deferred_requests += deferred
        with self._mutex:
            injected, self._fail_next_commit = self._fail_next_commit, None
        started = _monotonic()
        self._run_batch(batch, done, injected)
        took = _monotonic() - started
        self._commit_avg += (took - self._commit_avg) * 0.25
        if took > INLINE_SLOW_S:
            self._slow_until = started + took + INLINE_BACKOFF_S
