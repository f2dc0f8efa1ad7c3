"""The worker WebSocket against clients that send and never read (the hardening issue, item 1).

A client that never reads made the daemon hold everything it would have sent
it: 256 queued frames per connection, each echoing what the client sent (a
1 MB lease id in every 404), ~300 MB per connection, still held after the
client left. Now what an error repeats of a client's input is cut
(`stepd.transport.protocol.error_reply`), a frame's input is let go before
its answer waits for room, and the frames waiting to be sent are bounded in
bytes as well as in number: past ``--ws-max-queue-bytes`` the connection is
closed with 1013 (docs/serve.md "Limits").

Every test runs against a real ``stepd serve`` on 127.0.0.1, over raw sockets
(`RawWs`: a client that reads only when the test says so).
"""

from __future__ import annotations

import base64
import json
import os
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import msgpack
import pytest

from .conftest import DaemonProcess, start_daemon, task_def, unique

QUEUE_BYTES = 1 << 20  # --ws-max-queue-bytes of this module's daemon


def rss_mb(pid: int) -> float:
    """The process's resident set (VmRSS of /proc/PID/status), in MiB."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


class RawWs:
    """A WebSocket client on a bare socket: it sends masked frames and reads only when asked."""

    def __init__(self, url: str, *, subprotocol: str = "stepd.v1.msgpack",
                 rcvbuf: int | None = None, timeout: float = 10.0) -> None:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf is not None:  # set before connecting: a small window the daemon cannot outrun
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.sock.settimeout(timeout)
        self.sock.connect((host, int(port)))
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall(
            f"GET /v1/api/workers/connect HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
            f"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Protocol: {subprotocol}\r\n\r\n".encode())
        self.buf = b""
        while b"\r\n\r\n" not in self.buf:
            chunk = self.sock.recv(65536)
            assert chunk, "closed during the handshake"
            self.buf += chunk
        head, self.buf = self.buf.split(b"\r\n\r\n", 1)
        assert head.startswith(b"HTTP/1.1 101"), head
        self.binary = subprotocol == "stepd.v1.msgpack"

    @staticmethod
    def frame(payload: bytes, opcode: int = 2) -> bytes:
        """A final client frame (masked with a zero key: the payload goes as is)."""
        n = len(payload)
        if n < 126:
            head = bytes([0x80 | opcode, 0x80 | n])
        elif n < 1 << 16:
            head = bytes([0x80 | opcode, 0x80 | 126]) + n.to_bytes(2, "big")
        else:
            head = bytes([0x80 | opcode, 0x80 | 127]) + n.to_bytes(8, "big")
        return head + b"\0\0\0\0" + payload

    def send(self, value: Any) -> None:
        if self.binary:
            self.sock.sendall(self.frame(msgpack.packb(value, use_bin_type=True)))
        else:
            self.sock.sendall(self.frame(json.dumps(value).encode(), opcode=1))

    def send_raw(self, payload: bytes, opcode: int = 2) -> None:
        self.sock.sendall(self.frame(payload, opcode))

    def _read(self, n: int) -> bytes:
        while len(self.buf) < n:
            chunk = self.sock.recv(1 << 20)
            if not chunk:
                raise EOFError
            self.buf += chunk
        data, self.buf = self.buf[:n], self.buf[n:]
        return data

    def recv_frame(self) -> tuple[int, bytes]:
        """The next frame from the daemon: (opcode, payload)."""
        b0, b1 = self._read(2)
        n = b1 & 0x7F
        if n == 126:
            n = int.from_bytes(self._read(2), "big")
        elif n == 127:
            n = int.from_bytes(self._read(8), "big")
        return b0 & 0x0F, self._read(n)

    def recv(self) -> dict[str, Any]:
        """The next data frame, decoded (pings are skipped)."""
        while True:
            opcode, payload = self.recv_frame()
            if opcode == 2:
                return dict(msgpack.unpackb(payload, raw=False))
            if opcode == 1:
                return dict(json.loads(payload))
            if opcode == 8:
                raise ConnectionError(f"closed {int.from_bytes(payload[:2], 'big')}")

    def request(self, frame: dict[str, Any]) -> dict[str, Any]:
        self.send(frame)
        for _ in range(100):
            answer = self.recv()
            if answer.get("op") != "lease":
                return answer
        raise AssertionError("no answer")

    def close_code(self, *, limit: int = 100_000) -> int:
        """Read (and drop) frames until the daemon's close frame; its code."""
        for _ in range(limit):
            opcode, payload = self.recv_frame()
            if opcode == 8:
                return int.from_bytes(payload[:2], "big")
        raise AssertionError("no close frame")

    def close(self) -> None:
        self.sock.close()


