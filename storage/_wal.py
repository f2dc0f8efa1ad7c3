"""The write-ahead log: one synced append per batch instead of LMDB's two flushes.

Why. A synced LMDB commit flushes the device twice: ``fdatasync`` of the data
pages, then the meta page on its ``O_DSYNC`` descriptor (the meta must not
reach the disk before the pages it points to). Measured here (``bench/README.md``
"A write-ahead log in front of LMDB"): ~0.30 ms for a step's commit, against
~0.10 ms for appending the same bytes to a preallocated file and one
``fdatasync``, and ~0.02 ms for LMDB's commit without any sync. A sequential
step waits for one commit, so the difference is a quarter of its time.

How. The environment is opened without sync (``MDB_NOSYNC``). For each batch
the writer appends the batch's writes (every ``put`` and ``delete`` of the
requests that succeeded, as LMDB keys and encoded values) to this log, syncs
it, and only then commits the LMDB transaction; outcomes are delivered after
both, as before. Readers see a batch only once it is durable.

A checkpoint (`Wal.checkpoint`, every `CHECKPOINT_COMMITS` commits or
`CHECKPOINT_BYTES` of records) syncs the LMDB file and records, in the log's
header, a copy of LMDB's two meta pages as they are on disk then; the log
starts again after it. Between checkpoints LMDB's own files may be torn by a
power cut (without sync, a meta page can reach the disk before its pages, and
freed pages are reused), but never the pages of the checkpoint's snapshot: a
read transaction on that snapshot is held open (the *pin*) until the next
checkpoint, and LMDB does not reuse a page any open reader can see.

Recovery (`recover_files`, before LMDB opens the directory): when the log holds
batches after its checkpoint, the checkpoint's meta pages are written back over
LMDB's (the snapshot they describe is intact, as above), and the batches are
applied again, in order, each in its own synced transaction (`replay`). After
a SIGKILL the LMDB files were whole anyway; writing the meta pages back and
replaying gives the same state. A record cut short by the crash fails its
checksum and ends the log: its batch was never acknowledged.

Layout of the file ``wal`` in the data directory: two header slots (the
checkpoint written alternately into slot ``gen % 2``, each with a CRC, so a
torn header write leaves the other), then the log region, preallocated with
zeros so that an append changes no file size (one device flush per
``fdatasync``). A record is ``u32 length, u32 crc32, u64 gen`` and a msgpack
body ``[txnid, kind, ops]``; a record of an older generation (left from before
the last checkpoint) ends the log.
"""

from __future__ import annotations

import fcntl
import logging
import os
import struct
import zlib
from dataclasses import dataclass
from typing import Any, Protocol

import lmdb
import msgpack  # type: ignore[import-untyped]  # no stubs published

from ._errors import StorageError, StorageFull


class Gate(Protocol):
    """What `Wal.maintain` needs of `_env.Gate` (not imported: `_env` imports this)."""

    def enter_shared(self) -> None: ...

    def exit_shared(self) -> None: ...

__all__ = ["WAL_FILE", "Wal", "WalCorrupt", "WalFailed", "lock", "recover_files", "replay"]

log = logging.getLogger("stepd.storage")

WAL_FILE = "wal"
DATA_FILE = "data.mdb"

#: A checkpoint after this many commits since the last one...
CHECKPOINT_COMMITS = 1024
#: ...or this many bytes of records (their own length: each also starts on a page
#: of its own, so the log file holds at most ``CHECKPOINT_COMMITS`` pages more).
#: The bytes bound how many pages LMDB cannot reuse while the pin holds the last
#: checkpoint's snapshot (the file grows by about that many pages' worth before
#: the next checkpoint frees them); the commits bound the log a restart replays.
CHECKPOINT_BYTES = 256 << 10
#: Halfway to a checkpoint (in commits or bytes) the writer thread syncs LMDB's
#: file on its own (`Wal.preflush`, no lock held): the checkpoint's sync, under
#: LMDB's writer lock and in some step's way, then has only half an interval's
#: pages to write. Once an interval: every sync of LMDB's file is one more device
#: flush beside the log's, which the steps' commits wait behind.
PREFLUSH_FRACTION = 2
#: The log region's preallocated size (zeros written and synced at creation).
LOG_BYTES = 2 << 20

