"""The HTTP face of the daemon: a raw ASGI app over the shared `Protocol`.

Every endpoint of PROTOCOL.md (and ``transport/openapi.json``) on one ASGI
callable, for uvicorn (``http="httptools"``, ``loop="uvloop"`` where
available); the worker WebSocket (`stepd.transport.websocket`) is served by the
same app on the same port. No framework sits on the hot path: a request is one
dict lookup (static paths) or a split and a match (paths with an id), one
authorization, one body read, one `Protocol.handle`, one response.

What this module adds to `Protocol`, and nothing more (STYLE.md rule 20):

* routing (`_routes`): ``(method, path)`` -> `Operation` and the path id; an
  unknown path is 404, a known path with another method 405 (with ``Allow``);
* the body: a ``Content-Length`` over ``max_body_bytes`` is refused before a
  byte is read, and a body streamed without one is counted as it arrives:
  413 either way (``Connection: close``: the rest is never read); malformed
  JSON is 400 naming the problem (`stepd.transport.protocol.decode_json`);
* long-polls (``claim``, ``result?wait_ms=``) end when the client disconnects
  (``http.disconnect``): the daemon call is cancelled (a claim cancelled so
  returns the slots it had not offered yet) and nothing is sent;
* ``GET /healthz``, ``GET /metrics`` (Prometheus text), ``GET /openapi.json``;
* the web console's static files at ``/ui/`` (`_console`, docs/console.md):
  read once from the package, served by exact name (no directory listing, no
  path from the request ever reaches the file system), with a strict
  ``Content-Security-Policy``;
* 503 for everything once the daemon drains;
* ``stepd_http_requests_total{route, status}`` for every answer (``499``: the
  client went away before the answer).

The body of a request that does not come through `HttpExchange` (another ASGI
server, a body still arriving) is read, and answered, through ASGI's messages
(`_asgi`).
"""

from __future__ import annotations

import logging
from typing import Any, Final
from urllib.parse import parse_qsl

from stepd.sansio.errors import Invalid, NotFound, StepdError, Unavailable

from ._asgi import (
    JSON_HEADER,
    ClientGone,
    Message,
    Receive,
    Scope,
    Send,
    check_length,
    heads,
    read_body,
    send_reply,
    send_response,
    until_disconnect,
)
from ._console import CONSOLE_CSP, CONTENT_TYPES, console_assets, send_asset, send_redirect
from ._routes import CONNECT, HEALTHZ, METRICS, OPENAPI, UI, UI_REDIRECT, Route, Special, route
from ._uvicorn_http import EXCHANGE_EXTENSION, HttpExchange
from .auth import Forbidden, Principal, Unauthorized
from .metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from .metrics import CounterChild
from .openapi import openapi_bytes
from .operations import LEASE_CALLS
from .protocol import (
    LONG_POLLS,
    NO_BODY,
    SPECS,
    CrossSite,
    Operation,
    Protocol,
    Reply,
    TooLarge,
    decode_json,
    encode_json,
    error_reply,
)
from .websocket import DEFAULT_MAX_QUEUE_BYTES, WorkerSockets

# The route table and the console's names are re-exported: they were this module's.
__all__ = ["CONSOLE_CSP", "CONTENT_TYPES", "HttpApp", "console_assets", "create_app", "route"]

log = logging.getLogger("stepd.transport.http")

_JSON_LINE: Final = b"content-type: application/json\r\n"
_KEYLESS_SEEN_MAX: Final = 64