@pytest.fixture(scope="module")
def wsd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    d = start_daemon(tmp_path_factory.mktemp("wsbp") / "data", "--max-request-ms", "2000",
                     "--ws-max-queue-bytes", str(QUEUE_BYTES))
    yield d
    assert d.stop() == 0, d.stderr()
    d.assert_quiet_log()


def _flood(url: str, id_bytes: int, *, max_frames: int = 300) -> tuple[RawWs, int]:
    """``max_frames`` heartbeats with a lease id of ``id_bytes``, never reading an answer.

    Fewer when the daemon stops reading first (TCP pushes back: the send times out).
    """
    ws = RawWs(url)
    ws.sock.settimeout(0.5)
    frame = RawWs.frame(msgpack.packb(
        {"op": "heartbeat", "id": 1, "lease_id": "l_" + "a" * id_bytes}, use_bin_type=True))
    sent = 0
    for _ in range(max_frames):
        try:
            ws.sock.sendall(frame)
        except TimeoutError:  # the daemon stopped reading (TCP pushes back): it holds what it must
            break
        sent += 1
    return ws, sent


def test_clients_that_never_read_leave_no_memory_behind(wsd: DaemonProcess) -> None:
    """Three connections send 300 heartbeats each with a 256 KB lease id, read nothing, leave.

    Before the fix the daemon's RSS rose by ~70 MB per connection (the queued
    404s each echoing the id, and the frames in flight) and stayed there after
    the clients disconnected: 42 MiB before, 256 MiB connected, 257 MiB after.
    Now an answer repeats at most a short prefix of the id and a frame's input
    is let go before its answer waits for room: 43, 45, 45 MiB.
    """
    with httpx.Client(base_url=wsd.url, trust_env=False, timeout=10) as http:
        # Warm up the same code paths with small ids, so the baseline has them loaded.
        warm, _ = _flood(wsd.url, 64, max_frames=50)
        warm.close()
        assert http.get("/healthz").status_code == 200
        baseline = rss_mb(wsd.pid)
        held, frames = [], 0
        for _ in range(3):
            ws, sent = _flood(wsd.url, 256 * 1024)
            held.append(ws)
            frames += sent
        connected = rss_mb(wsd.pid)
        for ws in held:
            ws.close()
        after = connected
        for _ in range(40):  # bounded: until the daemon has let go of the connections
            assert http.get("/healthz").status_code == 200
            after = rss_mb(wsd.pid)
            if after - baseline < 32:
                break
            time.sleep(0.25)
    print(f"RSS baseline={baseline:.0f} MiB connected={connected:.0f} MiB after={after:.0f} MiB "
          f"frames={frames}")
    assert frames >= 3 * 256, "the daemon should have read a queue's worth per connection"
    assert after - baseline < 32, (baseline, connected, after)


def test_an_echoed_lease_id_is_cut(wsd: DaemonProcess) -> None:
    """A 100 KB lease id: the 404 names the lease by a short prefix, over msgpack and JSON."""
    for subprotocol in ("stepd.v1.msgpack", "stepd.v1.json"):
        ws = RawWs(wsd.url, subprotocol=subprotocol)
        try:
            answer = ws.request({"op": "heartbeat", "id": 7, "lease_id": "l_" + "z" * 100_000})
        finally:
            ws.close()
        assert answer["op"] == "error" and answer["status"] == 404 and answer["id"] == 7
        assert "not found" in answer["message"] and "l_zzz" in answer["message"]
        assert len(answer["message"]) < 300, len(answer["message"])


