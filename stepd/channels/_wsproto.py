"""A lean WebSocket client for the worker socket: asyncio, plain ``ws://``, no proxy.

Why not the ``websockets`` library here: a worker's step is three frames in
(the lease, two answers) and two or three out, and the library's asyncio
connection spends ~40 Python calls per frame (a generator-based parser, an
assembler queue, a reader's ``recv()`` and the async iterator around it):
more than everything else the worker does for a step. This client is an
`asyncio.Protocol`: the frames of a chunk are parsed in ``data_received`` and
handed to a callback at once, and a frame goes out with one ``write``.

Scope, on purpose (as `stepd._http1` for HTTP): RFC 6455 for one client
socket, ``ws://`` only, no extensions (no compression), the subprotocol
``stepd.v1.msgpack``. Ping is answered with pong; a keepalive (`LeanSocket.keepalive`)
pings a silent daemon and drops the connection when nothing comes back, as the
library's client does (20 s, 20 s). ``wss://``, proxies and trio go through the
``websockets`` library (`stepd.channels.websocket`).

The handshake is checked as the library checks it: status 101, ``Upgrade:
websocket``, the ``Sec-WebSocket-Accept`` digest and the subprotocol. A
refusal is `HandshakeRefused` (status and body) or `BadHandshake`.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import os
import struct
from collections.abc import Callable
from typing import Any, Final
from urllib.parse import urlsplit

import httptools

try:
    from websockets.speedups import apply_mask as _apply_mask
except ImportError:  # pragma: no cover - websockets ships its C speedups on CPython
    _apply_mask = None  # type: ignore[assignment]

__all__ = ["BadHandshake", "HandshakeRefused", "LeanSocket", "open_socket"]

GUID: Final = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
MAX_HEAD_BYTES: Final = 64 * 1024
PING_INTERVAL_S: Final = 20.0
PING_TIMEOUT_S: Final = 20.0
CLOSE_TIMEOUT_S: Final = 5.0

_SMALL_HEADS: Final = [bytes((0x82, 0x80 | n)) for n in range(126)]
"""The head of a masked binary frame of 0-125 bytes, by length: no call per frame."""

_MASKS_AT_ONCE: Final = 1024


def apply_mask(data: bytes, mask: bytes) -> bytes:
    if _apply_mask is not None:
        return _apply_mask(data, mask)
    n = len(data)  # pragma: no cover - the pure-Python fallback
    key = (mask * (n // 4 + 1))[:n]
    return (int.from_bytes(data, "little") ^ int.from_bytes(key, "little")).to_bytes(n, "little")


class HandshakeRefused(Exception):
    """The upgrade was answered with another status than 101."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"the WebSocket upgrade was answered {status}")
        self.status = status
        self.body = body


class BadHandshake(Exception):
    """A 101 that is not a WebSocket for us (bad accept digest, no subprotocol...)."""


class _Head:
    """httptools callbacks for the handshake's answer."""

    __slots__ = ("body", "done", "headers")

    def __init__(self) -> None:
        self.headers: dict[str, str] = {}
        self.body: list[bytes] = []
        self.done = False

    def on_header(self, name: bytes, value: bytes) -> None:
        key = name.decode("latin-1").lower()
        text = value.decode("latin-1")
        self.headers[key] = f"{self.headers[key]}, {text}" if key in self.headers else text

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.done = True


