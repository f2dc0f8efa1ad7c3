"""The power-cut filesystem itself (`_lazyfs.py`), before anything relies on it.

Each test writes through a real lazyfs mount, cuts the power (`LazyFS.cut`:
the FUSE server SIGKILLed, the mount gone, a new one on what was synced) and
reads what survived:

* unsynced writes are gone, synced ones kept, byte for byte, and a write
  after the sync is undone back to the synced bytes (not to zeros);
* ``fsync``, ``fdatasync`` and ``O_DSYNC`` writes each make a file durable,
  through any of its descriptors;
* the size is data: an unsynced extension or truncation is undone;
* metadata is durable at once (create, mkdir, rename, unlink: the documented
  choice), and a rename carries the file's unsynced pages with it;
* shared mappings work as LMDB uses them: a read-only ``MAP_SHARED`` mapping
  sees ``pwrite``s at once, and a writable one's pages are dropped unless
  ``msync``ed;
* the kernel's page cache does not carry unsynced data across a cut;
* LMDB itself: with ``sync=True`` every committed transaction of a SIGKILLed
  writer survives a cut; with ``sync=False`` they are lost.
"""

from __future__ import annotations

import mmap
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.campaign._lazyfs import FSTYPE, LazyFS, _mounted, unavailable_reason

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def fs(tmp_path: Path) -> Iterator[LazyFS]:
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    with LazyFS(tmp_path / "disk", tmp_path / "mnt") as lazy:
        yield lazy
    assert _mounted(str(tmp_path / "mnt")) is None, "the mount outlived its fixture"


def _write(path: Path, data: bytes, offset: int = 0, *, sync: str | None = None,
           flags: int = 0) -> None:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | flags, 0o644)
    try:
        os.pwrite(fd, data, offset)
        if sync == "fsync":
            os.fsync(fd)
        elif sync == "fdatasync":
            os.fdatasync(fd)
    finally:
        os.close(fd)


def test_unsynced_writes_are_lost_synced_ones_kept(fs: LazyFS) -> None:
    m = fs.mountpoint
    _write(m / "lost", b"never synced")
    _write(m / "kept", b"A" * 10_000, sync="fsync")
    _write(m / "kept", b"B" * 100, 5_000)  # over synced bytes, then not synced
    _write(m / "kept", b"C" * 50, 10_000)  # past the synced end, not synced
    assert (m / "lost").read_bytes() == b"never synced"  # visible before the cut
    assert (m / "kept").stat().st_size == 10_050
    before = fs.stats()
    assert before["dirty_files"] == 2 and before["dirty_pages"] >= 3
    fs.cut()
    assert (m / "lost").exists() and (m / "lost").stat().st_size == 0  # created: durable
    assert (m / "kept").read_bytes() == b"A" * 10_000  # the synced bytes, not zeros
    assert fs.stats()["dirty_pages"] == 0


@pytest.mark.parametrize("how", ["fsync", "fdatasync", "o_dsync", "o_sync"])
def test_each_way_of_syncing_makes_the_file_durable(fs: LazyFS, how: str) -> None:
    path = fs.mountpoint / "f"
    if how.startswith("o_"):
        _write(path, b"x" * 9_000, flags=os.O_DSYNC if how == "o_dsync" else os.O_SYNC)
    else:
        _write(path, b"x" * 9_000, sync=how)
    fs.cut()
    assert path.read_bytes() == b"x" * 9_000


def test_a_sync_through_another_descriptor_covers_the_file(fs: LazyFS) -> None:
    """The kernel syncs inodes: LMDB writes pages on one descriptor and syncs the same file."""
    path = fs.mountpoint / "f"
    writer = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    syncer = os.open(path, os.O_RDONLY)
    try:
        os.pwrite(writer, b"page" * 2048, 0)
        os.fdatasync(syncer)
        os.pwrite(writer, b"late", 0)
    finally:
        os.close(writer)
        os.close(syncer)
    fs.cut()
    assert path.read_bytes() == b"page" * 2048


