"""uvicorn's websockets-sansio protocol, able to close a peer that does not read,
and handing the worker WebSocket's frames to the app without a queue.

`stepd serve` runs uvicorn with `WebSocketProtocol` (docs/serve.md "Limits"):
a ``websocket.close`` goes out even while the peer does not read, and the
frames of one read reach the app's `FrameSink` in one call, parsed here
(whole data frames) or by websockets (everything else). The HTTP side is
`_uvicorn_http`.
"""

from __future__ import annotations

import struct
from typing import Any, Protocol, cast

from uvicorn.protocols.utils import ClientDisconnected
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from websockets.exceptions import InvalidState
from websockets.protocol import State

try:
    from websockets.speedups import apply_mask
except ImportError:  # pragma: no cover - websockets ships its C speedups on CPython
    from websockets.utils import apply_mask

__all__ = ["WIRE_EXTENSION", "FrameSink", "WebSocketProtocol"]

WIRE_EXTENSION = "stepd.wire"
"""The ASGI scope extension naming the `WebSocketProtocol` under a WebSocket
(``scope["extensions"]["stepd.wire"]["protocol"]``): the app reads and writes
frames through it directly (`WebSocketProtocol.attach`, `send_frames`)."""


_FAST_PARTIAL_MAX = 64 << 10
"""A frame split across reads is buffered by the fast path up to this size;
a larger one goes to websockets' parser (which reads it without copying it
again on every read)."""

# The heads of unmasked final frames under 126 bytes: [text (0x81), binary (0x82)][length].
_SMALL_HEADS: tuple[list[bytes], list[bytes]] = (
    [bytes((0x82, n)) for n in range(126)], [bytes((0x81, n)) for n in range(126)])


class FrameSink(Protocol):
    """Where a `WebSocketProtocol` hands the messages it parses once attached."""

    def frames_received(self, frames: list[bytes | str]) -> None:
        """The whole messages of one read of the socket, in order (bytes: binary, str: text)."""

    def peer_closed(self) -> None:
        """The connection is over (the peer closed, vanished, or the server is stopping)."""


class _Relay:
    """Stands in for uvicorn's receive queue once a sink is attached: the only
    messages uvicorn still puts there are disconnects, which end the sink."""

    __slots__ = ("_wire",)

    def __init__(self, wire: WebSocketProtocol) -> None:
        self._wire = wire

    def put_nowait(self, message: Any) -> None:
        self._wire._relay_disconnect()

    def empty(self) -> bool:
        return True