class LeanSocket(asyncio.Protocol):
    """One client WebSocket on an asyncio transport.

    ``on_message(payload, binary)`` is called for each whole message, in
    ``data_received``; ``on_close()`` once, when the connection is gone.
    `send` writes a binary message at once (never blocks); ``paused`` says the
    transport's buffer is full (`drain` waits for room).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, host: str, path: str,
                 key: str | None, subprotocol: str, max_size: int) -> None:
        self._loop = loop
        self._transport: asyncio.Transport | None = None
        self._request = self._handshake_request(host, path, key, subprotocol)
        self._subprotocol = subprotocol
        self._max_size = max_size
        self._head: _Head | None = _Head()
        self._parser: Any = httptools.HttpResponseParser(self._head)
        self._head_bytes = 0
        self.opened: asyncio.Future[None] = loop.create_future()
        self.closed: asyncio.Future[None] = loop.create_future()
        self._buf = b""
        self._frags: list[bytes] | None = None
        self._frag_binary = True
        self._masks = b""
        self._closing = False
        self.paused = False
        self._drain: asyncio.Future[None] | None = None
        self.received = 0  # chunks received: the keepalive's sign of life
        # Frames sent in this loop iteration, written together by `_flush`
        # (scheduled by the first): the `complete`s of bodies that finish in
        # the same turn, and the credit they free, leave in one socket write.
        self._out: list[bytes] | None = None
        self.writes = 0  # socket writes that carried data frames
        self.on_message: Callable[[bytes, bool], None] = lambda payload, binary: None
        self.on_close: Callable[[], None] = lambda: None
        self.close_code: int | None = None
        self.close_reason = ""

    def _handshake_request(self, host: str, path: str, key: str | None,
                           subprotocol: str) -> bytes:
        self._key = base64.b64encode(os.urandom(16)).decode()
        auth = f"Authorization: Bearer {key}\r\n" if key is not None else ""
        return (f"GET {path} HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\n"
                f"Connection: Upgrade\r\nSec-WebSocket-Key: {self._key}\r\n"
                f"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Protocol: {subprotocol}\r\n"
                f"{auth}User-Agent: stepd-python\r\n\r\n").encode("latin-1")

    # -- asyncio.Protocol --------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        transport.write(self._request)  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        if self._head is not None:
            data = self._handshake_data(data)
            if not data:
                return
        self.received += 1
        buf = self._buf + data if self._buf else data
        n = len(buf)
        pos = 0
        while n - pos >= 2:
            b0 = buf[pos]
            length = buf[pos + 1]
            head = 2
            if length & 0x80:
                self._fail(1002, "the server masked a frame")
                return
            if length == 126:
                if n - pos < 4:
                    break
                length = (buf[pos + 2] << 8) | buf[pos + 3]
                head = 4
            elif length == 127:
                if n - pos < 10:
                    break
                length = int.from_bytes(buf[pos + 2:pos + 10], "big")
                head = 10
            if length > self._max_size:
                self._fail(1009, "message too big")
                return
            end = pos + head + length
            if end > n:
                break
            payload = buf[pos + head:end]
            pos = end
            opcode = b0 & 0x0F
            if opcode == 2 or opcode == 1:
                if b0 & 0x80 and self._frags is None:
                    self.on_message(payload, opcode == 2)
                else:
                    self._frags = [payload]
                    self._frag_binary = opcode == 2
            elif opcode == 0:
                self._continuation(payload, bool(b0 & 0x80))
            elif opcode == 9:
                self._write_control(0xA, payload)
            elif opcode == 8:
                self._on_close_frame(payload)
                return
            # 0xA (pong): a sign of life, counted above
        self._buf = buf[pos:] if pos < n else b""

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        if not self.opened.done():
            self.opened.set_exception(OSError(f"the connection closed during the handshake: {exc!r}"))
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)
        if not self.closed.done():
            self.closed.set_result(None)
            self.on_close()

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)
        self._drain = None

    # -- sending -------------------------------------------------------------------------

    def send(self, payload: bytes) -> bool:
        """Send one binary message (written with the others of this loop iteration);
        False when the connection is closing or gone."""
        transport = self._transport
        if transport is None or self._closing:
            return False
        masks = self._masks
        if not masks:
            masks = os.urandom(4 * _MASKS_AT_ONCE)
        mask, self._masks = masks[:4], masks[4:]
        n = len(payload)
        if n < 126:
            head = _SMALL_HEADS[n]
        elif n < 65536:
            head = struct.pack("!BBH", 0x82, 0xFE, n)
        else:
            head = struct.pack("!BBQ", 0x82, 0xFF, n)
        frame = head + mask + apply_mask(payload, mask)
        out = self._out
        if out is None:
            self._out = [frame]
            self._loop.call_soon(self._flush)
        else:
            out.append(frame)
        return True

    def _flush(self) -> None:
        """Write the frames sent since the last flush, in one socket write."""
        out, self._out = self._out, None
        transport = self._transport
        if out and transport is not None:
            transport.write(out[0] if len(out) == 1 else b"".join(out))
            self.writes += 1

    async def drain(self) -> None:
        """Wait until the transport takes more (after ``paused``), or the connection ends."""
        if not self.paused or self._transport is None:
            return
        if self._drain is None:
            self._drain = self._loop.create_future()
        await asyncio.shield(self._drain)

    def _write_control(self, opcode: int, payload: bytes) -> None:
        transport = self._transport
        if transport is None:
            return
        if self._out is not None:
            self._flush()  # a close goes after the frames sent before it
        mask = os.urandom(4)
        transport.write(bytes((0x80 | opcode, 0x80 | len(payload))) + mask
                        + apply_mask(payload, mask))

    def close(self, code: int = 1000, reason: str = "") -> None:
        """Start the closing handshake (the daemon answers and closes the TCP connection;
        if it does not within `CLOSE_TIMEOUT_S`, the connection is aborted)."""
        if self._transport is None or self._closing:
            return
        self._closing = True
        self._write_control(0x8, struct.pack("!H", code) + reason.encode()[:120])
        self._loop.call_later(CLOSE_TIMEOUT_S, self.abort)

    def abort(self) -> None:
        transport = self._transport
        if transport is not None:
            transport.abort()

    def ping(self) -> None:
        self._write_control(0x9, b"")

    async def keepalive(self) -> None:
        """Ping a daemon silent for `PING_INTERVAL_S`; abort if it stays silent
        `PING_TIMEOUT_S` more (a half-open connection). Cancelled with the pump."""
        while True:
            seen = self.received
            await asyncio.sleep(PING_INTERVAL_S)
            if self.received != seen:
                continue
            self.ping()
            await asyncio.sleep(PING_TIMEOUT_S)
            if self.received == seen:
                self._fail(1011, "keepalive ping timeout")
                return

    # -- receiving -----------------------------------------------------------------------

    def _continuation(self, payload: bytes, fin: bool) -> None:
        frags = self._frags
        if frags is None:
            self._fail(1002, "a continuation frame without a message")
            return
        frags.append(payload)
        if sum(len(f) for f in frags) > self._max_size:
            self._fail(1009, "message too big")
            return
        if fin:
            self._frags = None
            self.on_message(b"".join(frags), self._frag_binary)

    def _on_close_frame(self, payload: bytes) -> None:
        if len(payload) >= 2:
            self.close_code = struct.unpack("!H", payload[:2])[0]
            self.close_reason = payload[2:].decode("utf-8", "replace")
        else:
            self.close_code = 1005
        if not self._closing:  # echo the daemon's close, then let it close the TCP connection
            self._closing = True
            self._write_control(0x8, payload[:2])
        transport = self._transport
        if transport is not None:
            transport.close()

    def _fail(self, code: int, reason: str) -> None:
        self.close_code = code
        self.close_reason = reason
        if not self._closing:
            self._closing = True
            self._write_control(0x8, struct.pack("!H", code) + reason.encode()[:120])
        self.abort()

    # -- the handshake -------------------------------------------------------------------

    def _handshake_data(self, data: bytes) -> bytes:
        """Feed the answer's head; the bytes after it (frames), or b"" while it is incomplete."""
        head = self._head
        assert head is not None
        self._head_bytes += len(data)
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade as upgrade:
            rest = data[upgrade.args[0]:]
            self._head = None
            self._check_upgrade(head)
            return rest if self.opened.done() and self.opened.exception() is None else b""
        except httptools.HttpParserError as exc:
            self._refuse(BadHandshake(f"the upgrade's answer is not HTTP/1.1: {exc}"))
            return b""
        status = self._parser.get_status_code() if head.headers or head.done else 0
        if head.done:
            self._head = None
            self._refuse(HandshakeRefused(status, b"".join(head.body)))
        elif self._head_bytes > MAX_HEAD_BYTES + self._max_size:
            self._refuse(BadHandshake("the upgrade's answer is too large"))
        return b""

    def _check_upgrade(self, head: _Head) -> None:
        status = self._parser.get_status_code()
        headers = head.headers
        if status != 101:
            self._refuse(HandshakeRefused(status, b"".join(head.body)))
            return
        accept = base64.b64encode(hashlib.sha1(self._key.encode() + GUID).digest()).decode()
        if headers.get("upgrade", "").lower() != "websocket":
            self._refuse(BadHandshake("the 101 answer does not upgrade to websocket"))
        elif headers.get("sec-websocket-accept") != accept:
            self._refuse(BadHandshake("the 101 answer's Sec-WebSocket-Accept is wrong"))
        elif headers.get("sec-websocket-protocol") != self._subprotocol:
            self._refuse(BadHandshake(f"the subprotocol {self._subprotocol} was not negotiated"))
        elif headers.get("sec-websocket-extensions"):
            self._refuse(BadHandshake("the daemon chose an extension the worker did not offer"))
        elif not self.opened.done():
            self.opened.set_result(None)

    def _refuse(self, exc: Exception) -> None:
        if not self.opened.done():
            self.opened.set_exception(exc)
        self._head = None
        self.abort()


async def open_socket(url: str, key: str | None, *, subprotocol: str, max_size: int,
                      path: str) -> LeanSocket:
    """Connect and upgrade (the caller bounds it in time).

    Raises:
        OSError: the connection failed. HandshakeRefused, BadHandshake: the upgrade.
    """
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"the lean WebSocket takes an http:// URL, not {url!r}")
    loop = asyncio.get_running_loop()
    host = parts.netloc.rsplit("@", 1)[-1]
    sock = LeanSocket(loop, host, parts.path.rstrip("/") + path, key, subprotocol, max_size)
    await loop.create_connection(lambda: sock, parts.hostname, parts.port or 80)
    try:
        await sock.opened
    except BaseException:
        sock.abort()
        raise
    return sock
