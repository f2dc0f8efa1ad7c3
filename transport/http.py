"""The HTTP face of the daemon: a raw ASGI app over the shared `Protocol`.

Every endpoint of PROTOCOL.md (and ``transport/openapi.json``) on one ASGI
callable, for uvicorn (``http="httptools"``, ``loop="uvloop"`` where
available); the worker WebSocket (`stepd.transport.websocket`) is served by the
same app on the same port. No framework sits on the hot path: a request is one
dict lookup (static paths) or a split and a match (paths with an id), one
authorization, one body read, one `Protocol.handle`, one response.

What this module adds to `Protocol`, and nothing more (STYLE.md rule 20):

* routing: ``(method, path)`` -> `Operation` and the path id; an unknown path
  is 404, a known path with another method 405 (with ``Allow``);
* the body: a ``Content-Length`` over ``max_body_bytes`` is refused before a
  byte is read, and a body streamed without one is counted as it arrives:
  413 either way (``Connection: close``: the rest is never read); malformed
  JSON is 400 naming the problem (`stepd.transport.protocol.decode_json`);
* long-polls (``claim``, ``result?wait_ms=``) end when the client disconnects
  (``http.disconnect``): the daemon call is cancelled (a claim cancelled so
  returns the slots it had not offered yet) and nothing is sent;
* ``GET /healthz``, ``GET /metrics`` (Prometheus text), ``GET /openapi.json``;
* the web console's static files at ``/ui/`` (``transport/console/``, docs/console.md):
  read once from the package, served by exact name (no directory listing, no
  path from the request ever reaches the file system), with a strict
  ``Content-Security-Policy``;
* 503 for everything once the daemon drains;
* ``stepd_http_requests_total{route, status}`` for every answer (``499``: the
  client went away before the answer).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import re
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from dataclasses import dataclass
from importlib import resources
from importlib.abc import Traversable
from pathlib import Path
from typing import Any, Final, cast
from urllib.parse import parse_qsl

import anyio

from stepd.sansio.errors import Invalid, NotFound, StepdError, Unavailable

from ._uvicorn import EXCHANGE_EXTENSION, HttpExchange
from .auth import Forbidden, Principal, Unauthorized
from .metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from .metrics import CounterChild
from .openapi import openapi_bytes
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

__all__ = ["HttpApp", "create_app"]

log = logging.getLogger("stepd.transport.http")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

_JSON: Final = (b"content-type", b"application/json")


class _Special:
    """An endpoint that is not a protocol operation (health, metrics, the document)."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<{self.name}>"


HEALTHZ: Final = _Special("healthz")
METRICS: Final = _Special("metrics")
OPENAPI: Final = _Special("openapi")
CONNECT: Final = _Special("connect")
UI: Final = _Special("ui")
UI_REDIRECT: Final = _Special("ui_redirect")

Handler = Operation | _Special


def _as_handler(op: Operation) -> Handler:
    return op

Route = tuple[str, dict[str, Handler], str | None]  # (template, method -> handler, path id)

_STATIC_METHODS: Final[dict[str, dict[str, Handler]]] = {
        "/v1/api/workers/register": {"POST": Operation.REGISTER},
        "/v1/api/workers": {"GET": Operation.LIST_WORKERS},
        "/v1/api/workers/connect": {"GET": CONNECT},
        "/v1/api/steps/claim": {"POST": Operation.CLAIM},
        "/v1/api/runs": {"POST": Operation.START_RUN, "GET": Operation.LIST_RUNS},
        "/v1/api/audit": {"GET": Operation.AUDIT},
        "/v1/api/actors": {"GET": Operation.ACTORS},
        "/v1/api/actors/kill": {"POST": Operation.KILL},
        "/v1/api/definitions": {"GET": Operation.DEFINITIONS},
        "/v1/api/stats": {"GET": Operation.STATS},
        "/v1/api/daemon": {"GET": Operation.DAEMON},
        "/v1/api/schedules": {"POST": Operation.CREATE_SCHEDULE,
                              "GET": Operation.LIST_SCHEDULES},
        "/v1/api/runs/prune": {"POST": Operation.PRUNE_RUNS},
        "/healthz": {"GET": HEALTHZ},
        "/metrics": {"GET": METRICS},
        "/openapi.json": {"GET": OPENAPI},
}
_STATIC: Final[dict[str, tuple[str, dict[str, Handler]]]] = {
    path: (path, methods) for path, methods in _STATIC_METHODS.items()
}

