"""The LMDB environment: opening it, its tables, its schema, and who may touch it.

One environment per data directory, one named sub-database per table
(:data:`TABLES` plus the ``extra_tables`` given at open, e.g. the ``idx_*``
indexes later issues add). The ``meta`` table holds the schema version,
checked on open.

Rules enforced here, because LMDB states them and py-lmdb does not (all) check
them:

* never open the same environment twice in one process (closing the second
  handle would drop the first one's fcntl locks): :class:`OpenRegistry`,
  by real path (py-lmdb 3.0 also refuses by file identity; both map to
  :class:`AlreadyOpen`);
* never use an environment after ``fork()``: the pid is recorded at open and
  compared on every operation (py-lmdb does *not* check this);
* ``set_mapsize`` only while no transaction is active in this process:
  :class:`Gate`, a small readers/resizer lock that read transactions hold for
  their (short) lifetime and the writer takes exclusively to resize.

The environment is opened with LMDB's durable defaults (``sync=True``,
``metasync=True``, ``writemap=False``, ``map_async=False``); only ``sync`` is
configurable, for benchmark comparison.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import lmdb

from ._codec import decode, encode
from ._errors import AlreadyOpen, SchemaMismatch, StorageFull
from ._wal import WAL_FILE, Wal, recover_files, replay
from ._wal import lock as lock_wal

__all__ = [
    "SCHEMA_VERSION",
    "TABLES",
    "Gate",
    "OpenEnv",
    "OpenRegistry",
    "open_env",
]

#: The built-in tables (named sub-databases).
TABLES: tuple[str, ...] = (
    "runs",
    "journal",
    "leases",
    "definitions",
    "dispatch_keys",
    "signals",
    "timers",
    "audit",
    "workers",
    "meta",
)

#: The layout version this code reads and writes (``meta[b"schema_version"]``).
SCHEMA_VERSION = 1
SCHEMA_KEY = b"schema_version"

_TABLE_NAME = re.compile(r"[a-z][a-z0-9_]{0,63}")


def check_tables(extra_tables: Iterable[str]) -> tuple[str, ...]:
    """Return the full table list, validating the extra names.

    Raises:
        ValueError: a name is malformed or duplicated.
    """
    names = list(TABLES)
    for name in extra_tables:
        if not isinstance(name, str) or not _TABLE_NAME.fullmatch(name):
            raise ValueError(
                f"bad table name {name!r}: use lowercase letters, digits and '_' "
                "(starting with a letter, at most 64 characters)"
            )
        if name in names:
            raise ValueError(f"duplicate table name {name!r}")
        names.append(name)
    return tuple(names)


class OpenRegistry:
    """The set of data directories open in this process (by real path)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._paths: set[str] = set()

    def claim(self, path: str) -> None:
        """Record ``path`` as open.

        Raises:
            AlreadyOpen: it already is.
        """
        with self._lock:
            if path in self._paths:
                raise AlreadyOpen(f"storage at {path!r} is already open in this process")
            self._paths.add(path)

    def release(self, path: str) -> None:
        with self._lock:
            self._paths.discard(path)


REGISTRY = OpenRegistry()


class Gate:
    """Shared/exclusive lock: read transactions vs. ``set_mapsize`` and close.

    Readers hold it shared for the microseconds of their read transaction;
    the writer holds it exclusive while resizing the map (with its own write
    transaction already aborted) and the storage while closing. Exclusive
    waiters have priority, so a stream of readers cannot starve a resize;
    a thread that already holds it shared may re-enter (a read inside a read
    function) without waiting, which would otherwise deadlock behind a
    waiting resize.
    """

    def __init__(self) -> None:
        # One plain lock for the counters; the condition (on the same lock) is
        # only waited on when a resize is pending, which is rare. A read takes
        # the plain lock twice and calls no Python function of `threading`
        # (`Condition.__enter__` is one): a read happens several times a run.
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._readers = 0
        self._exclusive = False
        self._exclusive_waiting = 0
        self._local = threading.local()

    def enter_shared(self) -> None:
        """Hold the gate shared (a read transaction may open); pair with `exit_shared`."""
        local = self._local
        depth: int = getattr(local, "depth", 0)
        if depth:  # re-entry: this thread already keeps the resizer out
            local.depth = depth + 1
            return
        with self._lock:
            if self._exclusive or self._exclusive_waiting:
                while self._exclusive or self._exclusive_waiting:
                    self._cond.wait()
            self._readers += 1
        local.depth = 1

    def exit_shared(self) -> None:
        """Release what `enter_shared` took."""
        local = self._local
        depth: int = local.depth
        if depth > 1:
            local.depth = depth - 1
            return
        local.depth = 0
        with self._lock:
            self._readers -= 1
            if self._readers == 0 and self._exclusive_waiting:
                self._cond.notify_all()

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        """`enter_shared`/`exit_shared` as a block (`StorageReads.read` calls them itself)."""
        self.enter_shared()
        try:
            yield
        finally:
            self.exit_shared()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            self._exclusive_waiting += 1
            try:
                while self._exclusive or self._readers:
                    self._cond.wait()
            finally:
                self._exclusive_waiting -= 1
            self._exclusive = True
        try:
            yield
        finally:
            with self._cond:
                self._exclusive = False
                self._cond.notify_all()