def test_an_echoed_key_is_cut(wsd: DaemonProcess) -> None:
    """An unknown key of 100 KB in register or credit: the field and message are cut."""
    ws = RawWs(wsd.url)
    try:
        key = "k" * 100_000
        answer = ws.request({"op": "register", "id": 1, "definitions": [], key: 1})
        assert answer["op"] == "error" and answer["status"] == 400, answer
        assert answer["field"].startswith("kkkk") and len(answer["field"]) < 200
        assert len(answer["message"]) < 400
        answer = ws.request({"op": "credit", "id": 2, "n": 1, key: 1})
        assert answer["op"] == "error" and answer["id"] == 2
        assert len(answer["field"]) < 200 and len(answer["message"]) < 400
    finally:
        ws.close()


@pytest.mark.parametrize("bad_id", ["x" * 100_000, 1.5, True, [1], {"a": 1}, None])
def test_a_request_id_that_is_not_an_integer_is_refused_not_echoed(wsd: DaemonProcess,
                                                                    bad_id: Any) -> None:
    """PROTOCOL.md: requests carry an integer id. Anything else: 400 with ``id`` null.

    A ``credit`` (whose id is optional) with an id that is not an integer was
    applied and never answered: it is refused too, and grants nothing.
    """
    ws = RawWs(wsd.url)
    try:
        for frame in ({"op": "heartbeat", "id": bad_id, "lease_id": "l_1"},
                      {"op": "register", "id": bad_id, "definitions": []},
                      {"op": "credit", "id": bad_id, "n": 1}):
            if bad_id is None and frame["op"] == "credit":
                continue  # a credit without an id is the ordinary, unanswered one
            answer = ws.request(frame)
            assert answer["op"] == "error" and answer["id"] is None, answer
            assert answer["status"] == 400 and answer["field"] == "id", answer
            assert len(answer["message"]) < 200
    finally:
        ws.close()


@pytest.mark.parametrize("payload, says", [
    (b"\xc1", "0xc1"),
    (b"\x92\x01", "ends"),
    (b"\x81\x01\x02", "key"),
    (b"\x80\x80", "after"),
    (b"", "empty"),
    (b"\xde\xff\xff", "ends"),
])
def test_bad_msgpack_says_what_is_wrong(wsd: DaemonProcess, payload: bytes, says: str) -> None:
    """Before: ``the frame is not valid msgpack: `` with nothing after the colon (0xc1)."""
    ws = RawWs(wsd.url)
    try:
        ws.send_raw(payload)
        answer = ws.recv()
    finally:
        ws.close()
    assert answer["op"] == "error" and answer["status"] == 400 and answer["id"] is None
    message = answer["message"]
    assert message.startswith("the frame is not valid msgpack: "), message
    detail = message.removeprefix("the frame is not valid msgpack: ")
    assert detail.strip() and says in detail, message


def test_a_worker_that_never_reads_its_leases_is_closed_with_1013(wsd: DaemonProcess) -> None:
    """Leases of 512 KB pushed to a worker that granted credit and never reads.

    Past ``--ws-max-queue-bytes`` (1 MiB here) waiting to be sent, the daemon
    drops what waits and closes with 1013; the worker is no longer connected
    and the runs' leases are offered again once they expire. Before, the
    daemon queued 256 frames whatever their size.
    """
    name = unique()
    ws = RawWs(wsd.url, rcvbuf=16 * 1024)
    with httpx.Client(base_url=wsd.url, trust_env=False, timeout=10) as http:
        answer = ws.request({"op": "register", "id": 1, "definitions": [task_def(name, "s")]})
        assert answer["op"] == "registered", answer
        worker_id = answer["worker_id"]
        ws.send({"op": "credit", "n": 100})
        blob = "b" * (512 * 1024)
        for i in range(24):  # 12 MB of leases: more than the kernel's buffers and the bound
            r = http.post("/v1/api/runs", json={"workflow": name, "input": {"i": i, "blob": blob}})
            assert r.status_code == 201, r.text
        connected = True
        for _ in range(100):  # bounded: until the daemon has closed the connection
            workers = http.get("/v1/api/workers").json()["workers"]
            connected = any(w["worker_id"] == worker_id and w["connected"] for w in workers)
            if not connected:
                break
            time.sleep(0.1)
        assert not connected, "the daemon kept a connection that does not read"
        try:
            code = ws.close_code()
        finally:
            ws.close()
    assert code == 1013