_MAGIC = b"stepdwal"
_VERSION = 1
_SLOT_HEAD = struct.Struct("<8sIQQII")  # magic, version, gen, txnid, page size, metas' length
_REC_HEAD = struct.Struct("<IIQ")  # body length, crc32 (gen bytes + body), gen
_REC_HEAD_SIZE = _REC_HEAD.size
_GEN = struct.Struct("<Q")

_BATCH = 0
_ABORT = 1

#: One write of a batch: ``(0, table, key, value, overwrite)`` or ``(1, table, key)``.
Op = tuple[Any, ...]
PUT = 0
DELETE = 1


class WalFailed(StorageError):
    """The write-ahead log could not be written or synced: the storage takes no more writes.

    After a failed ``fdatasync`` what reached the disk is unknown, so no later
    batch is allowed to build on it; the process must restart (recovery then
    decides from what the disk holds).
    """


class WalCorrupt(StorageError):
    """The log's records do not follow LMDB's transactions (a bug, or a foreign file)."""


@dataclass(frozen=True, slots=True)
class Checkpoint:
    gen: int
    txnid: int
    page_size: int
    metas: bytes


def _slot_size(page_size: int) -> int:
    need = _SLOT_HEAD.size + 2 * page_size + 4
    return (need + 4095) // 4096 * 4096


def _read_slot(fd: int, offset: int, size: int) -> Checkpoint | None:
    raw = os.pread(fd, size, offset)
    if len(raw) < _SLOT_HEAD.size:
        return None
    magic, version, gen, txnid, page_size, n = _SLOT_HEAD.unpack_from(raw)
    if magic != _MAGIC or version != _VERSION or _SLOT_HEAD.size + n + 4 > len(raw):
        return None
    body = raw[: _SLOT_HEAD.size + n]
    (crc,) = struct.unpack_from("<I", raw, _SLOT_HEAD.size + n)
    if zlib.crc32(body) != crc:
        return None
    return Checkpoint(gen, txnid, page_size, raw[_SLOT_HEAD.size: _SLOT_HEAD.size + n])


def _read_checkpoint(fd: int) -> tuple[Checkpoint | None, int]:
    """The newest valid header slot, and where the log region starts."""
    # The slot size depends on the page size it records: read slot 0 at the
    # smallest size first, then at its own.
    first = _read_slot(fd, 0, 64 << 10)
    page_size = first.page_size if first is not None else os.sysconf("SC_PAGE_SIZE")
    size = _slot_size(page_size)
    slots = [_read_slot(fd, 0, size), _read_slot(fd, size, size)]
    valid = [s for s in slots if s is not None]
    best = max(valid, key=lambda s: s.gen) if valid else None
    return best, 2 * size


def _records(fd: int, start: int, gen: int) -> tuple[list[tuple[int, list[Op]]], int]:
    """The batches logged after the checkpoint of ``gen`` (aborts applied), and the log's end."""
    size = os.fstat(fd).st_size
    offset = start
    batches: list[tuple[int, list[Op]]] = []
    while offset + _REC_HEAD.size <= size:
        head = os.pread(fd, _REC_HEAD.size, offset)
        n, crc, rec_gen = _REC_HEAD.unpack(head)
        if n == 0 or rec_gen != gen or offset + _REC_HEAD.size + n > size:
            break
        body = os.pread(fd, n, offset + _REC_HEAD.size)
        if zlib.crc32(body, zlib.crc32(_GEN.pack(gen))) != crc:
            break  # cut short by the crash: never acknowledged
        txnid, kind, ops = msgpack.unpackb(body, raw=False, use_list=True)
        if kind == _ABORT:
            if batches and batches[-1][0] == txnid:
                batches.pop()
        else:
            batches.append((txnid, [tuple(op) for op in ops]))
        offset += (_REC_HEAD.size + n + 4095) // 4096 * 4096
    return batches, offset


