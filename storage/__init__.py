"""LMDB storage with persist-before-acknowledge group commit.

A generic, durable, transactional key-value layer (it imports nothing else of
stepd): one LMDB environment per data directory, one named sub-database per
table, msgpack values, a single writer thread that batches concurrent writes
into one synced commit. See ``docs/storage.md``.

Example::

    async with Storage.open(path) as storage:
        def create_run_txn(txn: WriteTxn, run_id: str) -> bool:
            return txn.put("runs", run_id, {"status": "pending"}, overwrite=False)

        created = await storage.write(create_run_txn, "run-1")  # durable now
        storage.get("runs", "run-1")  # {'status': 'pending'}
"""

from ._codec import decode, encode
from ._env import SCHEMA_VERSION, TABLES
from ._errors import (
    AlreadyOpen,
    CommitFailed,
    SchemaMismatch,
    StorageClosed,
    StorageError,
    StorageFull,
    UnknownTable,
    UsedAfterFork,
)
from ._keys import (
    U64_MAX,
    Key,
    journal_key,
    journal_prefix,
    parse_journal_key,
    parse_timer_key,
    parse_u64be,
    prefix_end,
    timer_key,
    to_key,
    u64be,
)
from ._storage import DEFAULT_MAP_SIZE, DEFAULT_MAX_MAP_SIZE, Storage
from ._txn import ReadTxn, WriteTxn, journal_txn, last_journal_seq_txn
from ._writer import StorageStatistics

__all__ = [
    "DEFAULT_MAP_SIZE",
    "DEFAULT_MAX_MAP_SIZE",
    "SCHEMA_VERSION",
    "TABLES",
    "U64_MAX",
    "AlreadyOpen",
    "CommitFailed",
    "Key",
    "ReadTxn",
    "SchemaMismatch",
    "Storage",
    "StorageClosed",
    "StorageError",
    "StorageFull",
    "StorageStatistics",
    "UnknownTable",
    "UsedAfterFork",
    "WriteTxn",
    "decode",
    "encode",
    "journal_key",
    "journal_prefix",
    "journal_txn",
    "last_journal_seq_txn",
    "parse_journal_key",
    "parse_timer_key",
    "parse_u64be",
    "prefix_end",
    "timer_key",
    "to_key",
    "u64be",
]
