"""The worker WebSocket (PROTOCOL.md "WebSocket transport"): msgpack frames, push, credit.

The worker grants credit as slots free (``credit = free slots``, `Credit`);
leases and ``cancel`` pushes arrive as frames; requests carry an id the answer
echoes. A frame is sent at once (`WebSocketChannel.send_soon`: no task, no
wait) and its answer is delivered to a callback or to the one waiting call.

Two connections underneath, with one interface (``send(bytes)`` never blocks):

* `_LeanConnection`: `stepd.channels._wsproto.LeanSocket`, on asyncio for plain
  ``ws://`` without a proxy (the default); frames are dispatched in
  ``data_received``;
* `_LibraryConnection`: the ``websockets`` library (``websockets.asyncio``, or
  ``websockets.trio`` with websockets >= 17) for trio, ``wss://`` and proxies:
  a reader task and a writer task (fed by a queue) per connection.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import msgpack  # type: ignore[import-untyped]  # no stubs published

from stepd._errors import error_from_answer
from stepd.actors import Waiter
from stepd.channels import (
    Channel,
    Credit,
    Deliver,
    Host,
    Lost,
    Refused,
    Unencodable,
    frame_error,
)
from stepd.channels._wsproto import BadHandshake, HandshakeRefused, open_socket

__all__ = ["WebSocketChannel", "classify_handshake_error", "connect", "websocket_url"]

log = logging.getLogger("stepd.worker")

MSGPACK_SUBPROTOCOL = "stepd.v1.msgpack"
WS_MAX_SIZE = 64 << 20
CONNECT_PATH = "/v1/api/workers/connect"

_PACKER = msgpack.Packer(use_bin_type=True, autoreset=True)
_unpackb = msgpack.unpackb
_InvalidState = asyncio.InvalidStateError


def _pack(frame: dict[str, Any]) -> bytes:
    try:
        return _PACKER.pack(frame)  # type: ignore[no-any-return]
    except (TypeError, ValueError, OverflowError) as exc:
        _PACKER.reset()
        raise Unencodable(str(exc)) from None


def websocket_url(url: str) -> str:
    if url.startswith("https://"):
        base = "wss://" + url[len("https://"):]
    else:
        base = "ws://" + url[len("http://"):]
    return base + CONNECT_PATH


def _refusal(status: int, body: bytes) -> BaseException:
    """401/403/503: the typed answer (fatal, fatal, retry); anything else: fall back to HTTP."""
    if status in (401, 403, 503):
        try:
            parsed = json.loads(body or b"{}")
        except ValueError:
            parsed = {}
        return error_from_answer(status, parsed if isinstance(parsed, dict) else {})
    return Refused(f"the WebSocket upgrade was answered {status}")


def classify_handshake_error(exc: BaseException) -> BaseException:
    """What a failed WebSocket handshake means for the worker.

    Returns:
        `Unauthorized`/`Forbidden` (401/403: fatal), `Unavailable` (503: retry),
        `Refused` (any other refusal: fall back to HTTP), or `Lost` (the
        network: retry).
    """
    if isinstance(exc, HandshakeRefused):
        return _refusal(exc.status, exc.body)
    if isinstance(exc, BadHandshake):
        return Refused(f"the WebSocket handshake was refused: {exc}")
    try:
        from websockets.exceptions import InvalidHandshake, InvalidMessage, InvalidStatus
    except ImportError:  # pragma: no cover - websockets is a dependency
        return Lost(f"cannot open the WebSocket: {exc!r}")
    if isinstance(exc, InvalidStatus):
        return _refusal(exc.response.status_code, bytes(exc.response.body or b""))
    if isinstance(exc, InvalidMessage):
        return Lost(f"the WebSocket handshake failed: {exc!r}")
    if isinstance(exc, InvalidHandshake):
        return Refused(f"the WebSocket handshake was refused: {exc!r}")
    return Lost(f"cannot open the WebSocket: {exc!r}")


# --------------------------------------------------------------------------- connections


class _LeanConnection:
    """`LeanSocket` under the channel (asyncio, plain ws://)."""

    lean = True

    def __init__(self, sock: Any) -> None:
        self.sock = sock

    def attach(self, channel: WebSocketChannel) -> None:
        self.sock.on_message = channel._on_message
        self.sock.on_close = channel._on_close

    def send(self, data: bytes) -> bool:
        return self.sock.send(data)  # type: ignore[no-any-return]

    async def drain(self) -> None:
        if self.sock.paused:
            await self.sock.drain()

    def close(self, reason: str) -> None:
        self.sock.close(1000, reason)

    async def run(self) -> None:
        """The keepalive (frames are read by the socket's protocol)."""
        await self.sock.keepalive()


class _LibraryConnection:
    """The ``websockets`` library's connection: a reader and a writer task (`run`)."""

    lean = False

    def __init__(self, ws: Any) -> None:
        self.ws = ws
        self._out: collections.deque[bytes | None] = collections.deque()
        self._wake = Waiter()
        self._channel: WebSocketChannel | None = None
        self._closing = False

    def attach(self, channel: WebSocketChannel) -> None:
        self._channel = channel

    def send(self, data: bytes) -> bool:
        if self._closing:
            return False
        self._out.append(data)
        self._wake.set()
        return True

    async def drain(self) -> None:
        pass

    def close(self, reason: str) -> None:
        if not self._closing:
            self._closing = True
            self._out.append(None)  # the writer closes once what was queued is sent
            self._wake.set()

    async def run(self) -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._writer)
            await self._reader()
            tg.cancel_scope.cancel()

    async def _writer(self) -> None:
        from websockets.exceptions import ConnectionClosed

        out = self._out
        try:
            while True:
                while out:
                    data = out.popleft()
                    if data is None:
                        close = getattr(self.ws, "close", None) or self.ws.aclose  # asyncio | trio
                        await close(1000, "the worker is stopping")
                        return
                    await self.ws.send(data)
                self._wake = wake = Waiter()
                if not out:
                    await wake.wait()
        except ConnectionClosed:
            pass  # the reader sees the close

    async def _reader(self) -> None:
        from websockets.exceptions import ConnectionClosed

        channel = self._channel
        assert channel is not None
        try:
            async for data in self.ws:
                if isinstance(data, str):
                    channel._on_message(data.encode(), False)
                else:
                    channel._on_message(bytes(data), True)
        except ConnectionClosed:
            pass
        finally:
            channel._on_close()


