"""Errors as every transport answers them: an HTTP status and a JSON body (OpenAPI "Errors").

One mapping for every transport (`error_reply`), so a rejection cannot drift
between HTTP, the WebSocket and the in-process adapter. What an answer repeats
of the client's input is cut (`_bounded`): a 1 MB id echoed in every 404 once
grew a daemon by hundreds of MB for a client that did not read.

Besides the daemon's errors (`stepd.sansio.errors`: `Invalid` 400,
`NotFound` 404, the four `Conflict` reasons and `SignalRefused` 409,
`Unprocessable` 422, `Unavailable` 503) and auth's (`Unauthorized` 401,
`Forbidden` 403), the transport adds two::

    StepdError
    +-- TooLarge     a request body (or WebSocket message) over the limit: 413
    +-- CrossSite    a keyless daemon refusing a browser-originated request: 403
"""

from __future__ import annotations

from typing import Any, Final

from stepd.actors.daemon import SignalRefused
from stepd.sansio.errors import (
    Conflict,
    Invalid,
    NotFound,
    NotRetryable,
    StepdError,
    Unavailable,
    Unprocessable,
)
from stepd.sansio.frozen import frozen
from stepd.storage import StorageClosed

from .auth import Forbidden, Unauthorized

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "MAX_ECHO",
    "MAX_MESSAGE",
    "CrossSite",
    "Reply",
    "TooLarge",
    "bounded",
    "error_reply",
    "reason_of",
    "status_of",
]

DEFAULT_MAX_BODY_BYTES: Final = 8 << 20
"""The default limit on a request body (HTTP) or a message (WebSocket): 8 MiB."""


class TooLarge(StepdError):
    """A request body or WebSocket message over the daemon's limit (HTTP 413)."""


class CrossSite(StepdError):
    """A keyless daemon refusing a request a web page could have made (HTTP 403).

    Without keys, anything that reaches the port may drive the daemon, and a
    web page open in a local browser can reach a loopback port: a cross-site
    ``fetch`` or WebSocket carries an ``Origin`` header, and a DNS-rebinding
    page sends its own host name in ``Host``. So a daemon without keys refuses
    both (never audited: there is no key). With keys a page cannot present one
    (stepd uses no cookies), so the check is off.

    Attributes:
        message: why.
        reason: ``browser_origin`` or ``host_not_loopback``.
    """

    def __init__(self, message: str, *, reason: str) -> None:
        super().__init__(message)
        self.message = message
        self.reason = reason


# --------------------------------------------------------------------------- replies


@frozen
class Reply:
    """An answer as every transport sends it: an HTTP status and a JSON body."""

    status: int
    body: dict[str, Any]
    headers: tuple[tuple[bytes, bytes], ...] = ()


def status_of(exc: BaseException) -> int:
    """The HTTP status an error answers with (500 for anything unexpected)."""
    if isinstance(exc, Invalid):
        return 400
    if isinstance(exc, Unauthorized):
        return 401
    if isinstance(exc, (Forbidden, CrossSite)):
        return 403
    if isinstance(exc, NotFound):
        return 404
    if isinstance(exc, Conflict):
        return 409
    if isinstance(exc, TooLarge):
        return 413
    if isinstance(exc, Unprocessable):
        return 422
    if isinstance(exc, (Unavailable, StorageClosed)):
        return 503
    return 500


def reason_of(exc: BaseException) -> str:
    """The audit entry's short reason for a refusal."""
    if isinstance(exc, Conflict):
        return exc.reason
    if isinstance(exc, (Unauthorized, Forbidden)):
        return exc.reason
    return {
        400: "invalid",
        404: "not_found",
        413: "too_large",
        422: "unprocessable",
        503: "unavailable",
    }.get(status_of(exc), "internal")


def _message(exc: BaseException) -> str:
    return getattr(exc, "message", None) or str(exc) or type(exc).__name__


MAX_ECHO: Final = 128
"""The most characters of one run of non-blank text an error repeats (docs/http-api.md "Errors").

Error messages quote what the client sent (a lease or run id, an unknown key,
a path): cut, an answer stays small whatever the input (a 1 MB lease id was
echoed whole in every 404, and a WebSocket queues 256 answers). 128 keeps
every well-formed id and name whole (ids are at most 64 characters, names and
step ids 128).
"""
MAX_MESSAGE: Final = 1024
"""The most characters of an error's ``message`` (and of its ``field``)."""

def bounded(text: str) -> str:
    """``text`` as an error may repeat it: every run of more than `MAX_ECHO`
    characters without a space cut to its first 64 (``'l_aaa...(1048578 chars)``),
    and at most `MAX_MESSAGE` characters in all."""
    if len(text) <= MAX_ECHO:
        return text
    words = text.split(" ")  # C speed; a regex over a 1 MB id cost ~10 ms
    if any(len(word) > MAX_ECHO for word in words):
        text = " ".join(word if len(word) <= MAX_ECHO else f"{word[:64]}...({len(word)} chars)"
                        for word in words)
    if len(text) > MAX_MESSAGE:
        text = text[:MAX_MESSAGE - 3] + "..."
    return text


def error_reply(exc: BaseException) -> Reply:
    """The status and body an error answers with (OpenAPI "Errors").

    400 ``{"error": "invalid", "message", "field"[, "definition"]}``; 401
    ``unauthorized`` (with ``WWW-Authenticate``); 403 ``forbidden``; 404
    ``not_found``; 409 ``{"error": "conflict", "reason", "message"}`` (and
    ``budget`` for a refused signal); 413 ``too_large``; 422 ``unprocessable``;
    503 ``unavailable``; anything else 500 ``internal``. What the body repeats
    of the client's input is cut (`_bounded`).
    """
    status = status_of(exc)
    if isinstance(exc, Invalid):
        field = exc.field
        body: dict[str, Any] = {"error": "invalid", "message": bounded(str(exc)),
                                "field": field if field is None else bounded(field)}
        if exc.definition is not None:
            body["definition"] = bounded(exc.definition)
        return Reply(400, body)
    if isinstance(exc, Unauthorized):
        return Reply(
            401,
            {"error": "unauthorized", "message": bounded(exc.message)},
            ((b"www-authenticate", exc.www_authenticate.encode("latin-1")),),
        )
    if isinstance(exc, (Forbidden, CrossSite)):
        return Reply(403, {"error": "forbidden", "message": bounded(exc.message)})
    if isinstance(exc, SignalRefused):
        return Reply(
            409,
            {"error": "conflict", "reason": exc.reason, "budget": exc.budget,
             "message": bounded(exc.message)},
        )
    if isinstance(exc, Conflict):
        conflict = {"error": "conflict", "reason": exc.reason,
                    "message": bounded(exc.message or exc.reason)}
        if isinstance(exc, NotRetryable) and exc.budget is not None:
            conflict["budget"] = exc.budget  # the budget a retry would breach again
        return Reply(409, conflict)
    if isinstance(exc, Unprocessable):
        return Reply(422, {"error": "unprocessable", "message": bounded(_message(exc)),
                           "field": None})
    code = {
        404: "not_found",
        413: "too_large",
        503: "unavailable",
    }.get(status, "internal")
    message = bounded(_message(exc)) if status != 500 else "internal error; see the daemon's log"
    return Reply(status, {"error": code, "message": message})


