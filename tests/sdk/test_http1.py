"""`stepd._http1`, the lean HTTP/1.1 client, against real sockets on 127.0.0.1.

The servers here are small anyio TCP listeners that answer by hand, so each
test can make the connection do what a real server does at its edges: keep
it alive, close it while idle, answer chunked, close after answering, break
mid-answer, or never answer. Both anyio backends.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.abc
import pytest
from anyio.streams.buffered import BufferedByteReceiveStream

from stepd import _http1
from stepd._http1 import Http1Client, Http1Error, wants_httpx

pytestmark = pytest.mark.timeout(30)

Handler = Callable[[anyio.abc.SocketStream, BufferedByteReceiveStream, "Server"], Awaitable[None]]


class Server:
    def __init__(self) -> None:
        self.connections = 0
        self.requests: list[bytes] = []
        self.port = 0


async def read_request(buffered: BufferedByteReceiveStream, server: Server) -> bytes:
    head = await buffered.receive_until(b"\r\n\r\n", 65536)
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    body = await buffered.receive_exactly(length) if length else b""
    server.requests.append(head + b"\r\n\r\n" + body)
    return body


def answer(body: bytes, *, status: str = "200 OK", extra: str = "") -> bytes:
    return (f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n{extra}\r\n").encode() + body


@asynccontextmanager
async def serving(handler: Handler) -> AsyncIterator[Server]:
    server = Server()
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    server.port = listener.extra(anyio.abc.SocketAttribute.local_port)

    async def one(stream: anyio.abc.SocketStream) -> None:
        server.connections += 1
        async with stream:
            try:
                await handler(stream, BufferedByteReceiveStream(stream), server)
            except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError):
                pass

    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, one)
        try:
            yield server
        finally:
            tg.cancel_scope.cancel()


async def keep_alive(stream: anyio.abc.SocketStream, buffered: BufferedByteReceiveStream,
                     server: Server) -> None:
    while True:
        body = await read_request(buffered, server)
        await stream.send(answer(b'{"echo":' + (body or b"null") + b"}"))


def client(server: Server, **kw: Any) -> Http1Client:
    return Http1Client(f"http://127.0.0.1:{server.port}", {"authorization": "Bearer k"}, **kw)


async def test_requests_share_one_kept_alive_connection(anyio_backend: Any) -> None:
    async with serving(keep_alive) as server:
        http = client(server)
        for i in range(5):
            r = await http.request("POST", "/v1/x", params={"a": i}, content=b'{"i":%d}' % i)
            assert r.status_code == 200 and r.json() == {"echo": {"i": i}}
        await http.aclose()
    assert server.connections == 1
    first = server.requests[0]
    assert first.startswith(b"POST /v1/x?a=0 HTTP/1.1\r\n")
    assert b"authorization: Bearer k\r\n" in first and b"content-length: 7\r\n" in first


async def test_concurrent_requests_open_connections_up_to_the_limit(anyio_backend: Any) -> None:
    async with serving(keep_alive) as server:
        http = client(server, max_connections=3)
        out: list[Any] = []

        async def one(i: int) -> None:
            out.append((await http.request("GET", f"/n/{i}")).json())

        async with anyio.create_task_group() as tg:
            for i in range(12):
                tg.start_soon(one, i)
        await http.aclose()
    assert len(out) == 12 and all(o == {"echo": None} for o in out)
    assert 1 <= server.connections <= 3


async def test_a_connection_closed_while_idle_is_replaced_and_the_request_sent_once(
        anyio_backend: Any) -> None:
    async def one_request_then_close(stream: anyio.abc.SocketStream,
                                     buffered: BufferedByteReceiveStream, server: Server) -> None:
        await read_request(buffered, server)
        await stream.send(answer(b"{}"))  # keep-alive promised, then closed while idle

    async with serving(one_request_then_close) as server:
        http = client(server)
        assert (await http.request("GET", "/a")).status_code == 200
        await anyio.sleep(0.05)  # the server's close reaches us
        assert (await http.request("POST", "/b", content=b"{}")).status_code == 200
        await http.aclose()
    assert server.connections == 2
    assert [r.split(b" ")[1] for r in server.requests] == [b"/a", b"/b"]


async def test_an_idle_connection_past_expiry_is_not_reused(
        anyio_backend: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_http1, "IDLE_EXPIRY_S", 0.0)
    async with serving(keep_alive) as server:
        http = client(server)
        await http.request("GET", "/a")
        await http.request("GET", "/b")
        await http.aclose()
    assert server.connections == 2


async def test_chunked_and_connection_close_answers(anyio_backend: Any) -> None:
    async def chunked_then_close(stream: anyio.abc.SocketStream,
                                 buffered: BufferedByteReceiveStream, server: Server) -> None:
        await read_request(buffered, server)
        await stream.send(b"HTTP/1.1 201 Created\r\ntransfer-encoding: chunked\r\n\r\n"
                          b"4\r\n{\"a\"\r\n3\r\n:1}\r\n0\r\n\r\n")
        await read_request(buffered, server)
        await stream.send(answer(b'{"b":2}', status="404 Not Found", extra="connection: close\r\n"))

    async with serving(chunked_then_close) as server:
        http = client(server)
        r = await http.request("GET", "/a")
        assert (r.status_code, r.json(), r.keep_alive) == (201, {"a": 1}, True)
        r = await http.request("GET", "/b")
        assert (r.status_code, r.json(), r.keep_alive) == (404, {"b": 2}, False)
        r = await http.request("GET", "/c")  # a new connection: the last one was closed
        assert r.status_code == 201
        await http.aclose()
    assert server.connections == 2


async def test_no_answer_in_time_is_an_error_and_the_connection_is_dropped(
        anyio_backend: Any) -> None:
    async def silent(stream: anyio.abc.SocketStream, buffered: BufferedByteReceiveStream,
                     server: Server) -> None:
        await read_request(buffered, server)
        await anyio.sleep_forever()  # never answers; the client gives up first

    async with serving(silent) as server:
        http = client(server)
        with pytest.raises(Http1Error, match="within 0.1 s"):
            await http.request("GET", "/slow", timeout=0.1)
        assert http._idle == [] and http._aio_idle == []
        await http.aclose()


async def test_a_fresh_connection_closed_without_an_answer_is_not_resent(
        anyio_backend: Any) -> None:
    async def hang_up(stream: anyio.abc.SocketStream, buffered: BufferedByteReceiveStream,
                      server: Server) -> None:
        await read_request(buffered, server)

    async with serving(hang_up) as server:
        http = client(server)
        with pytest.raises(Http1Error, match="closed before an answer"):
            await http.request("POST", "/start", content=b"{}")
        await http.aclose()
    assert len(server.requests) == 1  # a request that may have happened is never repeated


async def test_an_answer_broken_midway_is_an_error(anyio_backend: Any) -> None:
    async def half(stream: anyio.abc.SocketStream, buffered: BufferedByteReceiveStream,
                   server: Server) -> None:
        await read_request(buffered, server)
        await stream.send(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n{\"par")

    async with serving(half) as server:
        http = client(server)
        with pytest.raises(Http1Error, match="mid-answer"):
            await http.request("GET", "/a")
        await http.aclose()
    assert len(server.requests) == 1


async def test_a_refused_connection_is_an_error(anyio_backend: Any) -> None:
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    await listener.aclose()  # nothing listens there now
    http = Http1Client(f"http://127.0.0.1:{port}", {})
    with pytest.raises(Http1Error, match="cannot connect"):
        await http.request("GET", "/healthz")
    await http.aclose()


def test_which_urls_need_httpx(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY", "no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    assert wants_httpx("https://daemon:7707", trust_env=False)
    assert not wants_httpx("http://127.0.0.1:7707", trust_env=True)
    monkeypatch.setenv("HTTP_PROXY", "http://proxy:3128")
    assert wants_httpx("http://daemon:7707", trust_env=True)
    assert not wants_httpx("http://daemon:7707", trust_env=False)
    monkeypatch.setenv("NO_PROXY", "daemon")
    assert not wants_httpx("http://daemon:7707", trust_env=True)
    with pytest.raises(ValueError, match="http:// URL"):
        Http1Client("https://daemon:7707", {})
