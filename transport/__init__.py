"""Transports: one protocol handler, with HTTP, WebSocket and in-process adapters.

* `Protocol` (``stepd.transport.protocol``): validation, engine calls, error
  mapping, audit and drain, shared by every transport (STYLE.md rule 20).
* `create_app` / `HttpApp` (``stepd.transport.http``): the ASGI app serving
  every HTTP endpoint and, on the same port, the worker WebSocket
  (`WorkerSockets`, ``stepd.transport.websocket``).
* `InProcess` (``stepd.transport.inprocess``): the same calls without sockets.
* ``auth``, ``audit``, ``metrics``, ``openapi``: keys and scopes, the audit log,
  Prometheus metrics, the OpenAPI document.

The names are imported lazily, so ``import stepd.transport.auth`` does not
load the engine.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["HttpApp", "InProcess", "Operation", "Protocol", "Reply", "TooLarge", "WorkerSockets",
           "create_app"]

_WHERE = {
    "Protocol": "protocol",
    "Operation": "protocol",
    "Reply": "protocol",
    "TooLarge": "protocol",
    "HttpApp": "http",
    "create_app": "http",
    "WorkerSockets": "websocket",
    "InProcess": "inprocess",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