@dataclass(slots=True)
class Pending:
    """What `recover_files` found: the checkpoint and the batches to apply again."""

    checkpoint: Checkpoint
    batches: list[tuple[int, list[Op]]]


def lock(path: str) -> int:
    """Open (creating it empty) the log of the data directory ``path`` and lock it
    for this process; return its descriptor. First, before anything reads it:
    recovery must never run on files another process is writing.

    Raises:
        StorageError: another process holds the lock (names the file).
    """
    wal_path = os.path.join(path, WAL_FILE)
    fd = os.open(wal_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        raise StorageError(f"{wal_path} is locked by another process: the data directory "
                           "is open elsewhere") from exc
    return fd


def recover_files(path: str, fd: int) -> Pending | None:
    """Before LMDB opens ``path``: put back the checkpoint's meta pages if the log
    (open and locked as ``fd``) holds batches after it; return them for `replay`
    (None: nothing to do).

    No valid header slot at all happens only when the very first checkpoint
    did not reach the disk; no batch was logged before it, so there is nothing
    to recover (a later checkpoint writes one slot and leaves the other whole).
    """
    data_path = os.path.join(path, DATA_FILE)
    checkpoint, start = _read_checkpoint(fd)
    if checkpoint is None:
        return None
    batches, _end = _records(fd, start, checkpoint.gen)
    if not batches:
        return None
    if not os.path.exists(data_path):
        raise WalCorrupt(f"{path}: the write-ahead log holds {len(batches)} batches, but "
                         f"LMDB's {DATA_FILE} is missing")
    dfd = os.open(data_path, os.O_WRONLY)
    try:
        os.pwrite(dfd, checkpoint.metas, 0)
        os.fsync(dfd)
    finally:
        os.close(dfd)
    log.warning("storage at %r: applying %d batches from the write-ahead log after "
                "checkpoint %d (the last run did not close it)", path, len(batches),
                checkpoint.txnid)
    return Pending(checkpoint, batches)


def replay(env: lmdb.Environment, dbs: dict[str, Any], pending: Pending,
           max_map_size: int) -> None:
    """Apply the logged batches again, each in its own transaction, in order.

    ``env`` must be open with sync on: each replayed batch is durable at once.
    The map grows as the writer's does (the checkpoint's meta may record a map
    smaller than the batches after it needed).

    Raises:
        WalCorrupt: LMDB is not at the checkpoint's transaction, or a batch
            names a table that does not exist.
        StorageFull: a batch does not fit even at ``max_map_size``.
    """
    last = env.info()["last_txnid"]
    if last != pending.checkpoint.txnid:
        raise WalCorrupt(f"LMDB is at transaction {last} after restoring checkpoint "
                         f"{pending.checkpoint.txnid}")
    for txnid, ops in pending.batches:
        while True:
            try:
                with env.begin(write=True) as txn:
                    if txn.id() != txnid:
                        raise WalCorrupt(f"the log's batch {txnid} does not follow "
                                         f"transaction {txn.id() - 1}")
                    _apply(txn, dbs, ops)
                break
            except lmdb.MapFullError as exc:
                current = env.info()["map_size"]
                if current >= max_map_size:
                    raise StorageFull(f"the log's batch {txnid} does not fit in "
                                      f"max_map_size={max_map_size}") from exc
                env.set_mapsize(min(current * 2, max_map_size))


def _apply(txn: lmdb.Transaction[bytes], dbs: dict[str, Any], ops: list[Op]) -> None:
    for op in ops:
        db = dbs.get(op[1])
        if db is None:
            raise WalCorrupt(f"the log writes to table {op[1]!r}, which is not open")
        if op[0] == PUT:
            txn.put(op[2], op[3], overwrite=op[4], db=db)
        else:
            txn.delete(op[2], db=db)


class Wal:
    """The open log of one environment; its methods run under LMDB's writer lock
    (inside the writer's write transaction), so one batch at a time touches it."""

    def __init__(self, path: str, env: lmdb.Environment, fd: int) -> None:
        """Take over the log ``fd`` (`lock`ed, recovered) and start it at a checkpoint."""
        self._env = env
        self._path = os.path.join(path, WAL_FILE)
        self._data_fd = os.open(os.path.join(path, DATA_FILE), os.O_RDONLY)
        self._page_size = env.stat()["psize"]
        self._fd = fd
        self._pin: lmdb.Transaction[bytes] | None = None
        self.broken: BaseException | None = None
        try:
            self._start_log(path)
        except BaseException:
            self.unpin()
            os.close(self._data_fd)
            raise

    def _start_log(self, path: str) -> None:
        checkpoint, _ = _read_checkpoint(self._fd)
        self._start = 2 * _slot_size(self._page_size)
        self._gen = checkpoint.gen if checkpoint is not None else 0
        self._size = os.fstat(self._fd).st_size
        if self._size < self._start + LOG_BYTES:
            self._extend(self._start + LOG_BYTES)
        self._offset = self._start
        self._commits = 0
        self._logged = 0  # bytes of records since the checkpoint (`CHECKPOINT_BYTES`)
        self._preflushed = False
        self._packer = msgpack.Packer(use_bin_type=True, autoreset=True)
        #: A checkpoint is due (the writer checks at a batch's start), or a
        #: `preflush` (halfway to the checkpoint); set by `append`.
        self.due = self.preflush_due = False
        self.checkpoints = 0
        self.appends = 0
        self.checkpoint()
        if checkpoint is None:  # a new file: its directory entry must be durable too
            dfd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)

    def not_committed(self, txnid: int) -> None:
        """The batch logged as ``txnid`` did not commit: log an abort marker, so that a
        replay skips it; if even that fails, say so (the log refuses every later batch
        by then)."""
        try:
            self.append(txnid, [], _ABORT)
        except WalFailed:
            log.critical("storage: batch %d failed to commit after it was logged, and the "
                         "log could not record that", txnid)

    def checkpoint_locked(self, *, if_due: bool = False) -> None:
        """`checkpoint` holding LMDB's writer lock (a write transaction, aborted after);
        with ``if_due``, only if it is still due once the lock is held.

        Raises:
            WalFailed: see `checkpoint`.
        """
        txn = self._env.begin(write=True)
        try:
            if not if_due or self.due:
                self.checkpoint()
        finally:
            txn.abort()

    def maintain(self, gate: Gate) -> None:
        """The writer thread's share of the upkeep while batches run on the loop: a due
        checkpoint (under LMDB's writer lock, and inside ``gate`` so that a map growth
        on the loop waits for it), else a `preflush`. A batch on the loop meanwhile
        waits for LMDB's lock at most one checkpoint long, instead of running it."""
        if not self.due:
            self.preflush()
            return
        gate.enter_shared()
        try:
            self.checkpoint_locked(if_due=True)  # a batch on the loop may have run it first
        except WalFailed:
            log.exception("storage: a checkpoint failed (the next batch meets it)")
        finally:
            gate.exit_shared()

    def preflush_asked(self) -> None:
        """The writer asked its thread for a `preflush` (or the due checkpoint)."""
        self._preflushed = True
        self.preflush_due = False

    def preflush(self) -> None:
        """Sync LMDB's file, holding no lock: durability rests on the log, not on
        this; it only leaves the next checkpoint's sync little to write. A failure
        is left for that checkpoint to meet (and report)."""
        try:
            self._env.sync(True)
        except lmdb.Error as exc:
            log.warning("storage: syncing LMDB's file ahead of a checkpoint failed: %r", exc)

    def _extend(self, size: int) -> None:
        current = os.fstat(self._fd).st_size
        zeros = b"\0" * (1 << 20)
        while current < size:
            n = min(len(zeros), size - current)
            os.pwrite(self._fd, zeros[:n], current)
            current += n
        os.fsync(self._fd)
        self._size = current

    def append(self, txnid: int, ops: list[Op], kind: int = _BATCH) -> None:
        """Log one batch (``ops`` in order) and sync it: after this it is durable.

        Raises:
            WalFailed: the write or the sync failed (now or before).
        """
        if self.broken is not None:
            raise WalFailed("the write-ahead log failed earlier; restart to recover") \
                from self.broken
        # One packer, one append at a time (under LMDB's writer lock); the CRC of
        # the generation's bytes is taken once a checkpoint (~10 calls a step less).
        body = self._packer.pack((txnid, kind, ops))
        n = len(body)
        head = _REC_HEAD.pack(n, zlib.crc32(body, self._gen_crc), self._gen)
        # Each record starts on a page of its own: an append never writes a page an
        # earlier sync already flushed (and may still have under writeback).
        end = self._offset + (_REC_HEAD_SIZE + n + 4095) // 4096 * 4096
        try:
            if end > self._size:
                self._extend(end + LOG_BYTES)
            os.pwrite(self._fd, head + body, self._offset)
            os.fdatasync(self._fd)
        except OSError as exc:
            self.broken = exc
            log.critical("storage: the write-ahead log failed: %r", exc)
            raise WalFailed(f"the write-ahead log failed: {exc!r}") from exc
        self._offset = end
        commits = self._commits = self._commits + 1
        logged = self._logged = self._logged + n
        self.appends += 1
        # Attributes, not properties: read once or twice a step.
        self.due = commits >= CHECKPOINT_COMMITS or logged >= CHECKPOINT_BYTES
        self.preflush_due = not self._preflushed and (
            commits * PREFLUSH_FRACTION >= CHECKPOINT_COMMITS
            or logged * PREFLUSH_FRACTION >= CHECKPOINT_BYTES)

    def checkpoint(self) -> None:
        """Sync LMDB, record its meta pages and transaction id, start the log again,
        and move the pin to the synced snapshot.

        Called under LMDB's writer lock (no commit can slip in between the sync and
        the pin), or while nothing else writes (open, close, map growth).

        Raises:
            WalFailed: a sync or the header's write failed.
        """
        if self.broken is not None:
            raise WalFailed("the write-ahead log failed earlier; restart to recover") \
                from self.broken
        env = self._env
        try:
            env.sync(True)
            metas = os.pread(self._data_fd, 2 * self._page_size, 0)
            txnid = env.info()["last_txnid"]
            gen = self._gen + 1
            body = _SLOT_HEAD.pack(_MAGIC, _VERSION, gen, txnid, self._page_size,
                                   len(metas)) + metas
            slot = _slot_size(self._page_size)
            os.pwrite(self._fd, body + struct.pack("<I", zlib.crc32(body)), (gen % 2) * slot)
            os.fdatasync(self._fd)
        except (OSError, lmdb.Error) as exc:  # py-lmdb reports a failed sync as lmdb.Error
            self.broken = exc
            log.critical("storage: a checkpoint of the write-ahead log failed: %r", exc)
            raise WalFailed(f"a checkpoint failed: {exc!r}") from exc
        self._gen = gen
        self._gen_crc = zlib.crc32(_GEN.pack(gen))
        self._offset = self._start
        self._commits = 0
        self._logged = 0
        self._preflushed = False
        self.due = self.preflush_due = False
        self.checkpoints += 1
        pin = env.begin()
        old, self._pin = self._pin, pin
        if old is not None:
            old.abort()

    def unpin(self) -> None:
        """Release the pin (LMDB's map cannot be resized with a transaction open);
        `checkpoint` takes it again. Nothing may commit in between."""
        if self._pin is not None:
            self._pin.abort()
            self._pin = None

    def close(self) -> None:
        """A last checkpoint (the next open replays nothing), then let go of the files."""
        try:
            if self.broken is None:
                self.checkpoint()
        finally:
            self.unpin()
            os.close(self._fd)
            os.close(self._data_fd)
