"""uvicorn's protocols with the limits uvicorn does not enforce itself (docs/serve.md "Limits").

`stepd serve` runs uvicorn with these subclasses of its httptools and
websockets-sansio protocols: every HTTP request is answered or closed within
``max_request_ms`` of its first byte (the server's tick expires them), request
heads are bounded (64 KiB, 100 fields), and a WebSocket whose peer does not
read can still be closed.
"""

from __future__ import annotations

import asyncio
import struct
from typing import Any, Protocol, cast

import httptools
from uvicorn.protocols.http.httptools_impl import (
    STATUS_LINE,
    HttpToolsProtocol,
    RequestResponseCycle,
)
from uvicorn.protocols.utils import ClientDisconnected
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from websockets.exceptions import InvalidState
from websockets.protocol import State

try:
    from websockets.speedups import apply_mask
except ImportError:  # pragma: no cover - websockets ships its C speedups on CPython
    from websockets.utils import apply_mask

from ._json import encode_json

__all__ = ["EXCHANGE_EXTENSION", "LINGER_S", "WIRE_EXTENSION", "FrameSink", "HttpExchange",
           "HttpProtocol", "WebSocketProtocol", "http_protocol"]

WIRE_EXTENSION = "stepd.wire"
"""The ASGI scope extension naming the `WebSocketProtocol` under a WebSocket
(``scope["extensions"]["stepd.wire"]["protocol"]``): the app reads and writes
frames through it directly (`WebSocketProtocol.attach`, `send_frames`)."""


EXCHANGE_EXTENSION = "stepd.http"
"""The ASGI scope extension of an HTTP request served by `HttpProtocol`
(``scope["extensions"]["stepd.http"]``): its `HttpExchange`."""


class _Cancellable(Protocol):
    def cancel(self) -> None: ...


class HttpExchange:
    """One request under `HttpProtocol`, for the app to use instead of ASGI's messages.

    Why: ASGI costs a request three awaited messages (the body, the response
    head, the response body) and, for a long-poll, a second task that waits
    for ``http.disconnect``; under uvicorn each message is a dict, a method
    and its checks. The worker's claims and lease calls are most of what the
    daemon serves over HTTP, so they read the body the parser already holds,
    send the whole answer in one write, and are told of a disconnect by the
    protocol itself (`client_gone`, which cancels ``watch``). What the app
    does through ASGI keeps working alongside (a body still streaming, the
    console's files): `HttpExchange` only changes the cycle's state the way
    uvicorn's ``receive`` and ``send`` would.

    Attributes:
        cycle: uvicorn's request-response cycle of this request.
        gone: the client disconnected (or the request's deadline passed).
        watch: cancelled by `client_gone` (the app sets it around a long-poll).
    """

    __slots__ = ("cycle", "gone", "watch")

    def __init__(self, cycle: RequestResponseCycle) -> None:
        self.cycle = cycle
        self.gone = False
        self.watch: _Cancellable | None = None

    def client_gone(self) -> None:
        """The answer can no longer be sent: cancel what the app waits for."""
        self.gone = True
        watch = self.watch
        if watch is not None:
            watch.cancel()

    def take_body(self) -> bytes | None:
        """The whole request body when all of it has arrived and none was read yet, else
        None (stream it with ASGI's ``receive``). Taken once: the cycle's buffer empties."""
        cycle = self.cycle
        if cycle.more_body or cycle.disconnected or cycle.response_complete:
            return None
        body = bytes(cycle.body)
        cycle.body = bytearray()
        return body

    async def respond(self, status: int, head: bytes, body: bytes, *, close: bool = False) -> None:
        """Send the whole answer in one write: the status line, ``head`` (header lines,
        each ending in CRLF; uvicorn's default headers and ``content-length`` are added
        here), and ``body``. What uvicorn's ``send`` does for a response with a
        ``Content-Length``, in one call: a client that went away gets nothing.

        Raises:
            RuntimeError: the response has already begun.
        """
        cycle = self.cycle
        if cycle.flow.write_paused and not cycle.disconnected:
            await cycle.flow.drain()
        if cycle.disconnected:
            return
        if cycle.response_started:
            raise RuntimeError("the response has already begun")
        cycle.response_started = True
        cycle.waiting_for_100_continue = False
        keep_alive = cycle.keep_alive and not close
        defaults = cycle.default_headers
        seen, rendered = _default_heads
        if defaults is not seen:
            rendered = _default_head(defaults)
        parts = [STATUS_LINE[status], rendered, head, b"content-length: %d\r\n" % len(body)]
        if not keep_alive:
            cycle.keep_alive = False
            parts.append(b"connection: close\r\n")
        parts.append(b"\r\n")
        if cycle.scope["method"] != "HEAD":
            parts.append(body)
        transport = cycle.transport
        transport.write(b"".join(parts))
        cycle.response_complete = True
        event = cycle.message_event
        if event._waiters:  # an ASGI receive() waits on it
            event.set()
        if not keep_alive:
            transport.close()
        cycle.on_response()


