"""ASGI's messages, for the app's requests that do not go through `HttpExchange`:
the head's fields, the body (bounded as it streams), the answer, and a
long-poll's watch for ``http.disconnect`` (under another ASGI server, or a
body still arriving when the app is called).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Final

import anyio

from stepd.sansio.errors import Invalid

from ._json import encode_json
from .replies import Reply, TooLarge

__all__ = ["JSON_HEADER", "ClientGone", "Message", "Receive", "Scope", "Send", "check_length",
           "header", "heads", "read_body", "send_reply", "send_response", "until_disconnect"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

JSON_HEADER: Final = (b"content-type", b"application/json")


class ClientGone(Exception):
    """The client disconnected before the request was answered."""


def header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value)
    return None


def heads(scope: Scope) -> tuple[bytes | None, bytes | None, bytes | None, bytes | None]:
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


def check_length(declared: bytes | None, limit: int) -> None:
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


async def read_body(scope: Scope, receive: Receive, limit: int,
                    declared: bytes | None = None) -> bytes:
    """The whole request body, refused past ``limit`` bytes (announced or streamed).

    Raises:
        TooLarge: over the limit.
        Invalid: a malformed ``Content-Length``.
        ClientGone: the client disconnected meanwhile.
    """
    check_length(declared if declared is not None else header(scope, b"content-length"), limit)
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        kind = message["type"]
        if kind == "http.disconnect":
            raise ClientGone
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


async def until_disconnect(receive: Receive, fn: Callable[[], Awaitable[Reply]]
                           ) -> Reply | None:
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


async def send_response(send: Send, status: int, body: bytes,
                        headers: list[tuple[bytes, bytes]]) -> None:
    headers.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def send_reply(send: Send, reply: Reply, *, close: bool = False) -> None:
    headers = [JSON_HEADER, *reply.headers]
    if close:
        headers.append((b"connection", b"close"))
    await send_response(send, reply.status, encode_json(reply.body), headers)