class HttpApp:
    """The daemon's ASGI application: HTTP endpoints and the worker WebSocket.

    Args:
        protocol: the shared protocol handler.
        sockets: the WebSocket endpoint (created from ``protocol`` when omitted).
    """

    def __init__(self, protocol: Protocol, *, sockets: WorkerSockets | None = None) -> None:
        self.protocol = protocol
        self.sockets = sockets if sockets is not None else WorkerSockets(protocol)
        self._requests = protocol.metrics.requests_total
        self._counted: dict[tuple[str, int], CounterChild] = {}
        # (Host, Origin) pairs `Protocol.check_keyless` let through while no key was
        # configured: the check is a function of the two headers alone, so a worker's
        # requests, which repeat the same pair, skip it (bounded: cleared when full).
        self._keyless_seen: set[tuple[bytes | None, bytes | None]] = set()
        # Without keys every caller is the anonymous principal of the operation's
        # need, whatever it sends (`KeyRing.authorize`): looked up once per operation.
        # The protocol keeps its keyring for its life.
        self._keyless: dict[Operation, Principal] | None = (
            None if protocol.keyring.enabled else {})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A request (a protocol operation inline: every frame of this chain is
        resumed again whenever the call waits), the worker WebSocket, or the lifespan."""
        if scope["type"] != "http":
            if scope["type"] == "websocket":
                await self.sockets(scope, receive, send)
            elif scope["type"] == "lifespan":
                await _lifespan(receive, send)
            return
        found = route(scope["path"])
        op = None if found is None else found[1].get(scope["method"])
        protocol = self.protocol
        if type(op) is not Operation or protocol.draining:
            await self._not_an_operation(scope, send, found)
            return
        assert found is not None and isinstance(op, Operation)
        template, target = found[0], found[2]
        # The operation's reply is made inside the call's tracking and sent after
        # it, so a shutdown that cancels the call never cuts an answer in half.
        # Under stepd's own protocol (`HttpExchange`) the body is read from the
        # parser's buffer, the answer leaves in one write, and a long-poll is
        # cancelled by the disconnect itself.
        extensions = scope.get("extensions")
        exchange: HttpExchange | None = (
            extensions.get(EXCHANGE_EXTENSION) if extensions is not None else None)
        reply: Reply | None = None
        close = False
        gone = False
        # Under stepd's protocol a request has its task to itself: the call is
        # cancelled (by a shutdown's `abort`, a long-poll also by the drain and by
        # a disconnect, `HttpExchange.client_gone`) through it, with no cancel
        # scope (`Drain.task_tracking`).
        tracking = (protocol.task_tracking(exchange.task, poll=op in LONG_POLLS)
                    if exchange is not None else protocol.tracking())
        with tracking as call:
            try:
                prepared = self._prepare(scope, op, exchange)
                if prepared is None:  # the body is still arriving, or another server
                    prepared = await self._prepare_streamed(scope, receive, op)
                if type(prepared) is Reply:
                    reply = prepared
                elif isinstance(prepared, (Unauthorized, Forbidden)):
                    reply = await protocol.refused(op, prepared, target)
                else:
                    # `_Prepared` (the `type() is` test above does not narrow; a `cast`
                    # is a Python call a request).
                    principal, body, error = prepared  # type: ignore[misc]
                    close = type(error) is TooLarge
                    if op in LEASE_CALLS and error is None:
                        # A step's call: what `call` does for its row, in one frame.
                        reply = await protocol.handle_lease(op, target or "", body, None)
                    elif op not in LONG_POLLS or error is not None:
                        query = _query(scope) if scope["query_string"] else {}
                        reply = await protocol.handle(op, principal, target=target, query=query,
                                                      body=body, error=error)
                    elif exchange is not None:
                        # A disconnect cancels the call (`HttpExchange.client_gone`).
                        if exchange.gone:
                            raise ClientGone
                        query = _query(scope) if scope["query_string"] else {}
                        exchange.watch = call
                        try:
                            reply = await protocol.handle(op, principal, target=target,
                                                          query=query, body=body,
                                                          held=tracking.poll)
                        finally:
                            exchange.watch = None
                    else:
                        query = _query(scope) if scope["query_string"] else {}
                        reply = await _long_poll(protocol, receive, op, principal, target, query,
                                                 body)
            except ClientGone:
                gone = True
        if reply is None:
            if gone or (exchange is not None and exchange.gone):
                self._count(template, 499)  # the client went away before the answer
                return
            if tracking.drained:  # a long-poll the drain ended (`Protocol.call`'s ``held``)
                reply = error_reply(Unavailable("the daemon is shutting down"))
            else:
                # The grace period of a shutdown ran out while this call was in flight.
                reply, close = error_reply(Unavailable("the daemon is shutting down")), True
        if exchange is not None:
            head = _JSON_LINE
            if reply.headers:
                head += b"".join([b"%s: %s\r\n" % pair for pair in reply.headers])
            await exchange.respond(reply.status, head, encode_json(reply.body), close=close)
        else:
            await send_reply(send, reply, close=close)
        # `_count`, written out (every request).
        child = self._counted.get((template, reply.status))
        if child is None:
            self._count(template, reply.status)
        else:
            child.inc()

    def _count(self, template: str, status: int) -> None:
        """``stepd_http_requests_total{route, status}`` += 1 (the series looked up once)."""
        key = (template, status)
        child = self._counted.get(key)
        if child is None:
            child = self._counted[key] = self._requests.labels(template, str(status))
        child.inc()

    def _prepare(self, scope: Scope, op: Operation, exchange: HttpExchange | None
                 ) -> _Prepared | Reply | Unauthorized | Forbidden | None:
        """The caller and the body of ``op``, without waiting: a refusal's `Reply` (a
        cross-site request), the refused authorization (`Protocol.refused` audits it),
        or None when the body must be read as it streams (`_prepare_streamed`)."""
        protocol = self.protocol
        host, origin, authorization, declared = heads(scope)
        keyless = self._keyless
        if keyless is not None:
            seen = self._keyless_seen
            if (host, origin) not in seen:
                try:
                    protocol.check_keyless(None if host is None else host.decode("latin-1"),
                                           None if origin is None else origin.decode("latin-1"))
                except CrossSite as exc:
                    return error_reply(exc)
                if len(seen) >= _KEYLESS_SEEN_MAX:
                    seen.clear()
                seen.add((host, origin))
            principal = keyless.get(op)
            if principal is None:
                principal = keyless[op] = protocol.authorize(op, None)
        else:
            try:
                principal = protocol.authorize(
                    op, None if authorization is None else authorization.decode("latin-1"))
            except (Unauthorized, Forbidden) as exc:
                return exc
        if SPECS[op].body == "none":
            return principal, NO_BODY, None
        if exchange is None:
            return None
        try:
            limit = protocol.max_body_bytes
            check_length(declared, limit)
            raw = exchange.take_body()
            if raw is None:
                return None
            if len(raw) > limit:
                raise TooLarge(f"the body is over the limit of {limit} bytes")
            return principal, decode_json(raw) if raw and not raw.isspace() else NO_BODY, None
        except (TooLarge, Invalid) as exc:
            return principal, NO_BODY, exc

    async def _prepare_streamed(self, scope: Scope, receive: Receive, op: Operation
                                ) -> _Prepared | Reply | Unauthorized | Forbidden:
        """`_prepare`, reading the body through ASGI's ``receive``.

        Raises:
            ClientGone: the client disconnected meanwhile.
        """
        protocol = self.protocol
        host, origin, authorization, declared = heads(scope)
        try:
            protocol.check_keyless(None if host is None else host.decode("latin-1"),
                                   None if origin is None else origin.decode("latin-1"))
        except CrossSite as exc:
            return error_reply(exc)
        try:
            principal = protocol.authorize(
                op, None if authorization is None else authorization.decode("latin-1"))
        except (Unauthorized, Forbidden) as exc:
            return exc
        try:
            raw = await read_body(scope, receive, protocol.max_body_bytes, declared)
            return principal, decode_json(raw) if raw and not raw.isspace() else NO_BODY, None
        except (TooLarge, Invalid) as exc:
            return principal, NO_BODY, exc

    async def _not_an_operation(self, scope: Scope, send: Send, found: Route | None) -> None:
        """404, 405, 503 while draining, and the endpoints that are not protocol operations."""
        if found is None:
            await send_reply(send, error_reply(NotFound(f"no such endpoint: {scope['path']}")))
            self._count("unmatched", 404)
            return
        template, methods, target = found
        handler = methods.get(scope["method"])
        if handler is None:
            allow = ", ".join(sorted(methods)).encode()
            body = {"error": "method_not_allowed",
                    "message": f"{scope['method']} is not allowed here; use {allow.decode()}"}
            await send_response(send, 405, encode_json(body), [JSON_HEADER, (b"allow", allow)])
            self._count(template, 405)
            return
        protocol = self.protocol
        if protocol.draining:
            status = await self._answer(send, error_reply(Unavailable("the daemon is shutting down")))
            self._count(template, status)
            return
        assert isinstance(handler, Special)
        started: list[bool] = []

        async def tracked_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                started.append(True)
            await send(message)

        status = 503
        with protocol.tracking() as call:
            status = await self._dispatch_special(scope, tracked_send, handler, target)
        if call.cancelled_caught and not started:
            # The grace period of a shutdown ran out while this call was in flight.
            status = await self._answer(send, error_reply(Unavailable(
                "the daemon is shutting down")), close=True)
        self._count(template, status)

    async def _answer(self, send: Send, reply: Reply, *, close: bool = False) -> int:
        await send_reply(send, reply, close=close)
        return reply.status

    async def _dispatch_special(self, scope: Scope, send: Send, handler: Special,
                                target: str | None) -> int:
        if handler is HEALTHZ:
            return await self._answer(send, Reply(200, {"status": "ok"}))
        if handler is METRICS:
            text = (await self.protocol.render_metrics()).encode("utf-8")
            await send_response(send, 200, text,
                                [(b"content-type", METRICS_CONTENT_TYPE.encode())])
            return 200
        if handler is OPENAPI:
            await send_response(send, 200, openapi_bytes(), [JSON_HEADER])
            return 200
        if handler is UI:
            return await send_asset(scope, send, target)
        if handler is UI_REDIRECT:
            return await send_redirect(send)
        assert handler is CONNECT
        upgrade = {"error": "upgrade_required",
                   "message": "this endpoint is the worker WebSocket: send an Upgrade request"}
        await send_response(send, 426, encode_json(upgrade),
                            [JSON_HEADER, (b"upgrade", b"websocket")])
        return 426


_Prepared = tuple[Principal, Any, StepdError | None]
"""What a call needs besides its path: the caller, the body (or `NO_BODY`), and the
refusal found while reading it (413, malformed JSON), which `Protocol.call` records."""


async def _long_poll(protocol: Protocol, receive: Receive, op: Operation, principal: Principal,
                     target: str | None, query: dict[str, str], body: Any) -> Reply:
    """A long-poll under another server: cancelled when ``receive`` says the client left.

    Raises:
        ClientGone: it did.
    """

    async def run() -> Reply:
        return await protocol.handle(op, principal, target=target, query=query, body=body)

    reply = await until_disconnect(receive, run)
    if reply is None:
        raise ClientGone
    return reply


def _query(scope: Scope) -> dict[str, str]:
    """The query's fields (the last of a repeated name), as ``parse_qsl`` reads them.

    A query with nothing to decode (no ``%``, no ``+``: a client's
    ``wait_ms=30000``) is split here, in a few C calls instead of ~20 Python ones.
    """
    text = scope["query_string"].decode("latin-1")
    if "%" in text or "+" in text:
        return dict(parse_qsl(text, keep_blank_values=True, errors="replace"))
    out: dict[str, str] = {}
    for piece in text.split("&"):
        if piece:
            name, _, value = piece.partition("=")
            out[name] = value
    return out


async def _lifespan(receive: Receive, send: Send) -> None:
    """A minimal lifespan: the daemon starts and stops its core itself."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


def create_app(protocol: Protocol, *, max_in_flight: int = 64, max_queue: int = 256,
               max_queue_bytes: int = DEFAULT_MAX_QUEUE_BYTES) -> HttpApp:
    """The daemon's ASGI app over ``protocol`` (HTTP and the worker WebSocket).

    Args:
        protocol: the shared protocol handler.
        max_in_flight: WebSocket request frames answered concurrently per connection.
        max_queue: frames queued for sending per WebSocket connection.
        max_queue_bytes: bytes of frames waiting to be sent per WebSocket
            connection before it is closed (1013).
    """
    return HttpApp(
        protocol,
        sockets=WorkerSockets(protocol, max_in_flight=max_in_flight, max_queue=max_queue,
                              max_queue_bytes=max_queue_bytes),
    )