@asynccontextmanager
async def connect(url: str, key: str | None, *, trust_env: bool, open_timeout: float,
                  lean: bool, trio: bool) -> AsyncIterator[WebSocketChannel]:
    """Open the worker socket; yields its channel, closes it on the way out.

    Raises:
        `Unauthorized`/`Forbidden`, `Unavailable`, `Refused` or `Lost`
        (`classify_handshake_error`); `Lost` once the socket failed after opening.
    """
    if lean:
        try:
            with anyio.fail_after(open_timeout):
                sock = await open_socket(url, key, subprotocol=MSGPACK_SUBPROTOCOL,
                                         max_size=WS_MAX_SIZE, path=CONNECT_PATH)
        except (OSError, TimeoutError, HandshakeRefused, BadHandshake) as exc:
            raise classify_handshake_error(exc) from exc
        channel = WebSocketChannel(_LeanConnection(sock))
        try:
            yield channel
        finally:
            sock.close(1000, "")
            if not sock.closed.done():
                with anyio.move_on_after(1.0, shield=True):
                    await asyncio.shield(sock.closed)
            sock.abort()
        return
    from websockets.exceptions import WebSocketException

    if trio:
        from websockets.trio.client import connect as ws_connect
    else:
        from websockets.asyncio.client import connect as ws_connect  # type: ignore[assignment]
    headers = {"Authorization": f"Bearer {key}"} if key is not None else None
    entered = False
    try:
        async with ws_connect(
            websocket_url(url), subprotocols=[MSGPACK_SUBPROTOCOL],  # type: ignore[list-item]
            additional_headers=headers, compression=None, max_size=WS_MAX_SIZE,
            open_timeout=open_timeout, proxy=True if trust_env else None,
            user_agent_header="stepd-python",
        ) as ws:
            entered = True
            conn = _LibraryConnection(ws)
            channel = WebSocketChannel(conn)
            async with anyio.create_task_group() as tg:
                tg.start_soon(conn.run)  # the reader and the writer, from register on
                yield channel
                tg.cancel_scope.cancel()
    except (OSError, TimeoutError, WebSocketException) as exc:
        if not entered:
            raise classify_handshake_error(exc) from exc
        raise Lost(f"the WebSocket failed: {exc!r}") from exc


# --------------------------------------------------------------------------- the channel


class _Answer:
    """One awaited answer where there is no asyncio future (trio)."""

    __slots__ = ("frame", "waiter")

    def __init__(self) -> None:
        self.frame: dict[str, Any] | None = None
        self.waiter = Waiter()

    def __call__(self, frame: dict[str, Any] | None) -> None:
        self.frame = frame
        self.waiter.set()


