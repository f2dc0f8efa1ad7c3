"""The process tests/storage/test_wal.py kills or holds.

Usage: ``python -m tests.storage._wal_child DATA_DIR write|hold``

``write``: batch ``i`` puts ``n<i>`` (kept for good) and rewrites eight ``k`` keys
(pages of older snapshots freed and reused), and ``i`` is printed once the
write returned, i.e. once it is durable. The map starts at 1 MiB, so it grows
while the process may be killed. ``hold``: open the storage, print ``ready``,
wait for stdin to close, then write one record and print ``wrote``.
"""

from __future__ import annotations

import sys

import anyio
import anyio.to_thread

from stepd.storage import Storage, WriteTxn

PAD = "." * 1500


def value(i: int, pad: str = PAD) -> str:
    return f"{i}.{pad}"


def batch_txn(txn: WriteTxn, i: int) -> None:
    txn.put("runs", f"n{i:06d}", value(i))
    for j in range(8):
        txn.put("runs", f"k{j:02d}", value(i, "." * 2000))


async def write(path: str) -> None:
    async with Storage.open(path, map_size=1 << 20) as storage:
        last = storage.get("runs", "k00")
        i = 0 if last is None else int(str(last).split(".")[0]) + 1
        while True:
            await storage.write(batch_txn, i)
            print(i, flush=True)
            i += 1


async def hold(path: str) -> None:
    async with Storage.open(path) as storage:
        print("ready", flush=True)
        await anyio.to_thread.run_sync(sys.stdin.read)
        await storage.write(lambda txn: txn.put("runs", "held", 1))
        print("wrote", flush=True)


if __name__ == "__main__":
    anyio.run(write if sys.argv[2] == "write" else hold, sys.argv[1])
