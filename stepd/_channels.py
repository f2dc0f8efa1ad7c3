"""The worker's three ways to reach a daemon: WebSocket push, HTTP long-poll, in process.

A channel is one registered connection. It registers the worker, carries its
calls on leases (``started``, ``heartbeat``, ``complete``, ``fail``) and
delivers leases to it (`Channel.pump`) until the connection ends or the worker
has finished. The worker (`stepd.worker`) owns everything that outlives a
connection: the leases, their bodies, the slots; a reconnect is a new channel
registered with the same ``worker_id``.

* `WebSocketChannel`: PROTOCOL.md "WebSocket transport", msgpack frames. The
  worker grants credit as slots free (``credit = free slots``); leases and
  ``cancel`` pushes arrive as frames; requests carry an id the answer echoes.
  Runs on asyncio (``websockets.asyncio``) and on trio (``websockets.trio``,
  websockets >= 17).
* `HttpChannel`: ``POST /v1/api/steps/claim`` long-polls for up to the free
  slots; calls are plain requests. The fallback when the WebSocket is refused.
* `InProcessChannel`: the embedded daemon. Calls go through
  `stepd.transport.inprocess.InProcess` (the protocol handler, values copied);
  leases are pushed by the engine's push session with the same credit
  protocol as the WebSocket, and ``cancel`` pushes come from `Engine.on_cancel`.

Errors a call raises: the typed answers (`stepd._errors`: the four conflicts,
`NotFound`, `Invalid`...), `Lost` when the connection went away before the
answer (the worker sends again on the next connection: every lease call is
safe to repeat), `Unencodable` when the body is not JSON.
"""

from __future__ import annotations

import abc
import contextlib
import json
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import anyio
import httpx
import msgpack  # type: ignore[import-untyped]  # no stubs published

from stepd import _wire
from stepd._errors import NotFound, Unavailable, error_from_answer, translate
from stepd._http1 import Http1Client, Http1Error, Http1Response

if TYPE_CHECKING:
    from stepd.embedded import Embedded

log = logging.getLogger("stepd.worker")

MSGPACK_SUBPROTOCOL = "stepd.v1.msgpack"
WS_MAX_SIZE = 64 << 20


class Lost(Exception):
    """The connection ended before the answer came (or never opened)."""


class Refused(Exception):
    """The daemon (or something in between) refused the WebSocket: use HTTP instead."""


class Unencodable(Exception):
    """A call's body is not JSON (the body's output or state patch)."""


class Host(Protocol):
    """What a channel needs of the worker."""

    concurrency: int
    worker_id: str | None

    @property
    def running(self) -> int: ...

    @property
    def stopping(self) -> bool: ...

    @property
    def finished(self) -> anyio.Event: ...

    def slots_event(self) -> anyio.Event: ...

    def accept(self, lease: dict[str, Any]) -> None: ...

    def on_cancel(self, lease_id: str, reason: str) -> None: ...


class Channel(abc.ABC):
    """One registered connection to the daemon."""

    kind: ClassVar[str]
    ordered: ClassVar[bool] = False
    """The daemon applies this channel's calls of one lease in the order they were sent
    (one WebSocket: frames arrive in order, and the daemon applies a lease's frames in
    arrival order). Then `complete` may be sent right behind `started`, unanswered."""

    @abc.abstractmethod
    async def register(self, body: dict[str, Any]) -> dict[str, Any]: ...

    @abc.abstractmethod
    async def call(self, op: str, lease_id: str, body: dict[str, Any], *,
                   on_sent: Callable[[], None] | None = None) -> dict[str, Any]:
        """One lease call; ``on_sent()`` once the request is on the wire (ordered channels)."""

    @abc.abstractmethod
    async def pump(self, host: Host, max_request_ms: int) -> None: ...

    def stop_taking(self) -> None:
        """The worker stops: take no more leases (what can be revoked is revoked)."""