@dataclass(frozen=True, slots=True)
class OpenEnv:
    """An opened environment, the handles of its tables, and its write-ahead log
    (None when commits are not synced at all)."""

    env: lmdb.Environment
    dbs: dict[str, lmdb._Database]
    path: str
    wal: Wal | None = None


def _is_already_open(exc: lmdb.Error) -> bool:
    return "already open in this process" in str(exc)


def open_env(
    path: str,
    *,
    tables: tuple[str, ...],
    map_size: int,
    max_map_size: int,
    sync: bool,
    write_ahead_log: bool = True,
) -> OpenEnv:
    """Open (creating if needed) the environment at ``path``; blocking.

    First recovers from the write-ahead log (`_wal.recover_files`, `_wal.replay`)
    what the last run committed after its last checkpoint. Creates the tables
    and writes the schema version in one synced write transaction, growing the
    map if even that does not fit. Also clears stale reader slots left by killed
    processes (``reader_check``). With ``sync`` and ``write_ahead_log`` the
    environment is then reopened without LMDB's own sync, behind a new `Wal`;
    otherwise there is no log (a log left by an earlier run is applied and
    removed), and commits are synced by LMDB itself (``sync``) or not at all.

    Raises:
        AlreadyOpen: py-lmdb reports the files already open in this process.
        SchemaMismatch: the stored schema version is not :data:`SCHEMA_VERSION`.
        StorageFull: creating the tables does not fit in ``max_map_size``.
        WalCorrupt: the write-ahead log does not follow the environment.
        lmdb.Error: LMDB could not open the directory.
    """
    os.makedirs(path, exist_ok=True)
    fd = lock_wal(path)
    try:
        pending = recover_files(path, fd)
        env, dbs = _open(path, tables, map_size, max_map_size, sync=True)
    except BaseException:
        os.close(fd)
        raise
    try:
        if pending is not None:
            replay(env, dbs, pending, max_map_size)
        if not (sync and write_ahead_log):
            os.unlink(os.path.join(path, WAL_FILE))  # applied: LMDB holds it all now
            os.close(fd)
            fd = -1
            if sync:
                return OpenEnv(env=env, dbs=dbs, path=path)
            env.close()
            env, dbs = _open(path, tables, map_size, max_map_size, sync=False)
            return OpenEnv(env=env, dbs=dbs, path=path)
        # Without LMDB's own sync from here on: the log makes commits durable.
        current = env.info()["map_size"]
        env.close()
        env, dbs = _open(path, tables, current, max_map_size, sync=False)
        wal = Wal(path, env, fd)
        return OpenEnv(env=env, dbs=dbs, path=path, wal=wal)
    except BaseException:
        env.close()
        if fd >= 0:
            os.close(fd)
        raise


def _open(path: str, tables: tuple[str, ...], map_size: int, max_map_size: int, *,
          sync: bool) -> tuple[lmdb.Environment, dict[str, lmdb._Database]]:
    try:
        env = lmdb.open(
            path,
            map_size=map_size,
            max_dbs=len(tables) + 8,
            subdir=True,
            sync=sync,
            metasync=True,
            writemap=False,  # nested transactions need it off; it also guards against stray writes
            map_async=False,
            readahead=False,  # random access over a large map: do not pollute the page cache
            max_readers=126,
        )
    except lmdb.Error as exc:
        if _is_already_open(exc):
            raise AlreadyOpen(f"storage at {path!r} is already open in this process") from exc
        raise
    try:
        env.reader_check()
        while True:
            try:
                dbs = _create_tables(env, tables)
                break
            except lmdb.MapFullError as exc:
                current = env.info()["map_size"]
                if current >= max_map_size:
                    raise StorageFull(
                        f"cannot create the tables within max_map_size={max_map_size}"
                    ) from exc
                env.set_mapsize(min(current * 2, max_map_size))
    except BaseException:
        env.close()
        raise
    return env, dbs


def _create_tables(env: lmdb.Environment, tables: tuple[str, ...]) -> dict[str, lmdb._Database]:
    with env.begin(write=True) as txn:
        dbs = {name: env.open_db(name.encode(), txn=txn, create=True) for name in tables}
        raw = txn.get(SCHEMA_KEY, db=dbs["meta"])
        if raw is None:
            txn.put(SCHEMA_KEY, encode(SCHEMA_VERSION), db=dbs["meta"])
        else:
            stored = decode(raw)
            if stored != SCHEMA_VERSION:
                newer = isinstance(stored, int) and stored > SCHEMA_VERSION
                raise SchemaMismatch(
                    f"storage at {env.path()!r} has schema version {stored!r}, this code "
                    f"supports {SCHEMA_VERSION}"
                    + (": it was written by a newer stepd; upgrade stepd to open it"
                       if newer else ": no migration exists from that version")
                )
    return dbs
