"""A lean HTTP/1.1 keep-alive client for plain ``http://`` daemons.

Why not httpx here: at 100 requests in flight, httpx costs the calling process
about 1 ms of CPU per request (httpcore's pool re-scans every connection for
every queued request), so a Python process starting runs or long-polling
claims with `stepd.AsyncClient` or an HTTP `stepd.Worker` spent more CPU than
the daemon serving it (bench/README.md "Findings"). This client keeps a stack
of idle keep-alive connections, writes one request per connection at a time
and parses the answer with httptools (the C parser uvicorn uses): about a
quarter of that cost (bench B: the client process's CPU fell from 2.1 s
to 0.5 s for 2,000 requests).

Scope, on purpose: plain ``http://`` only, no proxies, no redirects, JSON in
and out. The SDK keeps httpx for ``https://`` URLs and for proxies read from
the environment (`wants_httpx`). Works on asyncio and on trio (anyio streams).

On asyncio the connections are asyncio protocols (`_AioConn`): the answer is
parsed in ``data_received`` and a future wakes the request, with no lock, no
cancel scope and no stream checkpoints per request (about a tenth of the anyio
streams' calls). On trio (or any other anyio backend) the same client runs on
anyio streams.

Connection reuse: an idle connection older than `IDLE_EXPIRY_S` is closed
rather than reused (uvicorn closes idle keep-alive connections after 5 s). A
request on a *reused* connection that fails before any byte of the answer
arrived is sent once more on a fresh connection: the server closed the idle
connection before reading the request, so the request did not happen.
"""

from __future__ import annotations

import asyncio
import math
import urllib.request
from collections.abc import Coroutine
from typing import Any
from urllib.parse import urlencode, urlsplit

import anyio
import anyio.abc
import httptools

__all__ = ["Http1Client", "Http1Error", "Http1Response", "wants_httpx"]

_running_loop = asyncio._get_running_loop  # None outside asyncio (trio), without raising

IDLE_EXPIRY_S = 4.0
"""An idle keep-alive connection older than this is closed, not reused."""

MAX_HEAD_BYTES = 64 * 1024
_READ_CHUNK = 65536


class Http1Error(Exception):
    """The request did not get an answer: connect failed, the connection broke, or timeout."""


def wants_httpx(url: str, trust_env: bool) -> bool:
    """Whether `url` needs httpx: https, or a proxy from the environment applies."""
    parts = urlsplit(url)
    if parts.scheme != "http":
        return True
    if not trust_env:
        return False
    proxies = urllib.request.getproxies_environment()
    if not (proxies.get("http") or proxies.get("all")):
        return False
    return not urllib.request.proxy_bypass(parts.netloc)  # NO_PROXY (from the environment on Linux)


class Http1Response:
    """What httpx.Response offers the SDK: ``status_code``, ``content``, ``text``, ``json()``."""

    __slots__ = ("content", "keep_alive", "status_code")

    def __init__(self, status_code: int, content: bytes, keep_alive: bool) -> None:
        self.status_code = status_code
        self.content = content
        self.keep_alive = keep_alive

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")

    def json(self) -> Any:
        import json

        return json.loads(self.content)


class _Parse:
    """httptools callbacks: collect the body, note the end of the message.

    No ``on_message_begin``: a callback per answer for nothing; the head is known
    complete once ``status`` is set (`MAX_HEAD_BYTES` bounds what arrives before).
    """

    __slots__ = ("body", "done", "keep_alive", "parser", "status")

    def __init__(self) -> None:
        self.body: list[bytes] = []
        self.done = False
        self.status = 0
        self.keep_alive = False
        self.parser: Any = None

    def on_headers_complete(self) -> None:
        # Read here: after the message the parser has reset for the next one.
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.done = True


class _Conn:
    __slots__ = ("idle_since", "stream")

    def __init__(self, stream: anyio.abc.ByteStream) -> None:
        self.stream = stream
        self.idle_since = 0.0