_LEASE_ROUTES: Final[dict[str, tuple[str, dict[str, Handler]]]] = {
    name: (f"/v1/api/steps/{{lease}}/{name}", {"POST": _as_handler(op)})
    for name, op in (
        ("started", Operation.STARTED),
        ("heartbeat", Operation.HEARTBEAT),
        ("complete", Operation.COMPLETE),
        ("fail", Operation.FAIL),
    )
}
_LEASE_ROUTES["history"] = ("/v1/api/steps/{lease}/history", {"GET": Operation.HISTORY})
_SESSION_ROUTES: Final[dict[str, tuple[str, dict[str, Handler]]]] = {
    name: (f"/v1/api/sessions/{{session}}/{name}", {"POST": _as_handler(op)})
    for name, op in (("renew", Operation.SESSION_RENEW), ("close", Operation.SESSION_CLOSE))
}
_RUN_ROUTE: Final[tuple[str, dict[str, Handler]]] = (
    "/v1/api/runs/{run}", {"GET": Operation.GET_RUN})
_RUN_SUBROUTES: Final[dict[str, tuple[str, dict[str, Handler]]]] = {
    name: (f"/v1/api/runs/{{run}}/{name}", {method: _as_handler(op)})
    for name, method, op in (
        ("journal", "GET", Operation.JOURNAL),
        ("export", "GET", Operation.EXPORT),
        ("result", "GET", Operation.RESULT),
        ("signal", "POST", Operation.SIGNAL),
        ("cancel", "POST", Operation.CANCEL),
        ("retry", "POST", Operation.RETRY),
        ("fork", "POST", Operation.FORK),
    )
}


_SCHEDULE_ROUTE: Final[tuple[str, dict[str, Handler]]] = (
    "/v1/api/schedules/{schedule}",
    {"GET": Operation.GET_SCHEDULE, "DELETE": Operation.DELETE_SCHEDULE})
_SCHEDULE_SUBROUTES: Final[dict[str, tuple[str, dict[str, Handler]]]] = {
    name: (f"/v1/api/schedules/{{schedule}}/{name}", {"POST": _as_handler(op)})
    for name, op in (("pause", Operation.PAUSE_SCHEDULE), ("resume", Operation.RESUME_SCHEDULE))
}


_UI_ROUTE: Final[tuple[str, dict[str, Handler]]] = ("/ui/{asset}", {"GET": UI, "HEAD": UI})
_UI_REDIRECT_ROUTE: Final[tuple[str, dict[str, Handler]]] = (
    "/ui", {"GET": UI_REDIRECT, "HEAD": UI_REDIRECT})


def route(path: str) -> Route | None:
    """The route of a path: its template, its methods, and the id it names (if any).

    For the console (``/ui/...``) the "id" is the asset's name (``index.html``
    for ``/ui/``); whether such an asset exists is decided when it is served.
    """
    static = _STATIC.get(path)
    if static is not None:
        return static[0], static[1], None
    if path.startswith("/v1/api/steps/"):  # first: a worker's lease calls
        lease, _, name = path[14:].rpartition("/")
        if lease and "/" not in lease:
            found = _LEASE_ROUTES.get(name)
            if found is not None:
                return found[0], found[1], lease
        return None
    if path.startswith("/ui/"):
        return _UI_ROUTE[0], _UI_ROUTE[1], path[4:] or "index.html"
    if path == "/ui":
        return _UI_REDIRECT_ROUTE[0], _UI_REDIRECT_ROUTE[1], None
    if path.startswith("/v1/api/sessions/"):
        parts = path[len("/v1/api/sessions/"):].split("/")
        if len(parts) == 2 and parts[0]:
            found = _SESSION_ROUTES.get(parts[1])
            if found is not None:
                return found[0], found[1], parts[0]
        return None
    if path.startswith("/v1/api/schedules/"):
        parts = path[len("/v1/api/schedules/"):].split("/")
        if not parts[0] or len(parts) > 2:
            return None
        if len(parts) == 1:
            return _SCHEDULE_ROUTE[0], _SCHEDULE_ROUTE[1], parts[0]
        found = _SCHEDULE_SUBROUTES.get(parts[1])
        return None if found is None else (found[0], found[1], parts[0])
    if path.startswith("/v1/api/runs/"):
        parts = path[len("/v1/api/runs/"):].split("/")
        if not parts[0]:
            return None
        if len(parts) == 1:
            return _RUN_ROUTE[0], _RUN_ROUTE[1], parts[0]
        if len(parts) == 2:
            found = _RUN_SUBROUTES.get(parts[1])
            if found is not None:
                return found[0], found[1], parts[0]
    return None


