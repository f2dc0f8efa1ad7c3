"""lazyfs: a FUSE filesystem that keeps unsynced writes in memory, for power-cut tests.

The idea is Jepsen's lazyfs: a process crash (SIGKILL) keeps the kernel's page
cache, so it cannot show a missing fsync; a power cut does. This filesystem
plays the part of the page cache and of the disk:

* the **disk** is a backing directory on the real filesystem. It holds, for
  each file, exactly what was synced: the file as it was at its last
  ``fsync``/``fdatasync`` (or ``O_SYNC``/``O_DSYNC`` write);
* the **page cache** is the memory of the FUSE server process: for each file,
  the 4 KiB pages written since its last sync, and its size since then.

Reads see the pages in memory over the backing file, so a program on the
mount sees every write at once, as on any filesystem. ``fsync`` and
``fdatasync`` of a file (through any of its descriptors: the kernel syncs
inodes, not descriptors) write that file's pages and size to the backing file.
A **power cut** (`LazyFS.cut`) SIGKILLs the FUSE server: whatever it held and
had not synced is gone with it, and every request it had not answered fails. The dead mount is then unmounted (which also
drops the kernel's own page cache of the mount's files: a FUSE inode's cache
does not outlive its superblock) and a new server is mounted on the backing
directory, which now holds only what was synced.

A **torn cut** (``LazyFS.cut(keep=p)``) is the other outcome a real power loss
can have: the disk had written back part of the page cache when the power
went. The server writes each unsynced page to the backing file with
probability ``p`` (a seeded draw), then exits without answering anything
else; the rest is dropped as in a plain cut.

Semantics (what a program on the mount gets):

* Data and size: unsynced until ``fsync``/``fdatasync`` of the file, or a write
  through a descriptor opened ``O_SYNC``/``O_DSYNC`` (which syncs the whole
  file: the kernel turns such a write into a FUSE ``FSYNC`` of the file too,
  and that request carries no range). ``fdatasync`` and ``fsync`` are the
  same here: both make the file's data and size durable. ``truncate`` is a
  data operation: unsynced like a write.
* Metadata (create, mkdir, unlink, rmdir, rename, chmod, chown, utimens) is
  durable at once: it is applied to the backing directory when it happens, as
  on a filesystem mounted ``dirsync``. This is kinder than a real disk, where
  a new directory entry is durable only after an ``fsync`` of the directory.
  LMDB never syncs its directory; it creates ``data.mdb`` and ``lock.mdb``
  once, on the first open, and never renames or unlinks them, so what matters
  to it is the content of ``data.mdb``, which this filesystem treats
  strictly. ``fsyncdir`` is accepted and does nothing.
* Writes are write-through: the server is not mounted with
  ``writeback_cache`` (libfuse 3 leaves it off unless asked) and every
  ``write`` reaches the server before the system call returns, so the
  kernel's page cache never holds data the server has not seen. Shared
  ``mmap`` works (no ``direct_io``): reads of a mapping are served by the
  server, and dirty pages of a writable shared mapping (LMDB's ``lock.mdb``)
  reach it when the kernel writes them back. Files are opened without
  ``keep_cache``, so each open drops the kernel's cached pages of the file.
* Locks: the filesystem implements neither ``lock`` nor ``flock``, so the
  kernel handles POSIX and BSD locks itself (LMDB's ``fcntl`` locks on
  ``lock.mdb`` work as on a local disk, within one mount).

What LMDB (``writemap=False``, ``sync=True``, ``metasync=True``) does with it:
it writes pages of ``data.mdb`` with ``pwrite``/``pwritev``, reads them
through a read-only shared mapping, calls ``fdatasync`` on the data file
before it writes the meta page, and writes the meta page through a second
descriptor opened ``O_DSYNC``. With ``sync=False`` (``stepd serve
--unsafe-no-sync``) it syncs nothing, so a cut takes every transaction since
the environment was created.

Run the server itself as ``python _lazyfs.py serve BACKING MOUNTPOINT
CONTROL_SOCKET`` (root, ``/dev/fuse``, libfuse 3 and the ``mfusepy`` binding);
tests use `LazyFS`. The control socket answers ``stats`` with a JSON object
(writes, syncs, dirty pages held...): what a cut is about to drop; ``hold``
makes every later sync wait (up to `HOLD_S`) before it reaches the disk, so a
cut can come while a program is inside its fsync (`LazyFS.hold_syncs`); and
``tear KEEP SEED`` answers the stats plus ``torn_pages_kept`` just before the
server exits (a torn cut).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Self

__all__ = ["LazyFS", "LazyFSError", "unavailable_reason"]

PAGE = 4096
MOUNT_TIMEOUT_S = 20.0
HOLD_S = 30.0  # a held sync goes through after this, should nobody cut the power
FSTYPE = "fuse.lazyfs"


# --------------------------------------------------------------------------- the filesystem


class Node:
    """One regular file: its backing file (what is synced) and the pages not yet synced."""

    def __init__(self, backing: str) -> None:
        self.backing = backing
        self.fd = os.open(backing, os.O_RDWR | os.O_CLOEXEC)
        self.pages: dict[int, bytearray] = {}
        self.durable_size = os.fstat(self.fd).st_size  # the backing file's size
        self.size = self.durable_size  # the size a program on the mount sees
        # Bytes of the backing file at or past `floor` were truncated away since
        # the last sync: they read as zeros until a sync cuts the backing file too.
        self.floor = self.durable_size

    def _page(self, index: int) -> bytearray:
        page = self.pages.get(index)
        if page is None:
            page = bytearray(PAGE)
            start = index * PAGE
            if start < self.floor:
                base = os.pread(self.fd, min(PAGE, self.floor - start), start)
                page[: len(base)] = base
            self.pages[index] = page
        return page

    def read(self, size: int, offset: int) -> bytes:
        end = min(offset + size, self.size)
        if offset >= end:
            return b""
        buf = bytearray(end - offset)
        base_end = min(end, self.floor)
        if base_end > offset:
            base = os.pread(self.fd, base_end - offset, offset)
            buf[: len(base)] = base
        if self.pages:
            for index in range(offset // PAGE, (end - 1) // PAGE + 1):
                page = self.pages.get(index)
                if page is None:
                    continue
                start = index * PAGE
                lo, hi = max(offset, start), min(end, start + PAGE)
                buf[lo - offset:hi - offset] = page[lo - start:hi - start]
        return bytes(buf)

    def write(self, data: bytes, offset: int) -> int:
        pos = 0
        while pos < len(data):
            at = offset + pos
            index, within = divmod(at, PAGE)
            n = min(PAGE - within, len(data) - pos)
            self._page(index)[within:within + n] = data[pos:pos + n]
            pos += n
        self.size = max(self.size, offset + len(data))
        return len(data)

    def truncate(self, length: int) -> None:
        if length < self.size:
            for index in [i for i in self.pages if i * PAGE >= length]:
                del self.pages[index]
            index, within = divmod(length, PAGE)
            if within and index in self.pages:
                self.pages[index][within:] = bytes(PAGE - within)
            self.floor = min(self.floor, length)
        self.size = length

    def dirty(self) -> bool:
        return bool(self.pages) or self.size != self.durable_size or self.floor != self.durable_size

    def sync(self) -> int:
        """Write the pages and the size to the backing file; returns the pages written."""
        if not self.dirty():
            return 0
        if self.floor < self.durable_size:
            os.ftruncate(self.fd, self.floor)
        written = 0
        for index in sorted(self.pages):
            os.pwrite(self.fd, self.pages[index], index * PAGE)
            written += 1
        os.ftruncate(self.fd, self.size)  # whole pages may have run past the end
        self.pages.clear()
        self.durable_size = self.floor = self.size
        return written

    def tear(self, rng: random.Random, keep: float) -> int:
        """A torn cut: write a random subset of the unsynced pages (each with
        probability ``keep``) to the backing file, as a disk that lost power
        amid writeback may have kept. A kept page past the synced end extends
        the file; a truncation not synced is not applied. Returns the pages kept."""
        kept = 0
        for index in sorted(self.pages):
            start = index * PAGE
            if start < self.size and rng.random() < keep:
                os.pwrite(self.fd, self.pages[index][: self.size - start], start)
                kept += 1
        return kept

    def close(self) -> None:
        os.close(self.fd)


def _operations_class() -> tuple[Any, Any]:
    """The mfusepy `Operations` subclass and mfusepy's ``FUSE`` runner.

    mfusepy is imported only here, in the server process.
    """
    import mfusepy  # type: ignore[import-untyped,import-not-found,unused-ignore]
    from mfusepy import FuseOSError, Operations

    class LazyOps(Operations):  # type: ignore[misc]
        use_ns = True

        def __init__(self, backing: str) -> None:
            self.root = os.path.realpath(backing)
            self._mutex = threading.RLock()
            self.nodes: dict[str, Node] = {}  # mount path -> node; kept after close
            self.handles: dict[int, tuple[Node, bool]] = {}  # fh -> node, O_SYNC/O_DSYNC
            self.next_fh = 1
            self.counts: dict[str, int] = dict.fromkeys(
                ("writes", "bytes_written", "reads", "fsyncs", "fdatasyncs", "sync_writes",
                 "pages_synced", "fsyncdirs", "truncates", "creates", "opens", "held_syncs"), 0)
            self.holding = False  # `hold`: syncs wait (bounded) instead of reaching the disk
            self.released = threading.Event()

        # -- helpers

        def _b(self, path: str) -> str:
            return os.path.join(self.root, path.lstrip("/"))

        def _node(self, path: str) -> Node:
            node = self.nodes.get(path)
            if node is None:
                node = self.nodes[path] = Node(self._b(path))
            return node

        def _handle(self, node: Node, flags: int) -> int:
            fh = self.next_fh
            self.next_fh += 1
            self.handles[fh] = (node, bool(flags & (os.O_SYNC | os.O_DSYNC)))
            return fh

        def stats(self) -> dict[str, Any]:
            with self._mutex:
                dirty = [n for n in self.nodes.values() if n.dirty()]
                return {**self.counts,
                        "dirty_files": len(dirty),
                        "dirty_pages": sum(len(n.pages) for n in dirty),
                        "dirty_bytes": sum(len(n.pages) for n in dirty) * PAGE,
                        "files": {p: {"size": n.size, "durable_size": n.durable_size,
                                      "dirty_pages": len(n.pages)}
                                  for p, n in sorted(self.nodes.items())}}

        def hold(self) -> dict[str, Any]:
            """From now on every sync waits (at most HOLD_S) before it reaches the disk:
            the program on the mount has written, and is stuck in its fsync when the
            power goes."""
            with self._mutex:
                self.holding = True
            return self.stats()

        def _wait_if_held(self) -> None:
            with self._mutex:
                if not self.holding:
                    return
                self.counts["held_syncs"] += 1
            self.released.wait(HOLD_S)

        def tear_and_exit(self, keep: float, seed: int, reply: Any) -> None:
            """Keep a random part of what is unsynced, answer, and exit: the power is out.

            The mutex is never released: no request runs after the tear."""
            self._mutex.acquire()
            answer = self.stats()
            rng = random.Random(seed)
            answer["torn_pages_kept"] = sum(
                node.tear(rng, keep) for _, node in sorted(self.nodes.items()))
            reply(answer)
            os._exit(0)

        # -- metadata: applied to the backing directory at once (durable)

        def getattr(self, path: str, fh: int | None = None) -> dict[str, Any]:
            with self._mutex:
                node = self.handles[fh][0] if fh in self.handles else self.nodes.get(path)
                try:
                    st = os.fstat(node.fd) if node is not None else os.lstat(self._b(path))
                except FileNotFoundError:
                    raise FuseOSError(errno.ENOENT) from None
                attrs = {key: getattr(st, key) for key in (
                    "st_mode", "st_nlink", "st_uid", "st_gid", "st_size",
                    "st_atime_ns", "st_mtime_ns", "st_ctime_ns")}
                for key in ("st_atime", "st_mtime", "st_ctime"):
                    attrs[key] = attrs.pop(key + "_ns")
                if node is not None:
                    attrs["st_size"] = node.size
                attrs["st_blocks"] = (attrs["st_size"] + 511) // 512
                attrs["st_blksize"] = PAGE
                return attrs

        def readdir(self, path: str, fh: int) -> list[str]:
            return [".", "..", *os.listdir(self._b(path))]

        def mkdir(self, path: str, mode: int) -> int:
            os.mkdir(self._b(path), mode)
            return 0

        def rmdir(self, path: str) -> int:
            os.rmdir(self._b(path))
            return 0

        def unlink(self, path: str) -> int:
            with self._mutex:
                os.unlink(self._b(path))
                node = self.nodes.pop(path, None)
                if node is not None and not any(n is node for n, _ in self.handles.values()):
                    node.close()
            return 0

        def rename(self, old: str, new: str) -> int:
            with self._mutex:
                os.rename(self._b(old), self._b(new))
                replaced = self.nodes.pop(new, None)
                if replaced is not None and not any(n is replaced for n, _ in self.handles.values()):
                    replaced.close()
                if old in self.nodes:
                    self.nodes[new] = self.nodes.pop(old)
            return 0

        def chmod(self, path: str, mode: int) -> int:
            os.chmod(self._b(path), mode)
            return 0

        def chown(self, path: str, uid: int, gid: int) -> int:
            os.chown(self._b(path), uid, gid)
            return 0

        def utimens(self, path: str, times: tuple[int, int] | None = None) -> int:
            if times is None:
                os.utime(self._b(path))
            else:
                os.utime(self._b(path), ns=times)
            return 0

        def statfs(self, path: str) -> dict[str, int]:
            sv = os.statvfs(self._b(path))
            return {key: getattr(sv, key) for key in (
                "f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree",
                "f_files", "f_flag", "f_frsize", "f_namemax")}

        def access(self, path: str, amode: int) -> int:
            if not os.path.lexists(self._b(path)):
                raise FuseOSError(errno.ENOENT)
            return 0

        def fsyncdir(self, path: str, datasync: int, fh: int) -> int:
            with self._mutex:
                self.counts["fsyncdirs"] += 1
            return 0

        # -- files

        def create(self, path: str, mode: int, flags: int = 0) -> int:
            with self._mutex:
                excl = os.O_EXCL if flags & os.O_EXCL else 0
                fd = os.open(self._b(path), os.O_CREAT | os.O_RDWR | excl | os.O_CLOEXEC, mode)
                os.close(fd)
                node = self._node(path)
                if flags & os.O_TRUNC:
                    node.truncate(0)
                self.counts["creates"] += 1
                return self._handle(node, flags)

        def open(self, path: str, flags: int) -> int:
            with self._mutex:
                try:
                    node = self._node(path)
                except FileNotFoundError:
                    raise FuseOSError(errno.ENOENT) from None
                if flags & os.O_TRUNC:
                    node.truncate(0)
                self.counts["opens"] += 1
                return self._handle(node, flags)

        def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
            with self._mutex:
                self.counts["reads"] += 1
                return self.handles[fh][0].read(size, offset)

        def write(self, path: str, data: bytes, offset: int, fh: int) -> int:
            with self._mutex:
                node, sync_writes = self.handles[fh]
                n = node.write(data, offset)
                self.counts["writes"] += 1
                self.counts["bytes_written"] += n
            if sync_writes:
                self._wait_if_held()
                with self._mutex:
                    self.counts["sync_writes"] += 1
                    self.counts["pages_synced"] += node.sync()
            return n

        def truncate(self, path: str, length: int, fh: int | None = None) -> int:
            with self._mutex:
                node = self.handles[fh][0] if fh in self.handles else self._node(path)
                node.truncate(length)
                self.counts["truncates"] += 1
            return 0

        def fsync(self, path: str, datasync: int, fh: int) -> int:
            self._wait_if_held()
            with self._mutex:
                self.counts["fdatasyncs" if datasync else "fsyncs"] += 1
                self.counts["pages_synced"] += self.handles[fh][0].sync()
            return 0

        def flush(self, path: str, fh: int) -> int:
            return 0

        def release(self, path: str, fh: int) -> int:
            with self._mutex:
                node, _ = self.handles.pop(fh)
                if node not in self.nodes.values() and not any(
                        n is node for n, _ in self.handles.values()):
                    node.close()  # unlinked and now closed
            return 0

    return LazyOps, mfusepy.FUSE


def _send(conn: socket.socket, answer: dict[str, Any]) -> None:
    conn.sendall((json.dumps(answer) + "\n").encode())


def _serve_control(ops: Any, sock_path: str) -> None:
    """Answer ``stats`` on a Unix socket (one JSON line per request)."""
    if os.path.exists(sock_path):
        os.unlink(sock_path)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(sock_path)
    srv.listen(4)

    def loop() -> None:
        while True:
            conn, _ = srv.accept()
            with conn:
                request = conn.makefile("r").readline().strip()
                if request == "stats":
                    answer = ops.stats()
                elif request == "hold":
                    answer = ops.hold()
                elif request.startswith("tear "):
                    _, keep, seed = request.split()
                    ops.tear_and_exit(float(keep), int(seed), functools.partial(_send, conn))
                    return
                else:
                    answer = {"error": f"unknown request {request!r}"}
                conn.sendall((json.dumps(answer) + "\n").encode())

    threading.Thread(target=loop, name="lazyfs-control", daemon=True).start()


def serve(backing: str, mountpoint: str, control: str) -> None:
    """Mount and serve until unmounted (or killed: that is the power cut)."""
    ops_class, fuse = _operations_class()
    ops = ops_class(backing)
    _serve_control(ops, control)
    fuse(ops, mountpoint, foreground=True, nothreads=False, fsname="lazyfs", subtype="lazyfs")


# --------------------------------------------------------------------------- the test side


class LazyFSError(RuntimeError):
    pass


@functools.cache
def unavailable_reason() -> str | None:
    """Why lazyfs cannot run here (a skip reason), or None when it can."""
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse on this machine (FUSE is needed for the power-cut tests)"
    try:
        os.close(os.open("/dev/fuse", os.O_RDWR))
    except OSError as exc:
        return f"/dev/fuse cannot be opened: {exc}"
    if os.geteuid() != 0:
        return "lazyfs mounts with mount(2) and needs root"
    probe = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", "import mfusepy; print(mfusepy.fuse_version_major)"],
        check=False, capture_output=True, text=True, timeout=60)
    if probe.returncode != 0 or probe.stdout.strip() != "3":
        tail = (probe.stderr.strip().splitlines() or [probe.stdout.strip()])[-1]
        return ("the FUSE library is missing: lazyfs needs libfuse 3 (Debian: apt-get install -y "
                f"fuse3) and the mfusepy binding (pip install mfusepy): {tail}")
    return None


def _mounted(mountpoint: str) -> str | None:
    """The type of the filesystem visible at ``mountpoint`` (the last mounted there), or None."""
    target = os.path.realpath(mountpoint)
    found: str | None = None
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if fields[4].encode().decode("unicode_escape") == target:
                found = fields[fields.index("-") + 1]
    return found


_libc = ctypes.CDLL(None, use_errno=True)
MNT_DETACH = 2


def _umount(mountpoint: str) -> None:
    """Unmount (lazily when busy); a no-op when nothing is mounted there."""
    for _ in range(20):
        if _mounted(mountpoint) != FSTYPE:
            return
        if _libc.umount2(os.fsencode(mountpoint), 0) != 0:
            err = ctypes.get_errno()
            if err == errno.EBUSY:
                _libc.umount2(os.fsencode(mountpoint), MNT_DETACH)
            elif err not in (errno.EINVAL, errno.ENOENT):
                raise LazyFSError(f"umount {mountpoint}: {os.strerror(err)}")
        time.sleep(0.05)
    if _mounted(mountpoint) == FSTYPE:
        raise LazyFSError(f"{mountpoint} is still mounted")


class LazyFS:
    """A lazyfs mount for a test: mounted on enter, unmounted (always) on exit.

    ``cut()`` is a power cut: the server is SIGKILLed (what it held unsynced is
    gone), the dead mount is unmounted, and a new server is mounted on what was
    synced. Nothing may have files open on the mount when it is cut: kill the
    programs using it first.
    """

    def __init__(self, backing: Path, mountpoint: Path, log: Path | None = None) -> None:
        self.backing = Path(backing)
        self.mountpoint = Path(mountpoint)
        self.control = str(self.backing.parent / f".{self.backing.name}.lazyfs.sock")
        self.log = log or self.backing.parent / f"{self.mountpoint.name}.lazyfs.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.cuts = 0
        self.dropped_pages = 0  # unsynced pages the cuts dropped (from the server's stats)

    def __enter__(self) -> Self:
        self.mount()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def mount(self) -> None:
        if self.proc is not None:
            raise LazyFSError("already mounted")
        self.backing.mkdir(parents=True, exist_ok=True)
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        if _mounted(str(self.mountpoint)) is not None:
            raise LazyFSError(f"something is mounted at {self.mountpoint} already")
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-W", "ignore", os.path.abspath(__file__), "serve",
                 str(self.backing), str(self.mountpoint), self.control],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        deadline = time.monotonic() + MOUNT_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.proc = None
                raise LazyFSError(f"the lazyfs server exited before mounting: {self._log_tail()}")
            if _mounted(str(self.mountpoint)) == FSTYPE and os.path.exists(self.control):
                try:
                    self.stats()
                    return
                except OSError:
                    pass
            time.sleep(0.02)
        self._kill()
        raise LazyFSError(f"lazyfs did not mount within {MOUNT_TIMEOUT_S} s: {self._log_tail()}")

    def _log_tail(self) -> str:
        try:
            return self.log.read_text(errors="replace")[-2000:]
        except OSError:
            return ""

    def stats(self) -> dict[str, Any]:
        """The server's counters and what it holds unsynced now."""
        return self._request("stats")

    def _request(self, line: str) -> dict[str, Any]:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(10)
            s.connect(self.control)
            s.sendall(line.encode() + b"\n")
            data = b""
            while not data.endswith(b"\n"):
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
        return json.loads(data)  # type: ignore[no-any-return]

    def hold_syncs(self, timeout: float) -> bool:
        """Make every sync from now on wait; True once one is waiting (within ``timeout``).

        A cut then comes while a program is inside its fsync: what it wrote for
        that sync is in memory only, and the sync has not returned.
        """
        self._request("hold")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.stats()["held_syncs"]:
                return True
            time.sleep(0.002)
        return False

    def _kill(self, then: Callable[[], object] | None = None) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
            self.proc = None
        if then is not None:
            then()
        _umount(str(self.mountpoint))

    def cut(self, *, keep: float = 0.0, seed: int = 0,
            then: Callable[[], object] | None = None) -> dict[str, Any]:
        """Power cut: drop what is unsynced, then mount what survived.

        With ``keep`` > 0 the cut is torn: each unsynced page reaches the
        disk with that probability (drawn from ``seed``), the rest is dropped.
        ``then`` runs once the server is dead and before the unmount: reap
        there the programs SIGKILLed just before the cut. (A program killed
        while the server holds one of its requests, a held sync, only dies
        once the server answers or dies: the kernel waits out a request the
        server has read.) Returns the server's stats just before the cut
        (``dirty_pages`` is what was unsynced; ``torn_pages_kept`` what a torn
        cut kept of it).
        """
        if self.proc is None:
            raise LazyFSError("not mounted")
        try:
            before = self._request(f"tear {keep!r} {seed}") if keep > 0 else self.stats()
        except (OSError, ValueError):
            before = {}
        self._kill(then)
        self.cuts += 1
        self.dropped_pages += int(before.get("dirty_pages", 0)) - int(before.get("torn_pages_kept", 0))
        self.mount()
        return before

    def close(self) -> None:
        """Unmount cleanly (nothing is synced by it: unsynced data is dropped)."""
        if self.proc is not None and self.proc.poll() is None:
            _umount(str(self.mountpoint))
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        self._kill()


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "serve":
        serve(sys.argv[2], sys.argv[3], sys.argv[4])
    else:
        sys.exit(f"usage: {sys.argv[0]} serve BACKING MOUNTPOINT CONTROL_SOCKET")