async def _credit_loop(host: Host, grant: Callable[[int], Any], outstanding: list[int]) -> None:
    """Grant credit as slots free: ``credit = concurrency - running - outstanding``.

    Granted in batches: once a quarter of the slots are free and unoffered, or at
    once when the daemon holds no credit at all (so a lease is never left
    waiting while a slot is free). A credit frame per finished lease cost a frame
    each way per step, on the step's critical path.
    """
    batch = max(1, host.concurrency // 4)
    while True:
        changed = host.slots_event()
        if not host.stopping:
            n = host.concurrency - host.running - outstanding[0]
            if n > 0 and (n >= batch or outstanding[0] == 0):
                outstanding[0] += n
                await grant(n)
        await changed.wait()


# --------------------------------------------------------------------------- WebSocket


class _Pending:
    __slots__ = ("answer", "event")

    def __init__(self) -> None:
        self.event = anyio.Event()
        self.answer: dict[str, Any] | None = None


def websocket_url(url: str) -> str:
    if url.startswith("https://"):
        base = "wss://" + url[len("https://"):]
    else:
        base = "ws://" + url[len("http://"):]
    return base + "/v1/api/workers/connect"


def websocket_connect(url: str, key: str | None, *, trust_env: bool, open_timeout: float,
                      trio: bool) -> Any:
    """The websockets client's ``connect`` (an async context manager) for the worker socket."""
    if trio:
        from websockets.trio.client import connect
    else:
        from websockets.asyncio.client import connect  # type: ignore[assignment]
    headers = {"Authorization": f"Bearer {key}"} if key is not None else None
    return connect(
        websocket_url(url), subprotocols=[MSGPACK_SUBPROTOCOL],  # type: ignore[list-item]
        additional_headers=headers, compression=None, max_size=WS_MAX_SIZE,
        open_timeout=open_timeout, proxy=True if trust_env else None,
        user_agent_header="stepd-python",
    )


def classify_handshake_error(exc: BaseException) -> BaseException:
    """What a failed WebSocket handshake means for the worker.

    Returns:
        `Unauthorized`/`Forbidden` (401/403: fatal), `Unavailable` (503: retry),
        `Refused` (any other refusal: fall back to HTTP), or `Lost` (the
        network: retry).
    """
    from websockets.exceptions import InvalidHandshake, InvalidMessage, InvalidStatus

    if isinstance(exc, InvalidStatus):
        status = exc.response.status_code
        try:
            body = json.loads(exc.response.body or b"{}")
        except ValueError:
            body = {}
        if status in (401, 403, 503):
            return error_from_answer(status, body)
        return Refused(f"the WebSocket upgrade was answered {status}")
    if isinstance(exc, InvalidMessage):
        return Lost(f"the WebSocket handshake failed: {exc!r}")
    if isinstance(exc, InvalidHandshake):
        return Refused(f"the WebSocket handshake was refused: {exc!r}")
    return Lost(f"cannot open the WebSocket: {exc!r}")


class WebSocketChannel(Channel):
    """The worker WebSocket (msgpack frames)."""

    kind = "websocket"
    ordered = True

    def __init__(self, ws: Any) -> None:
        self.ws = ws
        self._next_id = 0
        self._pending: dict[int, _Pending] = {}
        self._closed = False
        self._outstanding = [0]
        self._granted = False
        self._revoke = anyio.Event()

    async def _send(self, frame: dict[str, Any]) -> None:
        try:
            data = msgpack.packb(frame, use_bin_type=True)
        except (TypeError, ValueError, OverflowError) as exc:
            raise Unencodable(str(exc)) from None
        from websockets.exceptions import ConnectionClosed

        try:
            # websockets serialises whole-message sends itself (asyncio and trio).
            await self.ws.send(data)
        except ConnectionClosed as exc:
            raise Lost(f"the WebSocket closed: {exc}") from None

    async def _request(self, frame: dict[str, Any],
                       on_sent: Callable[[], None] | None = None) -> dict[str, Any]:
        if self._closed:
            raise Lost("the WebSocket is closed")
        self._next_id += 1
        frame_id = frame["id"] = self._next_id
        pending = self._pending[frame_id] = _Pending()
        try:
            await self._send(frame)
            if on_sent is not None:
                on_sent()
            await pending.event.wait()
        finally:
            self._pending.pop(frame_id, None)
        answer = pending.answer
        if answer is None:
            raise Lost("the WebSocket closed before the answer")
        return _frame_answer(answer)

    async def register(self, body: dict[str, Any]) -> dict[str, Any]:
        # Nothing else arrives before the registration is answered: read inline.
        from websockets.exceptions import ConnectionClosed

        self._next_id += 1
        frame_id = self._next_id
        await self._send({"op": "register", "id": frame_id, **body})
        try:
            while True:
                frame = _decode(await self.ws.recv())
                if frame.get("id") == frame_id:
                    return _frame_answer(frame)
        except ConnectionClosed as exc:
            raise Lost(f"the WebSocket closed during register: {exc}") from None

    async def call(self, op: str, lease_id: str, body: dict[str, Any], *,
                   on_sent: Callable[[], None] | None = None) -> dict[str, Any]:
        return await self._request({"op": op, "lease_id": lease_id, **body}, on_sent)

    async def pump(self, host: Host, max_request_ms: int) -> None:
        from websockets.exceptions import ConnectionClosed

        async def grant(n: int) -> None:
            self._granted = True
            try:
                await self._send({"op": "credit", "n": n})
            except Lost:
                pass  # the reader sees the close and ends the pump

        async def revoke() -> None:
            # Credit cannot be taken back by a frame: closing the connection ends
            # the daemon's push session, which hands its unoffered slots back to
            # the queue. The worker reconnects (with no credit) for its calls.
            await self._revoke.wait()
            close = getattr(self.ws, "close", None) or self.ws.aclose  # asyncio | trio
            await close(1000, "the worker is stopping")

        closed = False
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(_credit_loop, host, grant, self._outstanding)
                tg.start_soon(revoke)

                async def finish() -> None:
                    await host.finished.wait()
                    tg.cancel_scope.cancel()

                tg.start_soon(finish)
                try:
                    async for data in self.ws:
                        try:
                            frame = _decode(data)
                        except (ValueError, Lost, msgpack.UnpackException) as exc:
                            log.error("the daemon sent a frame that does not decode: %r", exc)
                            continue
                        self._dispatch(host, frame)
                except ConnectionClosed:
                    pass
                closed = True
                tg.cancel_scope.cancel()
        finally:
            self._close_pending()
        if closed:
            raise Lost("the WebSocket closed")

    def stop_taking(self) -> None:
        if self._granted:
            self._revoke.set()

    def _dispatch(self, host: Host, frame: dict[str, Any]) -> None:
        op = frame.get("op")
        if op == "lease":
            self._outstanding[0] = max(0, self._outstanding[0] - 1)
            host.accept(frame["lease"])
        elif op == "cancel":
            host.on_cancel(str(frame.get("lease_id")), str(frame.get("reason")))
        else:
            frame_id = frame.get("id")
            pending = self._pending.get(frame_id) if isinstance(frame_id, int) else None
            if pending is not None:
                pending.answer = frame
                pending.event.set()
            elif op == "error":
                log.warning("the daemon refused a frame: %s", frame.get("message"))

    def _close_pending(self) -> None:
        self._closed = True
        for pending in list(self._pending.values()):
            pending.event.set()


def _decode(data: Any) -> dict[str, Any]:
    if isinstance(data, (bytes, bytearray, memoryview)):
        frame = msgpack.unpackb(data, raw=False)
    else:
        frame = json.loads(data)
    if not isinstance(frame, dict):
        raise Lost(f"the daemon sent a frame that is not a map: {frame!r}")
    return frame


def _frame_answer(frame: dict[str, Any]) -> dict[str, Any]:
    op = frame.get("op")
    body = {k: v for k, v in frame.items() if k not in ("op", "id")}
    if op in ("ok", "registered"):
        return body
    if op == "conflict":
        raise error_from_answer(409, body)
    if op == "error":
        status = body.get("status")
        raise error_from_answer(status if isinstance(status, int) else 500, body)
    raise Lost(f"unexpected answer frame {op!r}")


# --------------------------------------------------------------------------- HTTP


class HttpChannel(Channel):
    """HTTP long-poll: claims for the free slots, calls as plain requests."""

    kind = "http"

    def __init__(self, http: httpx.AsyncClient | Http1Client, timeout: float) -> None:
        self.http = http
        self.timeout = timeout
        self._claim_scope: anyio.CancelScope | None = None
        self._stopped = False

    async def send(self, call: _wire.Call) -> dict[str, Any]:
        try:
            content = json.dumps(call.body, ensure_ascii=False, allow_nan=False,
                                 separators=(",", ":")).encode()
        except (TypeError, ValueError) as exc:
            raise Unencodable(str(exc)) from None
        response: httpx.Response | Http1Response
        try:
            if isinstance(self.http, Http1Client):
                response = await self.http.request(call.method, call.path, content=content,
                                                   timeout=self.timeout + call.hold_s)
            else:
                response = await self.http.request(
                    call.method, call.path, content=content,
                    headers={"content-type": "application/json"},
                    timeout=self.timeout + call.hold_s,
                )
        except (httpx.TransportError, Http1Error) as exc:
            raise Lost(f"HTTP {call.op}: {exc!r}") from None
        try:
            body = response.json() if response.content else {}
        except ValueError:
            body = {"message": response.text[:500]}
        if response.status_code >= 300:
            raise error_from_answer(response.status_code, body)
        return body if isinstance(body, dict) else {}

    async def register(self, body: dict[str, Any]) -> dict[str, Any]:
        return await self.send(_wire.register(body))

    async def call(self, op: str, lease_id: str, body: dict[str, Any], *,
                   on_sent: Callable[[], None] | None = None) -> dict[str, Any]:
        return await self.send(_wire.lease_call(op, lease_id, body))

    async def pump(self, host: Host, max_request_ms: int) -> None:
        assert host.worker_id is not None
        wait_ms = max(1, max_request_ms)
        while not host.stopping and not self._stopped:
            changed = host.slots_event()
            free = host.concurrency - host.running
            if free <= 0:
                await changed.wait()
                continue
            leases: list[dict[str, Any]] = []
            with anyio.CancelScope() as scope:
                self._claim_scope = scope
                if host.stopping or self._stopped:
                    scope.cancel()
                try:
                    answer = await self.send(_wire.claim(host.worker_id, free, wait_ms))
                    leases = answer.get("leases") or []
                except Unavailable:
                    raise Lost("the daemon answered 503 to a claim") from None
            self._claim_scope = None
            for lease in leases:
                host.accept(lease)
        await host.finished.wait()

    def stop_taking(self) -> None:
        # A claim cancelled now returns the slots the daemon had not offered yet.
        # (An answer already on its way is lost with the request: the daemon
        # recovers those attempts when their leases expire; docs/sdk.md.)
        self._stopped = True
        if self._claim_scope is not None:
            self._claim_scope.cancel()


# --------------------------------------------------------------------------- in process


class InProcessChannel(Channel):
    """The embedded daemon: `InProcess` calls and the engine's push session."""

    kind = "inprocess"

    def __init__(self, daemon: Embedded) -> None:
        self.daemon = daemon
        self._session: Any = None
        self._outstanding = [0]

    async def _invoke(self, op: str, *args: Any) -> dict[str, Any]:
        from stepd.sansio.errors import StepdError

        try:
            return await getattr(self.daemon.inprocess, op)(*args)  # type: ignore[no-any-return]
        except StepdError as exc:
            raise translate(exc) from None
        except RuntimeError as exc:  # the daemon closed under us
            raise Lost(str(exc)) from None

    async def register(self, body: dict[str, Any]) -> dict[str, Any]:
        return await self._invoke("register", body)

    async def call(self, op: str, lease_id: str, body: dict[str, Any], *,
                   on_sent: Callable[[], None] | None = None) -> dict[str, Any]:
        return await self._invoke(op, lease_id, body)

    async def pump(self, host: Host, max_request_ms: int) -> None:
        from stepd.transport.protocol import copy_json

        engine = self.daemon.engine
        assert host.worker_id is not None
        try:
            session = engine.push_session(host.worker_id)
        except NotFound as exc:
            raise Lost(str(exc)) from None
        self._session = session
        worker_id = host.worker_id
        engine.on_cancel(worker_id, host.on_cancel)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(_credit_loop, host, session.add_credit, self._outstanding)
                if host.stopping:
                    session.close()
                try:
                    async with contextlib.aclosing(session.leases()) as leases:
                        async for lease in leases:
                            self._outstanding[0] = max(0, self._outstanding[0] - 1)
                            host.accept(copy_json(lease))
                except anyio.ClosedResourceError:
                    pass  # stop_taking() closed the session while we waited on it
                # The session closed: the worker is stopping; wait until it is done.
                await host.finished.wait()
                tg.cancel_scope.cancel()
        finally:
            session.close()
            # Older engines' PushSession.close() left its receive stream open (a
            # ResourceWarning when collected); closing it again is harmless.
            recv = getattr(session, "_recv", None)
            if recv is not None:
                recv.close()
            engine.on_cancel(worker_id, None)

    def stop_taking(self) -> None:
        # Closing the push session hands its unoffered slots back to the queue.
        if self._session is not None:
            self._session.close()