# --------------------------------------------------------------------------- the console

CONSOLE_DIR: Final = "console"
"""The console's static files: ``transport/console/``, package data of ``stepd.transport``."""

CONTENT_TYPES: Final[Mapping[str, str]] = {
    ".html": "text/html; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
}
"""The only files served, by suffix: anything else in the folder is never sent."""

CONSOLE_CSP: Final = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; font-src 'self'; object-src 'none'; base-uri 'none'; "
    "form-action 'self'; frame-ancestors 'none'; "
    "require-trusted-types-for 'script'; trusted-types 'none'"
)
"""The console's Content-Security-Policy: its own files only, no inline script or
style, no frames; and (Trusted Types, where the browser has them) no string ever
reaches an HTML sink such as ``innerHTML``: it throws instead."""

_UI_HEADERS: Final[tuple[tuple[bytes, bytes], ...]] = (
    (b"content-security-policy", CONSOLE_CSP.encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"x-frame-options", b"DENY"),
    (b"cross-origin-opener-policy", b"same-origin"),
    (b"cross-origin-resource-policy", b"same-origin"),
)
_UI_CACHE: Final = (b"cache-control", b"no-cache")
_ASSET_NAME: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*(\.[A-Za-z0-9_-]+)*")


@dataclass(frozen=True, slots=True)
class Asset:
    """One file of the console, as served."""

    body: bytes
    content_type: str
    etag: bytes


def _console_root() -> Traversable:
    root = resources.files(__package__).joinpath(CONSOLE_DIR)
    if root.is_dir():
        return root
    # A strict editable install links only declared files: use the folder itself.
    return Path(__file__).resolve().parent / CONSOLE_DIR


@functools.cache
def console_assets() -> Mapping[str, Asset]:
    """The console's files by name (``index.html``, ``js/run.js``), read once.

    Only files whose every path segment is a plain name (letters, digits,
    ``_``, ``-``, dots between them: no dotfile, no ``..``) and whose suffix is
    in `CONTENT_TYPES` are kept. A request is answered from this mapping by
    exact name, so nothing in a request path reaches the file system.
    """
    assets: dict[str, Asset] = {}

    def walk(folder: Traversable, prefix: str) -> None:
        for entry in sorted(folder.iterdir(), key=lambda e: e.name):
            if not _ASSET_NAME.fullmatch(entry.name):
                continue
            if entry.is_dir():
                walk(entry, f"{prefix}{entry.name}/")
                continue
            ctype = CONTENT_TYPES.get(Path(entry.name).suffix)
            if ctype is None:
                continue
            body = entry.read_bytes()
            etag = f'"{hashlib.sha256(body).hexdigest()[:32]}"'.encode()
            assets[prefix + entry.name] = Asset(body, ctype, etag)

    root = _console_root()
    if root.is_dir():
        walk(root, "")
    return assets


def _etag_matches(header: bytes | None, etag: bytes) -> bool:
    if header is None:
        return False
    tags = [t.strip().removeprefix(b"W/") for t in header.split(b",")]
    return etag in tags or b"*" in tags


async def _send_asset(scope: Scope, send: Send, name: str | None) -> int:
    """One console file; 404 for any name that is not exactly one of them."""
    asset = console_assets().get(name) if name else None
    if asset is None:
        body = encode_json({"error": "not_found", "message": "no such file in the console"})
        await _send(send, 404, body, [_JSON, *_UI_HEADERS])
        return 404
    headers = [(b"etag", asset.etag), _UI_CACHE, *_UI_HEADERS]
    if _etag_matches(_header(scope, b"if-none-match"), asset.etag):
        await send({"type": "http.response.start", "status": 304, "headers": headers})
        await send({"type": "http.response.body", "body": b""})
        return 304
    headers += [(b"content-type", asset.content_type.encode()),
                (b"content-length", str(len(asset.body)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body",
                "body": b"" if scope["method"] == "HEAD" else asset.body})
    return 200


class _ClientGone(Exception):
    """The client disconnected before the request was answered."""


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value)
    return None


