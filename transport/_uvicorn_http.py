"""uvicorn's httptools protocol with the limits uvicorn does not enforce itself
(docs/serve.md "Limits"), and the request's `HttpExchange`.

`stepd serve` runs uvicorn with `HttpProtocol` (a subclass per daemon,
`http_protocol`): every HTTP request is answered or closed within
``max_request_ms`` of its first byte (the server's tick expires them), and
request heads are bounded (64 KiB, 100 fields). Each request's ASGI scope
carries an `HttpExchange`, through which the app reads the body the parser
holds and answers in one write. The WebSocket side is `_uvicorn_ws`.
"""

from __future__ import annotations

import asyncio
import contextvars
from typing import Any, Protocol, cast

import httptools
from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT
from uvicorn.protocols.http.httptools_impl import (
    STATUS_LINE,
    HttpToolsProtocol,
    RequestResponseCycle,
)

from ._json import encode_json

__all__ = ["EXCHANGE_EXTENSION", "LINGER_S", "HttpExchange", "HttpProtocol", "http_protocol"]

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
        task: the asyncio task that runs the app for it (the app cancels the call
            through it, `Drain.task_tracking`, without looking it up).
        gone: the client disconnected (or the request's deadline passed).
        watch: cancelled by `client_gone` (the app sets it around a long-poll).
    """

    __slots__ = ("cycle", "gone", "task", "watch")

    def __init__(self, cycle: RequestResponseCycle, task: asyncio.Task[None]) -> None:
        self.cycle = cycle
        self.task = task
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
        # uvicorn's opt-in (newer uvicorns): each request's task in a fresh context.
        self._fresh_context = bool(getattr(self.config, "reset_contextvars", False))

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
        # uvicorn's, written out, and the request's `HttpExchange` made with its task.
        self._running = cycle
        if self._fresh_context:
            task = self.loop.create_task(cycle.run_asgi(app), context=contextvars.Context())
        else:
            task = self.loop.create_task(cycle.run_asgi(app))
        task.add_done_callback(self.tasks.discard)
        self.tasks.add(task)
        scope: dict[str, Any] = cycle.scope  # type: ignore[assignment]
        scope["extensions"] = {EXCHANGE_EXTENSION: HttpExchange(cycle, task)}

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
        idle = self.timeout_keep_alive_task  # uvicorn's `_unset_keepalive_if_required`
        if idle is not None:
            idle.cancel()
            self.timeout_keep_alive_task = None
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
        super().on_headers_complete()  # a request's `HttpExchange`: `_start_asgi_task`

    def on_body(self, body: bytes) -> None:
        # uvicorn's, with the cycle's event set only when something waits on it (an
        # ASGI `receive`): else marked set, which is all `set` does then.
        if self.parser.should_upgrade() and self._should_upgrade():
            return  # an upgrade's head: no cycle (a WebSocket's first request has none)
        cycle = self.cycle
        if cycle.response_complete:
            return
        cycle.body += body
        if len(cycle.body) > HIGH_WATER_LIMIT:
            self.flow.pause_reading()
        event = cycle.message_event
        if event._waiters:
            event.set()
        else:
            event._value = True  # type: ignore[attr-defined]

    def on_message_complete(self) -> None:
        if self.parser.should_upgrade() and self._should_upgrade():
            return  # an upgrade's head: no cycle (a WebSocket's first request has none)
        cycle = self.cycle
        if cycle.response_complete:
            return
        cycle.more_body = False
        event = cycle.message_event
        if event._waiters:
            event.set()
        else:
            event._value = True  # type: ignore[attr-defined]

    def on_response_complete(self) -> None:
        self._pending -= 1
        transport = self.transport
        if self._pending or transport.get_write_buffer_size():
            # The next request has begun, or this answer is not read yet: both
            # must be done with in time.
            self.deadline = self.loop.time() + self.max_request_s
        else:
            self.deadline = None  # idle: uvicorn's keep-alive timeout closes it
        # uvicorn's, written out (it ran three more Python calls an answer).
        self.server_state.total_requests += 1
        if transport.is_closing():
            return
        idle = self.timeout_keep_alive_task
        if idle is not None:
            idle.cancel()
            self.timeout_keep_alive_task = None
        flow = self.flow
        if flow.read_paused:
            flow.resume_reading()
        if self.pipeline:
            cycle, app = self.pipeline.pop()
            self._start_asgi_task(cycle, app)
        else:
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self.timeout_keep_alive_handler)

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