class WebSocketChannel(Channel):
    """The worker WebSocket (msgpack frames)."""

    kind = "websocket"
    ordered = True

    def __init__(self, conn: _LeanConnection | _LibraryConnection) -> None:
        self._conn = conn
        self._next_id = 0
        self._pending: dict[int, Deliver] = {}
        self._closed = False
        self._ended = False
        self._done = Waiter()
        self._host: Host | None = None
        self._credit: Credit | None = None
        self._granted = False
        self._loop: asyncio.AbstractEventLoop | None = None
        try:
            self._loop = asyncio.get_running_loop()
        except RuntimeError:  # trio
            pass
        conn.attach(self)

    # -- requests ----------------------------------------------------------------------

    def _send(self, frame: dict[str, Any], deliver: Deliver) -> None:
        if self._closed:
            raise Lost("the WebSocket is closed")
        data = _pack(frame)
        if not self._conn.send(data):
            raise Lost("the WebSocket is closing")
        self._pending[frame["id"]] = deliver

    async def _request(self, frame: dict[str, Any]) -> dict[str, Any]:
        loop = self._loop
        if loop is not None:
            future = loop.create_future()
            self._send(frame, future.set_result)
            if self._conn.lean:
                await self._conn.drain()
            answer = await future
        else:
            waiter = _Answer()
            self._send(frame, waiter)
            await waiter.waiter.wait()
            answer = waiter.frame
        if answer is None:
            raise Lost("the WebSocket closed before the answer")
        op = answer["op"]
        if op == "ok" or op == "registered":
            return answer  # type: ignore[no-any-return]  # (with its "op" and "id": unread)
        raise frame_error(answer)

    async def register(self, body: dict[str, Any]) -> dict[str, Any]:
        self._next_id += 1
        return await self._request({"op": "register", "id": self._next_id, **body})

    async def call(self, op: str, lease_id: str, body: dict[str, Any]) -> dict[str, Any]:
        frame_id = self._next_id = self._next_id + 1
        return await self._request({"op": op, "id": frame_id, "lease_id": lease_id, **body})

    async def session_call(self, op: str, session_id: str, body: dict[str, Any]) -> dict[str, Any]:
        frame_id = self._next_id = self._next_id + 1
        return await self._request({"op": op, "id": frame_id, "session_id": session_id, **body})

    def send_soon(self, op: str, lease_id: str, body: dict[str, Any], deliver: Deliver) -> None:
        frame_id = self._next_id = self._next_id + 1
        self._send({"op": op, "id": frame_id, "lease_id": lease_id, **body}, deliver)

    # -- frames in ---------------------------------------------------------------------

    def _on_message(self, payload: bytes, binary: bool) -> None:
        try:
            frame = _unpackb(payload) if binary else json.loads(payload)
        except (ValueError, msgpack.UnpackException) as exc:
            log.error("the daemon sent a frame that does not decode: %r", exc)
            return
        try:
            op = frame["op"]
        except (KeyError, TypeError):
            log.error("the daemon sent a frame that is not a map with an op: %r", frame)
            return
        if op == "lease":
            host = self._host
            if host is not None and not self._ended:
                credit = self._credit
                if credit is not None:
                    credit.used()
                host.accept(frame["lease"])
            return
        if op == "cancel":
            host = self._host
            if host is not None:
                host.on_cancel(str(frame.get("lease_id")), str(frame.get("reason")))
            return
        try:
            deliver = self._pending.pop(frame["id"])
        except (KeyError, TypeError):
            deliver = None
        if deliver is not None:
            try:
                deliver(frame)
            except _InvalidState:
                pass  # its caller was cancelled meanwhile
        elif op == "error":
            log.warning("the daemon refused a frame: %s", frame.get("message"))

    def _on_close(self) -> None:
        if self._closed:
            return
        self._closed = True
        pending, self._pending = self._pending, {}
        for deliver in pending.values():
            try:
                deliver(None)
            except _InvalidState:
                pass
        self._done.set()

    # -- credit and the session --------------------------------------------------------

    async def pump(self, host: Host, max_request_ms: int) -> None:
        self._host = host
        self._credit = Credit(host.concurrency)
        self.slots_changed()
        if self._conn.lean:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._conn.run)  # the keepalive
                await self._done.wait()
                tg.cancel_scope.cancel()
        else:
            await self._done.wait()
        if not self._ended:
            raise Lost("the WebSocket closed")

    def slots_changed(self) -> None:
        credit = self._credit
        if credit is None or self._closed:
            return
        n = credit.due(self._host)  # type: ignore[arg-type]
        if n:
            self._granted = True
            try:
                self._conn.send(_pack({"op": "credit", "n": n}))
            except Unencodable:  # pragma: no cover - an int always packs
                pass

    def stop_taking(self) -> None:
        # Credit cannot be taken back by a frame: closing the connection ends the
        # daemon's push session, which hands its unoffered slots back to the queue.
        # The worker reconnects (with no credit) for its calls.
        if self._granted:
            self._conn.close("the worker is stopping")

    def end(self) -> None:
        self._ended = True
        self._done.set()


def use_lean(url: str, trust_env: bool, *, trio: bool) -> bool:
    """The lean client (`stepd.channels._wsproto`) serves asyncio, plain ``ws://``, no
    proxy; the ``websockets`` library the rest (trio, ``wss://``, a proxy)."""
    from stepd.channels.http import wants_httpx

    return LEAN and not trio and not wants_httpx(url, trust_env)


LEAN = True
"""False: the ``websockets`` library everywhere (the tests cover both)."""