def _heads(scope: Scope) -> tuple[bytes | None, bytes | None, bytes | None, bytes | None]:
    """``Host``, ``Origin``, ``Authorization`` and ``Content-Length`` (the first of each)
    in one pass over the headers: what every operation reads."""
    host = origin = authorization = length = None
    for key, value in scope["headers"]:
        if key == b"host":
            if host is None:
                host = value
        elif key == b"authorization":
            if authorization is None:
                authorization = value
        elif key == b"content-length":
            if length is None:
                length = value
        elif key == b"origin" and origin is None:
            origin = value
    return host, origin, authorization, length


def _check_length(declared: bytes | None, limit: int) -> None:
    """Refuse a declared ``Content-Length`` over ``limit`` before a byte of the body is read.

    Raises:
        TooLarge: over the limit.
        Invalid: a malformed ``Content-Length``.
    """
    if declared is not None:
        try:
            length = int(declared)
        except ValueError:
            raise Invalid("malformed Content-Length header") from None
        if length > limit:
            raise TooLarge(f"the body ({length} bytes) is over the limit of {limit} bytes")


async def _read_body(scope: Scope, receive: Receive, limit: int,
                     declared: bytes | None = None) -> bytes:
    """The whole request body, refused past ``limit`` bytes (announced or streamed).

    Raises:
        TooLarge: over the limit.
        Invalid: a malformed ``Content-Length``.
        _ClientGone: the client disconnected meanwhile.
    """
    _check_length(declared if declared is not None else _header(scope, b"content-length"), limit)
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        kind = message["type"]
        if kind == "http.disconnect":
            raise _ClientGone
        if kind != "http.request":
            continue
        chunk = message.get("body", b"")
        if chunk:
            size += len(chunk)
            if size > limit:
                raise TooLarge(f"the body is over the limit of {limit} bytes")
            chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _until_disconnect(receive: Receive, fn: Callable[[], Awaitable[Reply]]) -> Reply | None:
    """Run ``fn``; cancel it and return None if the client disconnects first.

    The body has been read already, so the next ``http.disconnect`` is the
    client going away (PROTOCOL.md: an abandoned long-poll must not hold work).
    Under a server other than stepd's own protocol (`HttpExchange` tells of a
    disconnect without a task); a second task reads ``receive`` meanwhile.
    """
    result: list[Reply] = []
    async with anyio.create_task_group() as tg:

        async def watch() -> None:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    tg.cancel_scope.cancel()
                    return

        tg.start_soon(watch)
        result.append(await fn())
        tg.cancel_scope.cancel()
    return result[0] if result else None


