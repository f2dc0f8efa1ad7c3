"""The process the crash test kills: writes records and prints each acknowledged id.

Usage: ``python -m tests.storage._crash_child DATA_DIR ROUND BACKEND``

Eight concurrent writers loop: each queues a deferred "pre" record, then awaits
the write of its record (whose function checks that the pre record is there:
deferred writes are ordered before later writes), and prints the record's id
only after ``write`` returned, i.e. after the commit was synced. The parent
SIGKILLs this process at a random moment and checks that every printed id
survived.

The map starts tiny, so the map also grows while the process may be killed.
"""

from __future__ import annotations

import sys

import anyio

from stepd.storage import Storage, WriteTxn

WRITERS = 8
PAD = b"\x5a" * 200


def pre_txn(txn: WriteTxn, record_id: str) -> None:
    txn.put("leases", record_id, {"pre": True})


def record_txn(txn: WriteTxn, record_id: str, writer: int, i: int) -> None:
    if not txn.exists("leases", record_id):
        raise AssertionError(f"deferred pre record of {record_id} is missing")
    txn.put("runs", record_id, {"writer": writer, "i": i, "pad": PAD})


async def main(path: str, round_: str) -> None:
    out = sys.stdout

    async def writer(storage: Storage, w: int) -> None:
        i = 0
        while True:
            record_id = f"{round_}-{w}-{i}"
            storage.write_deferred(pre_txn, record_id)
            await storage.write(record_txn, record_id, w, i)
            out.write(record_id + "\n")  # acknowledged: the commit is durable
            out.flush()
            i += 1

    async with Storage.open(path, map_size=128 << 10, max_map_size=1 << 30) as storage:
        out.write("ready\n")
        out.flush()
        async with anyio.create_task_group() as tg:
            for w in range(WRITERS):
                tg.start_soon(writer, storage, w)


if __name__ == "__main__":
    anyio.run(main, sys.argv[1], sys.argv[2], backend=sys.argv[3])
