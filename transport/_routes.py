"""The daemon's HTTP routes: ``(method, path)`` -> the protocol `Operation`
(or the endpoint that is not one: health, metrics, the document, the console,
the WebSocket's path) and the id the path names.

A route is one dict lookup (static paths) or a split and a match (paths with
an id): worker lease calls first, as they are most of what is served. An
unknown path is None (404); a known one with another method is a route whose
methods lack it (405, with ``Allow``).
"""

from __future__ import annotations

from typing import Final

from .protocol import Operation

__all__ = ["CONNECT", "HEALTHZ", "METRICS", "OPENAPI", "UI", "UI_REDIRECT", "Handler", "Route",
           "Special", "route"]


class Special:
    """An endpoint that is not a protocol operation (health, metrics, the document)."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<{self.name}>"


HEALTHZ: Final = Special("healthz")
METRICS: Final = Special("metrics")
OPENAPI: Final = Special("openapi")
CONNECT: Final = Special("connect")
UI: Final = Special("ui")
UI_REDIRECT: Final = Special("ui_redirect")

Handler = Operation | Special


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
    if path.startswith("/v1/api/runs/"):  # second: a client's status and result reads
        parts = path[13:].split("/")
        if not parts[0]:
            return None
        n = len(parts)
        if n == 1:
            return _RUN_ROUTE[0], _RUN_ROUTE[1], parts[0]
        if n == 2:
            found = _RUN_SUBROUTES.get(parts[1])
            if found is not None:
                return found[0], found[1], parts[0]
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
    return None