class _AioConn(asyncio.Protocol):
    """One keep-alive connection on asyncio: the answer is parsed as it arrives."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parse = _Parse()
        self.parser: Any = None
        self.future: asyncio.Future[None] | None = None
        self.got = 0
        self.idle_since = 0.0
        self.closed = False

    def start(self, future: asyncio.Future[None]) -> None:
        parse = self.parse = _Parse()
        self.parser = parse.parser = httptools.HttpResponseParser(parse)
        self.future = future
        self.got = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        future = self.future
        if future is None:  # nothing asked: the server talks out of turn; drop the connection
            self.close()
            return
        self.got += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.future = None
            if not future.done():
                future.set_exception(Http1Error(f"the answer is not HTTP/1.1: {exc}"))
            self.close()
            return
        parse = self.parse
        if parse.done:
            self.future = None
            if not future.done():
                future.set_result(None)
        elif not parse.status and self.got > MAX_HEAD_BYTES:
            self.future = None
            if not future.done():
                future.set_exception(Http1Error("the answer's head is too large"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.transport = None
        future, self.future = self.future, None
        if future is not None and not future.done():
            future.set_exception(_NothingBack() if self.got == 0 else Http1Error(
                f"the connection broke mid-answer: {exc!r}"))

    def close(self) -> None:
        self.closed = True
        transport = self.transport
        if transport is not None:
            transport.close()


def _expire(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_exception(TimeoutError())


class Http1Client:
    """Keep-alive connections to one ``http://host:port``, one request at a time each.

    Args:
        base_url: ``http://host[:port][/prefix]``.
        headers: sent with every request (lower-case names).
        max_connections: connections open at once; a request beyond waits.
    """

    def __init__(self, base_url: str, headers: dict[str, str], *,
                 max_connections: int = 256) -> None:
        parts = urlsplit(base_url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"Http1Client takes an http:// URL, not {base_url!r}")
        self.host = parts.hostname
        self.port = parts.port or 80
        self.prefix = parts.path.rstrip("/")
        host_header = parts.netloc.rsplit("@", 1)[-1]
        fixed = {"host": host_header, **{k.lower(): v for k, v in headers.items()}}
        self._fixed = "".join(f"{k}: {v}\r\n" for k, v in fixed.items())
        self._idle: list[_Conn] = []
        self._slots = anyio.Semaphore(max_connections) if max_connections else None
        self._closed = False
        self._aio_idle: list[_AioConn] = []
        self._aio_busy = 0
        self._aio_max = max_connections or 1 << 30
        self._aio_queue: list[asyncio.Future[None]] = []

    def request(self, method: str, path: str, *, params: dict[str, Any] | None = None,
                content: bytes | None = None, content_type: str = "application/json",
                timeout: float = math.inf) -> Coroutine[Any, Any, Http1Response]:
        """Send one request and return its answer (await it).

        Not a coroutine function itself: it picks the backend's and returns that
        coroutine (a frame fewer to resume on every request).

        Raises:
            Http1Error: no answer (connect refused, connection broken, timeout);
                the client is closed (raised here, before any await).
        """
        if self._closed:
            raise Http1Error("the client is closed")
        target = self.prefix + path
        if params:
            target += "?" + urlencode(params)
        head = f"{method} {target} HTTP/1.1\r\n{self._fixed}"
        if content is not None:
            head += f"content-type: {content_type}\r\ncontent-length: {len(content)}\r\n"
        elif method in ("POST", "PUT", "PATCH"):
            head += "content-length: 0\r\n"
        data = (head + "\r\n").encode("latin-1") + (content or b"")
        loop = _running_loop()
        if loop is not None:
            return self._aio_request(loop, data, timeout, method, path)
        return self._stream_request(data, timeout, method, path)  # trio: anyio streams

    async def _stream_request(self, data: bytes, timeout: float, method: str,
                              path: str) -> Http1Response:
        slots = self._slots
        if slots is not None:
            await slots.acquire()
        try:
            with anyio.fail_after(timeout if timeout != math.inf else None):
                conn, reused = await self._checkout()
                try:
                    return await self._exchange(conn, data)
                except _NothingBack:
                    if not reused:
                        raise Http1Error("the connection closed before an answer") from None
                # The server closed the idle connection before reading: send anew.
                conn, _ = await self._checkout(fresh=True)
                try:
                    return await self._exchange(conn, data)
                except _NothingBack:
                    raise Http1Error("the connection closed before an answer") from None
        except TimeoutError:
            raise Http1Error(f"no answer to {method} {path} within {timeout} s") from None
        finally:
            if slots is not None:
                slots.release()

    # -- asyncio -------------------------------------------------------------------------

    async def _aio_request(self, loop: asyncio.AbstractEventLoop, data: bytes, timeout: float,
                           method: str, path: str) -> Http1Response:
        if self._aio_busy >= self._aio_max:
            waiter = loop.create_future()
            self._aio_queue.append(waiter)
            try:
                await waiter
            except BaseException:
                if waiter in self._aio_queue:
                    self._aio_queue.remove(waiter)
                raise
        self._aio_busy += 1
        expiry = None if timeout == math.inf else loop.time() + timeout
        try:
            # A kept-alive connection without awaiting a checkout (the common case),
            # and the exchange in this frame (a worker's every claim and lease call
            # comes this way; a frame costs a call and a resume). A kept-alive
            # connection the server closed before reading gets the request once
            # more, on a fresh one.
            idle = self._aio_idle_conn(loop) if self._aio_idle else None
            while True:
                if idle is not None:
                    conn, reused, idle = idle, True, None
                else:
                    conn, reused = await self._aio_checkout(loop, expiry, fresh=True)
                future = loop.create_future()
                conn.start(future)
                ok = False
                timer = None if expiry is None else loop.call_at(expiry, _expire, future)
                try:
                    transport = conn.transport
                    if transport is None:
                        raise _NothingBack()
                    transport.write(data)
                    await future
                    parse = conn.parse
                    response = Http1Response(parse.status, b"".join(parse.body),
                                             parse.keep_alive)
                    ok = response.keep_alive
                    return response
                except _NothingBack:
                    if not reused:
                        raise Http1Error("the connection closed before an answer") from None
                finally:
                    if timer is not None:
                        timer.cancel()
                    conn.future = None
                    if ok and not self._closed and not conn.closed:
                        conn.idle_since = loop.time()
                        self._aio_idle.append(conn)
                    else:
                        conn.close()
        except TimeoutError:
            raise Http1Error(f"no answer to {method} {path} within {timeout} s") from None
        finally:
            self._aio_busy -= 1
            queue = self._aio_queue
            while queue:
                waiter = queue.pop(0)
                if not waiter.done():
                    waiter.set_result(None)
                    break

    def _aio_idle_conn(self, loop: asyncio.AbstractEventLoop) -> _AioConn | None:
        """The most recently used idle connection still fresh (older ones are closed)."""
        now = loop.time()
        idle = self._aio_idle
        while idle:
            conn = idle.pop()
            if not conn.closed and now - conn.idle_since < IDLE_EXPIRY_S:
                return conn
            conn.close()
        return None

    async def _aio_checkout(self, loop: asyncio.AbstractEventLoop, expiry: float | None, *,
                            fresh: bool = False) -> tuple[_AioConn, bool]:
        if not fresh:
            kept = self._aio_idle_conn(loop)
            if kept is not None:
                return kept, True
        try:
            connect = loop.create_connection(_AioConn, self.host, self.port)
            if expiry is None:
                _, conn = await connect
            else:
                _, conn = await asyncio.wait_for(connect, max(0.0, expiry - loop.time()))
        except OSError as exc:
            raise Http1Error(f"cannot connect to {self.host}:{self.port}: {exc}") from None
        return conn, False

    async def _checkout(self, *, fresh: bool = False) -> tuple[_Conn, bool]:
        if not fresh:
            now = anyio.current_time()
            while self._idle:
                conn = self._idle.pop()
                if now - conn.idle_since < IDLE_EXPIRY_S:
                    return conn, True
                await _close(conn)
        try:
            stream = await anyio.connect_tcp(self.host, self.port)
        except OSError as exc:
            raise Http1Error(f"cannot connect to {self.host}:{self.port}: {exc}") from None
        return _Conn(stream), False

    async def _exchange(self, conn: _Conn, data: bytes) -> Http1Response:
        """Write the request, read the answer; the connection goes back idle or is closed."""
        parse = _Parse()
        parser = parse.parser = httptools.HttpResponseParser(parse)
        ok = False
        got = 0
        try:
            try:
                await conn.stream.send(data)
                while not parse.done:
                    chunk = await conn.stream.receive(_READ_CHUNK)
                    got += len(chunk)
                    parser.feed_data(chunk)
                    if not parse.status and got > MAX_HEAD_BYTES:
                        raise Http1Error("the answer's head is too large")
            except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError,
                    OSError) as exc:
                if got == 0:
                    raise _NothingBack() from None
                raise Http1Error(f"the connection broke mid-answer: {exc!r}") from None
            except httptools.HttpParserError as exc:
                raise Http1Error(f"the answer is not HTTP/1.1: {exc}") from None
            response = Http1Response(parse.status, b"".join(parse.body), parse.keep_alive)
            ok = response.keep_alive
            return response
        finally:
            if ok and not self._closed:
                conn.idle_since = anyio.current_time()
                self._idle.append(conn)
            else:
                await _close(conn)

    async def aclose(self) -> None:
        """Close every idle connection; requests in flight close theirs as they end."""
        self._closed = True
        idle, self._idle = self._idle, []
        for conn in idle:
            await _close(conn)
        aio, self._aio_idle = self._aio_idle, []
        for aio_conn in aio:
            aio_conn.close()


class _NothingBack(Exception):
    """The connection ended before any byte of the answer."""


async def _close(conn: _Conn) -> None:
    with anyio.CancelScope(shield=True):
        try:
            await conn.stream.aclose()
        except (OSError, anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass
