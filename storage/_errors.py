"""The storage layer's closed error hierarchy.

Every error the storage layer raises on purpose derives from
:class:`StorageError`; errors raised by a caller's own request function are
passed back to that caller unchanged (they are the caller's, not ours).

::

    StorageError
     +-- AlreadyOpen      the data directory is already open in this process
     +-- StorageClosed    the storage is closed (or closing, or its writer died)
     +-- StorageFull      the map cannot grow: ``max_map_size`` is reached
     +-- CommitFailed     the commit of a batch failed; nothing of it is visible
     +-- UsedAfterFork    the storage was opened by another process (a fork parent)
     +-- SchemaMismatch   the data directory holds an unsupported schema version
     +-- UnknownTable     a table name that was not declared at open

Chaining: every error that has a cause carries it as ``__cause__``
(``raise ... from exc``), so a :class:`CommitFailed` shows the LMDB error
underneath it.
"""

from __future__ import annotations

__all__ = [
    "AlreadyOpen",
    "CommitFailed",
    "SchemaMismatch",
    "StorageClosed",
    "StorageError",
    "StorageFull",
    "UnknownTable",
    "UsedAfterFork",
]


class StorageError(Exception):
    """Base class of every error the storage layer raises on its own."""


class AlreadyOpen(StorageError):
    """The data directory is already open in this process.

    LMDB forbids opening one environment twice in a process: the second
    handle's close would drop the first one's POSIX (fcntl) locks. Paths are
    compared after ``os.path.realpath``, so a symlink does not get around it.
    """


class StorageClosed(StorageError):
    """The storage is closed or closing, or its writer thread stopped.

    Raised by every operation started after the storage context began to exit,
    and to callers still waiting when the writer thread died of a bug (the bug
    itself propagates out of the storage context).
    """


class StorageFull(StorageError):
    """A batch does not fit even after growing the map to ``max_map_size``.

    Nothing of the failed batch is visible; earlier acknowledged writes are
    untouched. Raise ``max_map_size`` (and free disk space) to make progress.
    """


class CommitFailed(StorageError):
    """The commit of a batch failed: nothing of the batch is visible.

    Every caller of the batch receives its own ``CommitFailed`` whose
    ``__cause__`` is the underlying error, including callers whose own request
    function raised (their error may have been decided on state written by a
    batch-mate, which is now gone). The storage stays usable afterwards.
    """


class UsedAfterFork(StorageError):
    """The storage was opened in another process (this one is a fork child).

    LMDB forbids using an environment across ``fork()`` and py-lmdb does not
    check it, so the storage checks on every operation (a count bumped in a fork
    child by ``os.register_at_fork``, and then ``os.getpid()``). Open a
    new storage in the child instead (after the parent has closed its own, or
    from a fresh process).
    """


class SchemaMismatch(StorageError):
    """The data directory's schema version is not the one this code supports.

    A newer version means a newer stepd wrote it: refusing protects it from
    being misread or downgraded.
    """


class UnknownTable(StorageError, KeyError):
    """A table name that was neither built in nor passed in ``extra_tables``.

    Also a ``KeyError``, since it is a failed lookup by name.
    """

    def __str__(self) -> str:  # KeyError's str() adds quotes; keep the message plain
        return str(self.args[0]) if self.args else ""