_default_heads: tuple[list[tuple[bytes, bytes]] | None, bytes] = (None, b"")


def _default_head(headers: list[tuple[bytes, bytes]]) -> bytes:
    """uvicorn's default headers (``date``) as header lines: rendered once per list
    (the server replaces the list when the second turns; `HttpExchange.respond`
    asks only then)."""
    global _default_heads
    rendered = b"".join([b"%s: %s\r\n" % (name.lower(), value) for name, value in headers])
    _default_heads = (headers, rendered)
    return rendered


LINGER_S = 2.0
"""After refusing a request (408, 414, 431, 503 at the deadline), how long the
daemon keeps reading (and dropping) what the client still sends before it aborts.

The answer is sent and the sending side shut (``write_eof``): a client still
sending its head then reads the answer rather than a reset, which closing with
unread input would send.
"""


class _HeadTooLarge(Exception):
    """Raised inside httptools' callbacks: the request's head is over a limit."""


class HttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the limits httptools has not (docs/serve.md "Limits").

    * **A deadline per request.** A request is answered or closed within
      ``max_request_s`` of its first byte (for the first request of a
      connection, of the connection's opening; a pipelined request, of the
      answer before it). The daemon's tick (`_Server.main_loop`) calls
      `expire` on every connection; past the deadline: 408 when the client
      had not sent its whole request (a slow head, a body shorter than its
      ``Content-Length``), 503 when the daemon had not answered it yet, and an
      abort when the client does not read the answer. Cost per request: a
      clock read and a few attribute writes; no timer is armed.
    * **Bounded heads.** At most ``max_head_bytes`` of request line (414) and
      headers (431), at most ``max_headers`` header fields (431). The request
      line is counted as httptools reports it; the headers' names and values,
      and their number, once the head is complete (all at once: one call per
      header, not five); and while a head is incomplete, every chunk received
      that leaves it so (a header that never ends is refused once those pass
      the limit: what is held meanwhile is bounded by them and one read).

    The limits are class attributes: `http_protocol` makes a subclass per
    daemon.
    """

    max_request_s: float = 30.0
    max_head_bytes: int = 64 << 10
    max_headers: int = 100

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.deadline: float | None = None  # of the oldest request not answered (loop clock)
        self._in_head = False
        self._head_size = 0  # bytes of request line and headers httptools reported
        self._head_chunks = 0  # bytes of the chunks received inside a head not complete yet
        self._raw_head: list[bytes] = []  # the head's names and values (`on_header`)
        self._pending = 0  # requests begun (a first byte arrived) and not answered in full
        self._refused = 0  # the status a refusal answered; from then on input is dropped
        self._linger: asyncio.TimerHandle | None = None
        # The request the app is answering. Not uvicorn's `cycle`, which is the
        # last one parsed: with pipelined requests, one queued behind it.
        self._running: RequestResponseCycle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # type: ignore[arg-type]
        self.deadline = self.loop.time() + self.max_request_s

    def connection_lost(self, exc: Exception | None) -> None:
        if self._linger is not None:
            self._linger.cancel()
            self._linger = None
        self.deadline = None
        self._drop_running()  # uvicorn tells only `cycle`, not a request answered before it
        super().connection_lost(exc)

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: Any) -> None:
        self._running = cycle
        super()._start_asgi_task(cycle, app)

    def _drop_running(self) -> None:
        """The app's answer to the request it runs can no longer be sent."""
        running = self._running
        if running is not None and not running.response_complete:
            running.disconnected = True  # its receive() says http.disconnect, its send() returns
            running.message_event.set()
            exchange = cast(dict[str, Any], running.scope).get("extensions", {}).get(
                EXCHANGE_EXTENSION)
            if exchange is not None:
                exchange.client_gone()

    def data_received(self, data: bytes) -> None:
        # uvicorn's, with the refusals of a head over the limits.
        if self._refused:
            return  # lingering after a refusal: what the client still sends is dropped
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return
        except httptools.HttpParserError:
            if self._refused:  # a callback raised _HeadTooLarge
                self._refuse_head()
                return
            msg = "Invalid HTTP request received."
            self.logger.warning(msg)
            self.send_400_response(msg)
            return
        if self._in_head:  # a head still incomplete: its bytes so far are bounded by chunks
            self._head_chunks += len(data)
            if self._head_chunks > self.max_head_bytes:
                self._refused = 431
                self._refuse_head()

    def on_message_begin(self) -> None:
        self._pending += 1
        if self.deadline is None:
            self.deadline = self.loop.time() + self.max_request_s
        self._in_head = True
        self._head_size = self._head_chunks = 0
        self._raw_head = []
        super().on_message_begin()

    def on_url(self, url: bytes) -> None:
        self._head_size += len(url)
        if self._head_size > self.max_head_bytes:
            self._refused = 414
            raise _HeadTooLarge
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        # Names and values as they came; `on_headers_complete` sizes and lowers them
        # all at once (a call per header here instead of five).
        self._raw_head += (name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        raw = self._raw_head
        self._raw_head = []
        self._head_size += sum(map(len, raw))
        if self._head_size > self.max_head_bytes:
            self._refused = 431
            raise _HeadTooLarge
        if len(raw) > 2 * self.max_headers:
            self._refused = 431
            raise _HeadTooLarge
        if raw:
            # A header name is a token (no NUL): one lower() for all of them.
            names = b"\0".join(raw[0::2]).lower().split(b"\0")
            self.headers.extend(zip(names, raw[1::2], strict=True))
            if b"expect" in names:
                for name, value in self.headers:
                    if name == b"expect" and value.lower() == b"100-continue":
                        self.expect_100_continue = True
        cycle = self.cycle
        super().on_headers_complete()
        if self.cycle is not cycle:  # a request (not an upgrade): its task runs after this
            extensions: dict[str, Any] = {EXCHANGE_EXTENSION: HttpExchange(self.cycle)}
            cast(dict[str, Any], self.scope)["extensions"] = extensions

    def on_response_complete(self) -> None:
        self._pending -= 1
        if self._pending or self.transport.get_write_buffer_size():
            # The next request has begun, or this answer is not read yet: both
            # must be done with in time.
            self.deadline = self.loop.time() + self.max_request_s
        else:
            self.deadline = None  # idle: uvicorn's keep-alive timeout closes it
        super().on_response_complete()

    def handle_websocket_upgrade(self) -> None:
        self.deadline = None  # the connection is the worker's WebSocket from now on
        super().handle_websocket_upgrade()

    # -- the deadline ------------------------------------------------------------

    def expire(self, now: float) -> None:
        """Past the deadline: answer what can be answered, and close."""
        deadline = self.deadline
        if deadline is None or now < deadline:
            return
        self.deadline = None
        transport = self.transport
        if self._refused or transport.is_closing():
            transport.abort()  # lingering too long, or a close stuck on a peer that does not read
            return
        running = self._running
        if running is not None and not running.response_complete:
            self._drop_running()
            if running.response_started:  # the client does not read the answer
                transport.abort()
            elif running.more_body:
                self._refuse(408, "timeout", "the request's body did not arrive within "
                             f"max_request_ms ({self.max_request_s * 1000:.0f} ms)")
            else:
                self._refuse(503, "unavailable", "the request was not answered within "
                             f"max_request_ms ({self.max_request_s * 1000:.0f} ms)")
        elif self._pending:
            self._refuse(408, "timeout", "the request's head did not arrive within "
                         f"max_request_ms ({self.max_request_s * 1000:.0f} ms)")
        elif transport.get_write_buffer_size():
            transport.abort()  # an answer the client does not read
        elif running is None:
            transport.close()  # a connection that sent nothing

    def _refuse_head(self) -> None:
        running = self._running
        if running is not None and not running.response_complete:
            # A pipelined head behind a request not answered yet: an answer now
            # would read as that request's. Both end here, without one.
            self._drop_running()
            self.deadline = None
            self.transport.abort()
            return
        if self._refused == 414:
            self._refuse(414, "too_large",
                         f"the request line is over the limit of {self.max_head_bytes} bytes")
        else:
            self._refuse(431, "too_large", "the request's headers are over the limit of "
                         f"{self.max_head_bytes} bytes and {self.max_headers} fields")

    def _refuse(self, status: int, error: str, message: str) -> None:
        """Answer ``status`` and close: shut the sending side, drop what still comes in."""
        self._refused = status
        self.deadline = None
        self._unset_keepalive_if_required()
        body = encode_json({"error": error, "message": message})
        transport = self.transport
        transport.write(b"".join([
            STATUS_LINE[status], b"content-type: application/json\r\n",
            b"content-length: %d\r\n" % len(body), b"connection: close\r\n\r\n", body]))
        if transport.can_write_eof():
            transport.write_eof()
            self._linger = self.loop.call_later(LINGER_S, transport.abort)
        else:
            transport.close()


def http_protocol(*, max_request_ms: int, max_header_bytes: int,
                  max_headers: int) -> type[HttpProtocol]:
    """The HTTP protocol class for uvicorn's ``http=``, with these limits."""
    return type("HttpProtocol", (HttpProtocol,), {
        "max_request_s": max_request_ms / 1000, "max_head_bytes": max_header_bytes,
        "max_headers": max_headers, "__module__": __name__,
    })


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
        if (conn.state is not State.OPEN or conn.parser_exc is not None
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
            if conn.state is not State.OPEN or self.close_sent:
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
        if conn.state is not State.OPEN or conn.expect_continuation_frame or conn.extensions:
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


