"""The worker WebSocket: push transport over the shared `Protocol` (PROTOCOL.md "WebSocket transport").

``GET /v1/api/workers/connect`` upgraded to a WebSocket on the daemon's ASGI
app and port. Subprotocol ``stepd.v1.msgpack`` (binary frames) or
``stepd.v1.json`` (text frames, the same maps, for debugging). The
``Authorization`` header and the ``worker`` scope are checked on the upgrade
request: a refusal is an HTTP answer (401, 403, 400 without a known
subprotocol, 503 while draining) and no WebSocket is opened.

Frames are maps with ``op``; requests carry an integer ``id`` the answer
echoes::

    -> {"op": "register", "id": 1, ...register body}
    <- {"op": "registered", "id": 1, ...register answer}
    -> {"op": "credit", "n": 8}
    <- {"op": "lease", "lease": Lease}                      (pushed, one credit each)
    -> {"op": "started" | "heartbeat" | "complete" | "fail" | "history", "id": 7, "lease_id", ...}
    <- {"op": "ok", "id": 7, ...answer}
     | {"op": "conflict", "id": 7, "reason": R, "message": "..."}
     | {"op": "error", "id": 7, "status": 400, "message": "...", "field": "..."}
    <- {"op": "cancel", "lease_id": "...", "reason": "run_terminal" | "fenced"}

The bodies are validated by `Protocol` exactly as over HTTP (the frame minus ``op``,
``id``, ``lease_id``/``session_id`` is the HTTP body), so the same input gets the same
rejection on either transport. Answers are sent only once what they acknowledge is durable.

Per connection (all its tasks in one task group, STYLE.md rule 7):

* reading: under `stepd serve` the frames of one read of the socket arrive in
  one call of its protocol's callback (`frames_received`, from
  `transport._uvicorn.WebSocketProtocol`, no receive queue) and are applied
  there, so frames that arrive together are applied in one loop iteration
  (their writes join one commit, their answers one socket write). Worker
  calls on leases run concurrently, at most ``max_in_flight`` at once (a slow
  ``complete`` does not hold up the heartbeats of other leases), answered by
  a pool of handler tasks that park when idle (started as load needs them,
  never more than ``max_in_flight``), in arrival order per lease
  (`FrameOrder`; the pool is `_ws_calls.LeaseCalls`). A frame that must wait
  (a ``register``, which attaches the connection to its worker's session
  actor, so the frames behind it wait for it; a call past ``max_in_flight``;
  an answer with no room) goes to the reader task instead, in order, and
  reading pauses until it is through (TCP pushes back on the worker). Under
  another ASGI server the reader task takes every frame from ASGI
  ``receive``, the same way;
* no pusher: the worker's session actor (`stepd.actors.daemon.session`) turns
  each credit into a lease the moment work appears and queues it here (this
  connection is its `Outbox`); leases pass the frame bound, their credit
  bounds them;
* a writer (`transport._ws_writer`): the one task that sends, fed by a bounded
  queue of encoded frames (``max_queue`` frames); every frame queued when it
  runs leaves in one socket write. Answers wait for room; a ``cancel`` push
  that finds the queue full is dropped (the heartbeat's 409 delivers it
  anyway, STYLE.md rule 21). The bytes waiting to be sent (queued, or waiting
  for room) are bounded too (``max_queue_bytes``): a frame that would take
  them past it means the peer does not read what it asked for, and the
  connection is closed with 1013 (what waits is dropped; docs/serve.md says
  why 1013).

What an answer repeats of a frame is bounded (`error_reply` cuts ids and keys
to a short prefix), and a frame's input is let go before its answer waits for
room: a peer that sends and never reads costs the daemon a few frames, then
TCP pushes back.

A lease belongs to the worker, not the connection: a worker that reconnects and
registers with its ``worker_id`` keeps heartbeating and completing its leases,
and ``cancel`` pushes follow it to the new connection. When a connection ends
(the peer closed, or went silent past uvicorn's ``ws_ping_interval`` +
``ws_ping_timeout``), its session's unoffered slots go back to the queue.
Oversized messages are closed with 1009 (uvicorn's ``ws_max_size``, and again
here against ``max_body_bytes`` for servers that do not enforce one). On
shutdown the daemon stops reading and pushing, answers the frames in flight,
then closes with 1001.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Final

import anyio
import msgpack  # type: ignore[import-untyped]

from stepd.actors import Waiter
from stepd.actors.daemon import Connection
from stepd.sansio.errors import Invalid, NotFound, StepdError, Unavailable

from ._json import check_json
from ._uvicorn import WIRE_EXTENSION, WebSocketProtocol
from ._validate import check_int
from ._ws_calls import LEASE_OPS, LeaseCalls
from ._ws_frames import answer_frame, error_frame, is_frame_id, msgpack_problem
from ._ws_writer import Close
from .auth import Forbidden, Principal, Unauthorized
from .protocol import (
    CrossSite,
    Operation,
    Protocol,
    decode_json,
    encode_json,
    error_reply,
)

__all__ = ["JSON_SUBPROTOCOL", "MSGPACK_SUBPROTOCOL", "SUBPROTOCOLS", "WorkerConnection",
           "WorkerSockets"]

log = logging.getLogger("stepd.transport.websocket")

MSGPACK_SUBPROTOCOL: Final = "stepd.v1.msgpack"
JSON_SUBPROTOCOL: Final = "stepd.v1.json"
SUBPROTOCOLS: Final = (MSGPACK_SUBPROTOCOL, JSON_SUBPROTOCOL)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

_CREDIT_KEYS: Final = frozenset({"op", "id", "n"})

CLOSE_GOING_AWAY: Final = 1001
CLOSE_SERVICE_RESTART: Final = 1012
CLOSE_TOO_BIG: Final = 1009

DEFAULT_MAX_QUEUE_BYTES: Final = 16 << 20
"""The bytes of encoded frames waiting to be sent on one connection before it is closed (1013)."""


class WorkerSockets:
    """The ASGI endpoint of the worker WebSocket; one per app.

    Args:
        protocol: the shared protocol handler.
        max_in_flight: request frames answered concurrently per connection.
        max_queue: frames waiting to be sent per connection.
        max_queue_bytes: bytes of encoded frames waiting to be sent per
            connection; past it the connection is closed with 1013.
    """

    def __init__(self, protocol: Protocol, *, max_in_flight: int = 64,
                 max_queue: int = 256, max_queue_bytes: int = DEFAULT_MAX_QUEUE_BYTES) -> None:
        if max_in_flight < 1 or max_queue < 1 or max_queue_bytes < 1:
            raise ValueError("max_in_flight, max_queue and max_queue_bytes must be >= 1")
        self.protocol = protocol
        self.max_in_flight = max_in_flight
        self.max_queue = max_queue
        self.max_queue_bytes = max_queue_bytes

    # -- the handshake ------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = await receive()
        if message["type"] != "websocket.connect":
            return
        if scope["path"] != "/v1/api/workers/connect":
            reply = error_reply(NotFound(f"no WebSocket at {scope['path']}"))
            await _reject(scope, send, reply.status, reply.body)
            return
        protocol = self.protocol
        if protocol.draining:
            reply = error_reply(Unavailable("the daemon is shutting down"))
            await _reject(scope, send, reply.status, reply.body)
            return
        headers = {bytes(k): bytes(v).decode("latin-1") for k, v in scope["headers"]}
        try:
            protocol.check_keyless(headers.get(b"host"), headers.get(b"origin"))
            principal = protocol.authorize(Operation.REGISTER, headers.get(b"authorization"))
        except (Unauthorized, Forbidden, CrossSite) as exc:
            reply = error_reply(exc)
            await _reject(scope, send, reply.status, reply.body, reply.headers)
            return
        offered = scope.get("subprotocols") or []
        chosen = next((p for p in SUBPROTOCOLS if p in offered), None)
        if chosen is None:
            reply = error_reply(Invalid(
                f"offer the subprotocol {MSGPACK_SUBPROTOCOL} (or {JSON_SUBPROTOCOL})",
                field="Sec-WebSocket-Protocol",
            ))
            await _reject(scope, send, reply.status, reply.body)
            return
        await send({"type": "websocket.accept", "subprotocol": chosen})
        wire = scope.get("extensions", {}).get(WIRE_EXTENSION, {}).get("protocol")
        conn = WorkerConnection(self, principal, chosen, receive, send,
                                wire if isinstance(wire, WebSocketProtocol) else None)
        await conn.run()


async def _reject(scope: Scope, send: Send, status: int, body: dict[str, Any],
                  headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
    """Refuse the upgrade with an HTTP answer (ASGI ``websocket.http.response``)."""
    if "websocket.http.response" in scope.get("extensions", {}):
        data = encode_json(body)
        await send({
            "type": "websocket.http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"),
                        (b"content-length", str(len(data)).encode()), *headers],
        })
        await send({"type": "websocket.http.response.body", "body": data})
    else:  # the server cannot answer with a body: a bare refusal (403)
        await send({"type": "websocket.close", "code": 1008})


class WorkerConnection(LeaseCalls):
    """One worker WebSocket, from accept to close: its lifecycle, its reading, its
    register and credit frames, and its attachment to its worker's session.

    Its lease calls in flight are `LeaseCalls`' (`_ws_calls.py`), its sending
    side `FrameWriter`'s (`_ws_writer.py`).

    Attributes:
        worker_id: the worker registered on this connection (None before ``register``).
        principal: who connected.
        subprotocol: the negotiated encoding.
    """

    def __init__(self, sockets: WorkerSockets, principal: Principal, subprotocol: str,
                 receive: Receive, send: Send, wire: WebSocketProtocol | None = None) -> None:
        self.sockets = sockets
        self.protocol = sockets.protocol
        self.principal = principal
        self.subprotocol = subprotocol
        self.worker_id: str | None = None
        super().__init__(max_in_flight=sockets.max_in_flight,
                         binary=subprotocol == MSGPACK_SUBPROTOCOL, send=send, wire=wire,
                         max_queue=sockets.max_queue, max_queue_bytes=sockets.max_queue_bytes)
        self._receive = receive
        # `self._wire`: stepd's own uvicorn protocol (`stepd serve`): frames come
        # from its callback (`frames_received`) and leave through `send_frames`.
        # None under another ASGI server: the ASGI receive and send then.
        self._inbox: collections.deque[bytes | str] = collections.deque()
        self._inbox_wake: Waiter | None = None
        self._inbox_busy = False  # the reader is inside a frame from the inbox
        self._reading = True
        # The attachment to this worker's session actor (`Daemon.attach`): the
        # session pushes leases and cancels here (this connection is its Outbox).
        self._attached: Connection | None = None
        self._read_scope = anyio.CancelScope()
        self._scope = anyio.CancelScope()
        self._close = Close(CLOSE_GOING_AWAY, "the daemon is shutting down")
        self._max_bytes = self.protocol.max_body_bytes + 4096  # the frame's envelope

    # -- lifecycle ------------------------------------------------------------------

    async def run(self) -> None:
        """Serve the connection until the peer leaves or the daemon closes it."""
        self.protocol.add_connection(self)
        if self.protocol.draining:  # the drain began while the upgrade was being accepted
            self.close_for_shutdown()
        try:
            with self._scope:
                await self._serve()
        finally:
            self._end_session()
            self._out.close()
            self.protocol.remove_connection(self)

    async def _serve(self) -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._write_loop)
            async with anyio.create_task_group() as handlers:
                self._handlers = handlers
                with self._read_scope:
                    if self._wire is not None:
                        await self._wire_loop(self._wire)
                    else:
                        await self._read_loop()
                if self._peer_gone:
                    handlers.cancel_scope.cancel()
                else:
                    self._end_session()  # the pusher ends; in-flight answers go out
                    self._close_pool()
            if self._peer_gone:
                tg.cancel_scope.cancel()
            else:
                await self._push(self._close)

    def close_for_shutdown(self) -> None:
        """Stop reading and pushing; close with 1001 once the frames in flight are answered."""
        self._close = Close(CLOSE_GOING_AWAY, "the daemon is shutting down")
        self._read_scope.cancel()
        self._end_session()

    def abort(self) -> None:
        """The shutdown's grace period is over: stop now (uvicorn closes the socket)."""
        self._scope.cancel()

    def _stop_reading(self) -> None:
        self._read_scope.cancel()
        if self._handlers is not None:
            self._handlers.cancel_scope.cancel()

    def _gone(self) -> None:
        """The peer is gone: nothing more can be sent; stop everything."""
        self._peer_gone = True
        self._read_scope.cancel()
        if self._handlers is not None:
            self._handlers.cancel_scope.cancel()

    # -- reading ----------------------------------------------------------------------

    async def _read_loop(self) -> None:
        """Frames through the ASGI ``receive`` (a server other than `stepd serve`)."""
        while True:
            message = await self._receive()
            kind = message["type"]
            if kind == "websocket.disconnect":
                self._peer_gone = True
                return
            if kind != "websocket.receive":
                continue
            data = message.get("bytes")
            if not await self._on_message(data if data is not None else message.get("text") or ""):
                return

    # The frames of one read arrive in one call of the protocol's callback
    # (`frames_received`) and are applied there: decoded, checked, and handed
    # to the handler pool, so the frames that arrive together reach the daemon
    # in the same loop iteration (their writes join one commit, their answers
    # one socket write). Only what must wait goes through the inbox to the
    # reader task (`_wire_loop`): a register (the frames behind it wait for it),
    # a frame with no free in-flight slot or no room for its answer, an
    # oversized one. While the inbox holds anything, reading is paused.

    async def _wire_loop(self, wire: WebSocketProtocol) -> None:
        """The reader under `stepd serve`: the frames that had to wait, in arrival order."""
        inbox = self._inbox
        wire.attach(self)
        try:
            while True:
                while inbox:
                    self._inbox_busy = True
                    try:
                        if not await self._on_message(inbox.popleft()):
                            return
                    finally:
                        self._inbox_busy = False
                if self._peer_gone:
                    return
                wire.resume_reading()  # nothing waits: the peer may send more
                self._inbox_wake = waiter = Waiter()
                await waiter.wait()
        finally:
            self._reading = False  # later frames are dropped, unread (TCP pushes back)
            inbox.clear()
            self._inbox_wake = None
            if not self._peer_gone:
                wire.pause_reading()

    def frames_received(self, frames: list[bytes | str]) -> None:
        """The protocol's callback (`FrameSink`): the whole messages of one read, in order."""
        if not self._reading:
            return
        inbox = self._inbox
        if not inbox and not self._inbox_busy:
            for i, item in enumerate(frames):
                if self._overflowed:
                    return  # closing with 1013: what follows is not read
                if not self._apply_now(item):
                    inbox.extend(frames[i:] if i else frames)
                    break
            else:
                return
        else:
            inbox.extend(frames)
        assert self._wire is not None
        self._wire.pause_reading()
        waiter = self._inbox_wake
        if waiter is not None:
            waiter.set()

    def peer_closed(self) -> None:
        """The protocol's callback (`FrameSink`): the connection is over."""
        self._peer_gone = True
        waiter = self._inbox_wake
        if waiter is not None:
            waiter.set()

    def _apply_now(self, item: bytes | str) -> bool:
        """Apply a frame without waiting; False (nothing done) when it must wait in the inbox."""
        if len(item if type(item) is bytes else item.encode()) > self._max_bytes:  # type: ignore[union-attr]
            return False
        kind, frame_id, value = self._parse(item)
        if kind == "call":
            if not self._limit.try_acquire():
                return False
            self._start_call(frame_id, value)
            return True
        if kind == "register" or not self._has_room():
            return False
        if kind == "credit":
            answer = self._credit_answer(value)
            if answer is not None:
                self._push_now(answer)
        else:
            self._push_now(value)
        return True

    def _parse(self, item: bytes | str) -> tuple[str, Any, Any]:
        """What a frame asks: ``("call" | "register", id, frame)``, ``("credit", None,
        frame)`` or ``("answer", None, error frame)``."""
        try:
            frame = self._decode(item)
            if type(frame) is not dict:  # msgpack and JSON decode to exact dicts
                raise Invalid("a frame must be a map with an 'op'")
        except Invalid as exc:
            return "answer", None, error_frame(None, exc)
        # Subscripts behind `in`, not `get`: no call (two frames a step).
        op = frame["op"] if "op" in frame else None
        frame_id = frame["id"] if "id" in frame else None
        # `type(x) is int`: `is_frame_id` without its call (msgpack and JSON give exact ints).
        if op == "credit" and (frame_id is None or type(frame_id) is int):  # its id is optional
            return "credit", None, frame
        if op not in LEASE_OPS and op not in ("register", "credit"):
            return "answer", None, error_frame(frame_id, Invalid(
                "must be register, credit, a lease call or a session call", field="op"))
        if type(frame_id) is not int:
            return "answer", None, error_frame(None, Invalid("a request needs an integer id",
                                                              field="id"))
        return ("register" if op == "register" else "call"), frame_id, frame

    def _decode(self, item: bytes | str) -> Any:
        if self._binary:
            if type(item) is not bytes:
                raise Invalid(f"this connection speaks {MSGPACK_SUBPROTOCOL}: send binary frames")
            try:
                frame = msgpack.unpackb(item, raw=False, strict_map_key=True)
            except Exception as exc:  # noqa: BLE001 - msgpack raises several unrelated types
                raise Invalid("the frame is not valid msgpack: "
                              f"{msgpack_problem(item, exc)}") from None
            try:
                check_json(frame)  # only JSON values cross into the daemon
            except (TypeError, ValueError) as exc:
                raise Invalid(f"the frame holds a value JSON cannot carry: {exc}") from None
            return frame
        if type(item) is not str:
            raise Invalid(f"this connection speaks {JSON_SUBPROTOCOL}: send text frames")
        return decode_json(item)

    async def _on_message(self, item: bytes | str) -> bool:
        """Apply a frame, waiting for what it needs; False: reading ends (it is too big)."""
        if len(item if type(item) is bytes else item.encode()) > self._max_bytes:  # type: ignore[union-attr]
            self._close = Close(CLOSE_TOO_BIG, "message too big")
            return False
        kind, frame_id, value = self._parse(item)
        if kind == "answer":
            await self._push(value)
        elif kind == "credit":
            answer = self._credit_answer(value)
            if answer is not None:
                await self._push(answer)
        elif kind == "register":
            await self._register(frame_id, value)
        else:
            await self._limit.acquire()
            self._start_call(frame_id, value)
        return True

    # -- requests ---------------------------------------------------------------------

    async def _register(self, frame_id: int, frame: dict[str, Any]) -> None:
        body = {k: v for k, v in frame.items() if k not in ("op", "id")}
        with self.protocol.tracking():
            reply = await self.protocol.handle(Operation.REGISTER, self.principal, body=body)
        if reply.status == 200:
            if not self.protocol.draining:  # no new session once the drain has begun
                await self._attach(reply.body["worker_id"])
            await self._push({"op": "registered", "id": frame_id, **reply.body})
        else:
            await self._push(answer_frame(frame_id, reply))

    def _credit_answer(self, frame: dict[str, Any]) -> dict[str, Any] | None:
        """Grant a credit frame's slots; its answer (None for a credit without an id)."""
        frame_id = frame.get("id")
        try:
            for key in frame:
                if key not in _CREDIT_KEYS:
                    raise Invalid("unknown key", field=str(key))
            n = check_int(frame.get("n"), "n", minimum=1, maximum=10_000)
            if self._attached is None:
                raise Invalid("send register before credit")
            self._attached.grant(n)
        except Invalid as exc:
            return error_frame(frame_id, exc)
        return {"op": "ok", "id": frame_id} if is_frame_id(frame_id) else None

    # -- the push session ---------------------------------------------------------------

    async def _attach(self, worker_id: str) -> None:
        """Register this connection as `worker_id`'s push connection (replacing an earlier one)."""
        self._end_session()
        try:
            self._attached = await self.protocol.daemon.attach(worker_id, self)
        except StepdError:
            # The sessions are restarting (a kill): a connection left registered but
            # unattached would have its credit refused and wait forever. Close it
            # like a restarted session does; the worker reconnects and registers again.
            self._attached = None
            self.close("the worker's session could not start: reconnect")
            return
        self.worker_id = worker_id

    def _end_session(self) -> None:
        attached, self._attached = self._attached, None
        if attached is not None:
            attached.detach()  # unoffered slots and credit go back

    # -- the session's outbox (`stepd.actors.daemon.session.Outbox`; its leases: `LeaseCalls`)

    def cancel(self, lease_id: str, reason: str) -> None:
        """Tell the worker to stop a body; dropped when the queue is full (the heartbeat's
        409 delivers it anyway, STYLE.md rule 21)."""
        self.push_nowait({"op": "cancel", "lease_id": lease_id, "reason": reason})

    def close(self, reason: str) -> None:
        """The session gave this connection up (it restarted): close it; the worker reconnects."""
        self._close = Close(CLOSE_SERVICE_RESTART, reason[:100])
        self._attached = None
        self._read_scope.cancel()