class WebSocketProtocol(WebSocketsSansIOProtocol):
    """uvicorn's sans-I/O WebSocket protocol, able to close a peer that does not read.

    uvicorn's ``send`` first waits for the transport to drain, a close frame
    included: a connection whose peer never reads could not be closed, and
    its close timer (and its keepalive timeout) calls ``close()``, which waits
    for the buffer to flush, forever. Here a ``websocket.close`` sent while
    writing is paused goes out behind what waits, and the connection is
    aborted if the peer has not answered it within the close timeout; a
    keepalive timeout with unsent data aborts at once.

    **Frames without the receive queue.** uvicorn hands each message to the
    app through an `asyncio.Queue` (a task switch per message before the app
    sees it) and pauses reading after every one until the app took it. The
    worker WebSocket instead `attach`-es a `FrameSink`: every whole message of
    one read goes to it in one call, inside ``data_received`` (no queue, no
    task switch), so frames that arrive together are applied together. The
    sink keeps backpressure itself (`pause_reading` while its frames wait;
    what one read can hold is bounded by the read size and ``ws_max_size``).
    Answers go out through `send_frames`: several frames, one socket write.

    Attributes:
        data_writes: socket writes that carried frames sent by `send_frames`.
        frames_sent: frames sent by `send_frames`.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._sink: FrameSink | None = None
        self._received: list[bytes | str] = []  # the messages of the read being parsed
        self._fast = False  # whole data frames are parsed here, not by websockets (`_read_fast`)
        self._buf = b""  # the fast path's partial frame (starts at a frame boundary)
        self._sink_closed = False
        self.data_writes = 0
        self.frames_sent = 0

    def handle_connect(self, event: Any) -> None:
        super().handle_connect(event)
        scope = getattr(self, "scope", None)
        if scope is not None:
            cast(dict[str, Any], scope["extensions"])[WIRE_EXTENSION] = {"protocol": self}

    # -- the sink (frames read in the protocol callback) ---------------------------------

    def attach(self, sink: FrameSink) -> None:
        """From now on hand messages to `sink`, not to the receive queue.

        What the queue already holds (frames sent right behind the upgrade, a
        disconnect) goes to the sink first, in order.
        """
        queued: list[bytes | str] = []
        gone = False
        queue = self.queue
        while not queue.empty():
            message = queue.get_nowait()
            if message["type"] == "websocket.receive":
                data = message.get("bytes")
                queued.append(data if data is not None else message.get("text") or "")
            elif message["type"] == "websocket.disconnect":
                gone = True
        self._sink = sink
        self.queue = _Relay(self)  # type: ignore[assignment]
        self._fast = self._parser_idle()
        if queued:
            sink.frames_received(queued)
        if gone:
            self._relay_disconnect()
        elif self.read_paused and not self.close_sent:
            self.resume_reading()  # uvicorn paused after a message; the sink decides now

    def pause_reading(self) -> None:
        """The sink's frames wait: stop reading (TCP pushes back on the peer)."""
        if not self.read_paused:
            self.read_paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.read_paused:
            self.read_paused = False
            self.transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        if self._fast:
            self._read_fast(data)
        else:
            super().data_received(data)
            if self._sink is not None and self._parser_idle():
                self._fast = True
        received = self._received
        if received:
            self._received = []
            sink = self._sink
            if sink is not None:
                sink.frames_received(received)

    # -- the fast path: whole data frames without websockets' parser -----------------

    def _parser_idle(self) -> bool:
        """websockets' parser waits at a frame boundary with nothing buffered, the
        connection open, no fragmented message begun: the fast path may take over.

        At a boundary the parser is suspended in its reader's ``at_eof`` (inside a
        frame, in ``read_exact``): read off the generators' ``gi_yieldfrom`` chain,
        and False (the slow path, always correct) whenever that cannot be told.
        """
        conn = self.conn
        # `conn._state`: what websockets' `state` property returns, read without its
        # call (three a step); this module already works on the parser's internals.
        if (conn._state is not State.OPEN or conn.parser_exc is not None
                or conn.current_size is not None or conn.reader.buffer or self.close_sent):
            return False
        inner = conn.parser  # ServerProtocol.parse -> Protocol.parse -> the reader's wait
        for _ in range(4):
            outer = getattr(inner, "gi_yieldfrom", None)
            if outer is None:
                break
            inner = outer
        return getattr(getattr(inner, "gi_code", None), "co_name", None) == "at_eof"

    def _read_fast(self, data: bytes) -> None:
        """Parse the whole data frames of `data` here (RFC 6455 5.2: final, masked,
        text or binary, no extension bits, within ``ws_max_size``); hand every
        other frame to websockets whole, so its parser stays at a frame boundary
        (control frames, fragments). A frame it must refuse (unmasked, reserved
        bits, too big), a large frame split across reads, or a connection that
        is closing: websockets takes the rest of the stream from that boundary.

        Cost: a few slices and a C unmask per frame, against websockets'
        generator parser (~20 calls a frame).
        """
        buf = self._buf + data if self._buf else data
        n = len(buf)
        pos = 0
        conn = self.conn
        max_size = conn.max_message_size
        received = self._received
        handoff = False  # what is left goes to websockets
        while n - pos >= 2:
            if conn._state is not State.OPEN or self.close_sent:
                handoff = True  # closing: websockets reads the rest
                break
            b0 = buf[pos]
            b1 = buf[pos + 1]
            length = b1 & 0x7F
            head = pos + 2
            if length == 126:
                if n - pos < 4:
                    break
                length = int.from_bytes(buf[pos + 2:pos + 4], "big")
                head = pos + 4
            elif length == 127:
                if n - pos < 10:
                    break
                length = int.from_bytes(buf[pos + 2:pos + 10], "big")
                head = pos + 10
            if not b1 & 0x80 or (max_size is not None and length > max_size):
                handoff = True  # unmasked or too big: websockets refuses it (1002, 1009)
                break
            end = head + 4 + length
            if end > n:
                handoff = end - pos > _FAST_PARTIAL_MAX  # a large split frame: websockets'
                break
            if (b0 == 0x82 or b0 == 0x81) and conn.current_size is None:
                payload = apply_mask(buf[head + 4:end], buf[head:head + 4])
                if b0 == 0x82:
                    received.append(payload)
                    pos = end
                    continue
                try:
                    received.append(payload.decode())
                    pos = end
                    continue
                except UnicodeDecodeError:
                    pass  # websockets and uvicorn refuse it (1007)
            # A control frame, a fragment, reserved bits: websockets handles it, whole.
            if not self._feed(buf[pos:end]):
                self._buf = b""
                self._fast = False
                return
            pos = end
        if not handoff:
            self._buf = buf[pos:] if pos < n else b""  # a partial frame, at a boundary
            return
        self._buf = b""
        self._fast = False
        if self._feed(buf[pos:]) and self._parser_idle():
            self._fast = True

    def _feed(self, chunk: bytes) -> bool:
        """uvicorn's ``data_received`` for `chunk`; False once the parser failed."""
        self.conn.receive_data(chunk)
        if self.conn.parser_exc is not None:
            self.handle_parser_exception()
            return False
        self.handle_events()
        return True

    def send_receive_event_to_app(self) -> None:
        if self._sink is None:
            super().send_receive_event_to_app()
            return
        frames = self.frames
        data = frames[0] if len(frames) == 1 else b"".join(frames)
        self.frames = []
        if self.close_sent:
            return  # past our close: dropped, reading goes on until the peer's close
        if self.curr_msg_data_type == "text":
            try:
                self._received.append(data.decode())
            except UnicodeDecodeError:
                self.logger.warning("Invalid UTF-8 sequence received from client.")
                self.conn.send_close(1007)
                self.handle_parser_exception()
        else:
            self._received.append(data)

    def _relay_disconnect(self) -> None:
        """A disconnect (uvicorn put it in its queue): the frames parsed before it, then the end."""
        received = self._received
        sink = self._sink
        if received:
            self._received = []
            if sink is not None:
                sink.frames_received(received)
        if sink is not None and not self._sink_closed:
            self._sink_closed = True
            sink.peer_closed()

    def send_frames(self, frames: list[bytes | str]) -> None:
        """Send data frames (bytes: binary, str: text) in one socket write.

        The caller waits for ``writable`` first (the transport's buffer is
        bounded by it, as uvicorn's ``send`` does).

        Raises:
            ClientDisconnected: the connection is gone or closing.
        """
        if self.disconnected or self.close_sent:
            raise ClientDisconnected()
        conn = self.conn
        if conn._state is not State.OPEN or conn.expect_continuation_frame or conn.extensions:
            raise ClientDisconnected()  # closing (no extension is ever negotiated here)
        # Server frames are not masked: a head and the payload. Written here rather
        # than by websockets' `send_binary` (a Frame, its checks and serialisation:
        # ~10 calls a frame); its state above is what would refuse one.
        parts: list[bytes] = []
        for frame in frames:
            binary = type(frame) is bytes
            data: bytes = frame if binary else frame.encode()  # type: ignore[assignment,union-attr]
            n = len(data)
            if n < 126:
                parts += (_SMALL_HEADS[not binary][n], data)
            else:
                opcode = 0x82 if binary else 0x81
                parts += (struct.pack("!BBH", opcode, 126, n) if n < 65536 else
                          struct.pack("!BBQ", opcode, 127, n), data)
        self.transport.write(b"".join(parts))
        self.data_writes += 1
        self.frames_sent += len(frames)

    async def send(self, message: Any) -> None:
        if (message["type"] == "websocket.close" and not self.writable.is_set()
                and self.handshake_complete and self.initial_response is None
                and not self.close_sent and not self.disconnected):
            code = message.get("code", 1000)
            reason = message.get("reason", "") or ""
            try:
                self.conn.send_close(code, reason)
            except InvalidState:
                raise ClientDisconnected() from None
            self.queue.put_nowait({"type": "websocket.disconnect", "code": code, "reason": reason})
            self.transport.write(b"".join(self.conn.data_to_send()))
            self.close_sent = True
            if self.read_paused:
                self.read_paused = False
                self.transport.resume_reading()
            self.close_timer = self.loop.call_later(self.close_timeout, self.transport.abort)
            return
        await super().send(message)

    def keepalive_timeout(self) -> None:
        super().keepalive_timeout()
        if self.transport.get_write_buffer_size():
            self.transport.abort()