def test_size_changes_are_data(fs: LazyFS) -> None:
    m = fs.mountpoint
    _write(m / "shrunk", b"s" * 8_192, sync="fsync")
    os.truncate(m / "shrunk", 100)
    _write(m / "shrunk", b"t", 8_000)  # a hole over the truncated bytes: zeros, not old data
    assert (m / "shrunk").read_bytes() == b"s" * 100 + bytes(7_900) + b"t"
    _write(m / "grown", b"g" * 10, sync="fsync")
    os.truncate(m / "grown", 50_000)
    _write(m / "synced-cut", b"c" * 8_192, sync="fsync")
    os.truncate(m / "synced-cut", 10)
    fd = os.open(m / "synced-cut", os.O_RDWR)
    os.fsync(fd)
    os.close(fd)
    fs.cut()
    assert (m / "shrunk").read_bytes() == b"s" * 8_192
    assert (m / "grown").read_bytes() == b"g" * 10
    assert (m / "synced-cut").read_bytes() == b"c" * 10


def test_metadata_is_durable_at_once(fs: LazyFS) -> None:
    """The documented choice: create, mkdir, rename and unlink need no directory sync."""
    m = fs.mountpoint
    (m / "dir").mkdir()
    _write(m / "dir" / "moved", b"synced", sync="fsync")
    _write(m / "dir" / "moved", b"SYNCED+unsynced")
    os.rename(m / "dir" / "moved", m / "renamed")
    _write(m / "gone", b"x", sync="fsync")
    os.unlink(m / "gone")
    _write(m / "empty", b"")
    assert (m / "renamed").read_bytes() == b"SYNCED+unsynced"  # the pages moved with it
    fs.cut()
    assert sorted(os.listdir(m)) == ["dir", "empty", "renamed"]
    assert os.listdir(m / "dir") == []
    assert (m / "renamed").read_bytes() == b"synced"