async def _send(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    headers.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _send_reply(send: Send, reply: Reply, *, close: bool = False) -> None:
    headers = [_JSON, *reply.headers]
    if close:
        headers.append((b"connection", b"close"))
    await _send(send, reply.status, encode_json(reply.body), headers)


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
        # The operation's reply is made inside the call's tracking scope and sent
        # after it, so a shutdown that cancels the call never cuts an answer in half.
        # Under stepd's own protocol (`HttpExchange`) the body is read from the
        # parser's buffer, the answer leaves in one write, and a long-poll is
        # cancelled by the disconnect itself.
        extensions = scope.get("extensions")
        exchange: HttpExchange | None = (
            extensions.get(EXCHANGE_EXTENSION) if extensions is not None else None)
        reply: Reply | None = None
        close = False
        gone = False
        with protocol.tracking() as call:
            try:
                prepared = self._prepare(scope, op, exchange)
                if prepared is None:  # the body is still arriving, or another server
                    prepared = await self._prepare_streamed(scope, receive, op)
                if type(prepared) is Reply:
                    reply = prepared
                elif isinstance(prepared, (Unauthorized, Forbidden)):
                    reply = await protocol.refused(op, prepared, target)
                else:
                    principal, body, error = cast(_Prepared, prepared)
                    close = type(error) is TooLarge
                    query = _query(scope) if scope["query_string"] else {}
                    if op not in LONG_POLLS or error is not None:
                        reply = await protocol.handle(op, principal, target=target, query=query,
                                                      body=body, error=error)
                    elif exchange is not None:
                        # A disconnect cancels the call's scope (`HttpExchange.client_gone`).
                        if exchange.gone:
                            raise _ClientGone
                        exchange.watch = call
                        try:
                            reply = await protocol.handle(op, principal, target=target,
                                                          query=query, body=body)
                        finally:
                            exchange.watch = None
                    else:
                        reply = await _long_poll(protocol, receive, op, principal, target, query,
                                                 body)
            except _ClientGone:
                gone = True
        if reply is None:
            if gone or (exchange is not None and exchange.gone):
                self._count(template, 499)  # the client went away before the answer
                return
            # The grace period of a shutdown ran out while this call was in flight.
            reply, close = error_reply(Unavailable("the daemon is shutting down")), True
        if exchange is not None:
            head = _JSON_LINE
            if reply.headers:
                head += b"".join([b"%s: %s\r\n" % pair for pair in reply.headers])
            await exchange.respond(reply.status, head, encode_json(reply.body), close=close)
        else:
            await _send_reply(send, reply, close=close)
        self._count(template, reply.status)

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
        host, origin, authorization, declared = _heads(scope)
        if not protocol.keyring.enabled:
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
            _check_length(declared, limit)
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
            _ClientGone: the client disconnected meanwhile.
        """
        protocol = self.protocol
        host, origin, authorization, declared = _heads(scope)
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
            raw = await _read_body(scope, receive, protocol.max_body_bytes, declared)
            return principal, decode_json(raw) if raw and not raw.isspace() else NO_BODY, None
        except (TooLarge, Invalid) as exc:
            return principal, NO_BODY, exc

    async def _not_an_operation(self, scope: Scope, send: Send, found: Route | None) -> None:
        """404, 405, 503 while draining, and the endpoints that are not protocol operations."""
        if found is None:
            await _send_reply(send, error_reply(NotFound(f"no such endpoint: {scope['path']}")))
            self._count("unmatched", 404)
            return
        template, methods, target = found
        handler = methods.get(scope["method"])
        if handler is None:
            allow = ", ".join(sorted(methods)).encode()
            body = {"error": "method_not_allowed",
                    "message": f"{scope['method']} is not allowed here; use {allow.decode()}"}
            await _send(send, 405, encode_json(body), [_JSON, (b"allow", allow)])
            self._count(template, 405)
            return
        protocol = self.protocol
        if protocol.draining:
            status = await self._answer(send, error_reply(Unavailable("the daemon is shutting down")))
            self._count(template, status)
            return
        assert isinstance(handler, _Special)
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
        await _send_reply(send, reply, close=close)
        return reply.status

    async def _dispatch_special(self, scope: Scope, send: Send, handler: _Special,
                                target: str | None) -> int:
        if handler is HEALTHZ:
            return await self._answer(send, Reply(200, {"status": "ok"}))
        if handler is METRICS:
            text = (await self.protocol.render_metrics()).encode("utf-8")
            await _send(send, 200, text, [(b"content-type", METRICS_CONTENT_TYPE.encode())])
            return 200
        if handler is OPENAPI:
            await _send(send, 200, openapi_bytes(), [_JSON])
            return 200
        if handler is UI:
            return await _send_asset(scope, send, target)
        if handler is UI_REDIRECT:
            # /ui/ is the page: its relative links (./app.js) then resolve under /ui/.
            await _send(send, 308, b"", [(b"location", b"/ui/"), _UI_CACHE, *_UI_HEADERS])
            return 308
        assert handler is CONNECT
        upgrade = {"error": "upgrade_required",
                   "message": "this endpoint is the worker WebSocket: send an Upgrade request"}
        await _send(send, 426, encode_json(upgrade), [_JSON, (b"upgrade", b"websocket")])
        return 426


_Prepared = tuple[Principal, Any, StepdError | None]
"""What a call needs besides its path: the caller, the body (or `NO_BODY`), and the
refusal found while reading it (413, malformed JSON), which `Protocol.call` records."""


async def _long_poll(protocol: Protocol, receive: Receive, op: Operation, principal: Principal,
                     target: str | None, query: dict[str, str], body: Any) -> Reply:
    """A long-poll under another server: cancelled when ``receive`` says the client left.

    Raises:
        _ClientGone: it did.
    """

    async def run() -> Reply:
        return await protocol.handle(op, principal, target=target, query=query, body=body)

    reply = await _until_disconnect(receive, run)
    if reply is None:
        raise _ClientGone
    return reply


def _query(scope: Scope) -> dict[str, str]:
    text = scope["query_string"].decode("latin-1")
    return dict(parse_qsl(text, keep_blank_values=True, errors="replace"))


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