def test_shared_mappings(fs: LazyFS) -> None:
    """LMDB reads data.mdb through a read-only shared mapping, and writes lock.mdb through one."""
    m = fs.mountpoint
    # A read mapping sees pwrite at once (write-through: no writeback cache).
    fd = os.open(m / "data", os.O_RDWR | os.O_CREAT, 0o644)
    os.pwrite(fd, bytes(3 * mmap.PAGESIZE), 0)
    os.fsync(fd)
    view = mmap.mmap(fd, 3 * mmap.PAGESIZE, mmap.MAP_SHARED, mmap.PROT_READ)
    try:
        assert view[mmap.PAGESIZE:mmap.PAGESIZE + 4] == bytes(4)
        os.pwrite(fd, b"new!", mmap.PAGESIZE)
        assert view[mmap.PAGESIZE:mmap.PAGESIZE + 4] == b"new!"
        assert fs.stats()["files"]["/data"]["dirty_pages"] == 1  # the server has it, unsynced
    finally:
        view.close()
        os.close(fd)
    # A writable shared mapping: dropped unless msync'ed (msync(MS_SYNC) is an fsync).
    for name, flush in (("mapped-lost", False), ("mapped-kept", True)):
        fd = os.open(m / name, os.O_RDWR | os.O_CREAT, 0o644)
        os.ftruncate(fd, mmap.PAGESIZE)
        os.fsync(fd)
        area = mmap.mmap(fd, mmap.PAGESIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        area[:5] = b"hello"
        if flush:
            area.flush()
        area.close()
        os.close(fd)
    fs.cut()
    assert (m / "data").read_bytes() == bytes(3 * mmap.PAGESIZE)
    assert (m / "mapped-lost").read_bytes() == bytes(mmap.PAGESIZE)
    assert (m / "mapped-kept").read_bytes()[:5] == b"hello"


def test_the_page_cache_does_not_survive_a_cut(fs: LazyFS) -> None:
    """Read a file into the kernel's cache, write it, cut: the cache went with the mount."""
    path = fs.mountpoint / "cached"
    _write(path, b"old" * 3_000, sync="fsync")
    fd = os.open(path, os.O_RDWR)
    try:
        assert os.pread(fd, 9_000, 0) == b"old" * 3_000  # now in the page cache
        os.pwrite(fd, b"new" * 3_000, 0)
        assert os.pread(fd, 9_000, 0) == b"new" * 3_000
    finally:
        os.close(fd)
    server = fs.pid
    fs.cut()
    assert fs.pid != server and _mounted(str(fs.mountpoint)) == FSTYPE
    assert path.read_bytes() == b"old" * 3_000


SYNCER = r"""
import os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
os.pwrite(fd, b"w" * 10_000, 0)
print("written", flush=True)
os.fsync(fd)
print("synced", flush=True)
"""


def test_a_cut_amid_a_held_fsync(fs: LazyFS) -> None:
    """`hold_syncs`: the writer is stuck in its fsync when the power goes; nothing was synced."""
    path = fs.mountpoint / "f"
    _write(path, b"s" * 100, sync="fsync")
    assert fs.hold_syncs(5.0) is False  # nobody syncs yet
    proc = subprocess.Popen([sys.executable, "-c", SYNCER, str(path)], stdout=subprocess.PIPE,
                            text=True)
    try:
        assert fs.hold_syncs(10.0) is True
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        outs: list[str] = []
        fs.cut(then=lambda: outs.append(proc.communicate(timeout=30)[0]))
    assert outs[0].split() == ["written"]  # the fsync never returned
    assert path.read_bytes() == b"s" * 100


LMDB_WRITER = r"""
import os, sys, lmdb
sync = sys.argv[2] == "1"
env = lmdb.open(sys.argv[1], map_size=64 << 20, sync=sync, metasync=True, writemap=False,
                readahead=False)
for i in range(int(sys.argv[3])):
    with env.begin(write=True) as txn:
        txn.put(b"k%06d" % i, b"v" * 300)
    print(i, flush=True)  # printed = committed (and, with sync, durable)
os.kill(os.getpid(), 9)
"""

LMDB_READER = r"""
import sys, lmdb
env = lmdb.open(sys.argv[1], map_size=64 << 20, readonly=False, writemap=False)
with env.begin() as txn:
    print(txn.stat()["entries"])
"""


@pytest.mark.parametrize("sync", [True, False], ids=["sync", "nosync"])
def test_lmdb_commits_against_a_cut(fs: LazyFS, sync: bool) -> None:
    """stepd's settings (writemap off, metasync on) on lazyfs; the writer SIGKILLs itself."""
    env_dir = fs.mountpoint / "env"
    r = subprocess.run([sys.executable, "-c", LMDB_WRITER, str(env_dir), "1" if sync else "0",
                        "500"], check=False, capture_output=True, text=True, timeout=120)
    assert r.returncode == -signal.SIGKILL, r.stderr
    committed = len(r.stdout.split())
    assert committed == 500
    before = fs.stats()
    fs.cut()
    r = subprocess.run([sys.executable, "-c", LMDB_READER, str(env_dir)],
                       check=False, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    survived = int(r.stdout)
    print(f"lmdb sync={sync}: committed={committed} survived={survived} "
          f"fdatasyncs={before['fdatasyncs']} dropped-pages={before['dirty_pages']}")
    if sync:
        assert survived == committed
    else:
        assert survived < committed


def test_a_torn_cut_keeps_part_of_what_was_unsynced(fs: LazyFS) -> None:
    m = fs.mountpoint
    _write(m / "f", b"o" * (64 * 4096), sync="fsync")
    _write(m / "f", b"n" * (64 * 4096))  # 64 unsynced pages over synced ones
    before = fs.cut(keep=0.5, seed=7)
    kept = before["torn_pages_kept"]
    assert 0 < kept < 64 and before["dirty_pages"] == 64
    data = (m / "f").read_bytes()
    pages = [data[i:i + 4096] for i in range(0, len(data), 4096)]
    assert len(pages) == 64 and all(p in (b"o" * 4096, b"n" * 4096) for p in pages)
    assert sum(p == b"n" * 4096 for p in pages) == kept


LMDB_LOOP = r"""
import sys, lmdb
env = lmdb.open(sys.argv[1], map_size=64 << 20, sync=True, metasync=True, writemap=False,
                readahead=False)
with env.begin() as txn:
    i = int(bytes(txn.get(b"k00") or b"-1.").split(b".")[0]) + 1
while True:
    with env.begin(write=True) as txn:  # 20 keys rewritten: pages of older snapshots reused
        for j in range(20):
            txn.put(b"k%02d" % j, b"%d" % i + b"." * 2000)
    print(i, flush=True)  # printed = committed and synced
    i += 1
"""

LMDB_VERIFY = r"""
import sys, lmdb
env = lmdb.open(sys.argv[1], map_size=64 << 20, writemap=False)
with env.begin() as txn:
    values = {bytes(v).split(b".")[0] for _, v in txn.cursor()}
    assert len(values) == 1 and txn.stat()["entries"] == 20, values  # one whole transaction
print(int(values.pop()))
"""


def _torn_rounds(fs: LazyFS, loop: str, verify: str, seed: int) -> tuple[int, int]:
    """Eight rounds of: ``loop`` (a program printing each acknowledged commit) runs on the
    mount, is SIGKILLed 0.3-0.8 s after its first acknowledgement, the power is cut torn
    (half the unsynced pages kept), and ``verify`` prints the last commit on disk, which
    must be at least the last acknowledged. Returns (cuts that found LMDB's file with
    unsynced pages, the last acknowledged commit)."""
    import random
    import time

    rng = random.Random(seed)
    env_dir = fs.mountpoint / "env"
    amid = 0
    committed = -1
    for round_no in range(8):
        proc = subprocess.Popen([sys.executable, "-c", loop, str(env_dir)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert proc.stdout is not None
            first = proc.stdout.readline()  # open (and recovered): committing from here
            time.sleep(rng.uniform(0.3, 0.8))
        finally:
            os.kill(proc.pid, signal.SIGKILL)
            out, err = proc.communicate(timeout=30)  # returns once the killed process is reaped
        printed = [int(x) for x in (first + out).split()]
        assert printed, err
        committed = printed[-1]
        before = fs.cut(keep=0.5, seed=round_no)
        amid += before["files"].get("/env/data.mdb", {}).get("dirty_pages", 0) > 0
        r = subprocess.run([sys.executable, "-c", verify, str(env_dir)],
                           check=False, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        survived = int(r.stdout)  # the last commit on disk: at least the last acknowledged
        assert survived >= committed, (round_no, survived, committed)
    return amid, committed


def test_lmdb_survives_torn_cuts_amid_commits(fs: LazyFS) -> None:
    """stepd's LMDB settings, cut (torn: half the unsynced pages kept) while commits are in flight."""
    amid, committed = _torn_rounds(fs, LMDB_LOOP, LMDB_VERIFY, 20261201)
    print(f"lmdb torn cuts: 8 (amid a commit {amid}), last committed txn {committed}")


STORAGE_LOOP = r"""
import sys, anyio
from stepd.storage import Storage

async def main():
    async with Storage.open(sys.argv[1], map_size=1 << 20) as storage:
        i = int((storage.get("runs", "k00") or "-1.").split(".")[0]) + 1
        while True:
            def batch(txn, i=i):
                txn.put("runs", "n%06d" % i, "%d." % i + "." * 1500)  # kept for good
                for j in range(8):  # rewritten: pages of older snapshots freed and reused
                    txn.put("runs", "k%02d" % j, "%d." % i + "." * 2000)
            await storage.write(batch)
            print(i, flush=True)  # printed = acknowledged (durable)
            i += 1

anyio.run(main)
"""

STORAGE_VERIFY = r"""
import sys, anyio
from stepd.storage import Storage

async def main():
    async with Storage.open(sys.argv[1], map_size=1 << 20) as storage:
        rows = {k.decode(): v for k, v in storage.scan("runs")}
        values = {v.split(".")[0] for k, v in rows.items() if k.startswith("k")}
        assert len(values) == 1 and len(rows) > 8, values  # the last batch, whole
        last = int(values.pop())
        for i in range(last + 1):  # and every batch before it
            assert rows.get("n%06d" % i) == "%d." % i + "." * 1500, i
        assert len(rows) == 8 + last + 1, len(rows)
        print(last)

anyio.run(main)
"""


def test_the_write_ahead_log_survives_torn_cuts_amid_commits(fs: LazyFS) -> None:
    """stepd's storage as it runs (LMDB without its own sync, behind the write-ahead log),
    cut torn: half the unsynced pages of LMDB's file and of the log kept, at random. A
    meta page may reach the disk ahead of its pages, and pages of older snapshots are
    reused: recovery puts the checkpoint's metas back and replays the log
    (storage/_wal.py), so the last acknowledged batch is there and whole."""
    amid, committed = _torn_rounds(fs, STORAGE_LOOP, STORAGE_VERIFY, 20261202)
    assert amid > 0, "no cut caught LMDB's file with unsynced pages: the test saw no tearing"
    print(f"write-ahead log torn cuts: 8 (LMDB's file torn in {amid}), last acknowledged {committed}")
