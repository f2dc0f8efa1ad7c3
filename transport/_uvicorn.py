"""uvicorn's protocols with the limits uvicorn does not enforce itself (docs/serve.md "Limits").

`stepd serve` runs uvicorn with these subclasses of its httptools and
websockets-sansio protocols: every HTTP request is answered or closed within
``max_request_ms`` of its first byte (the server's tick expires them), request
heads are bounded (64 KiB, 100 fields), and a WebSocket whose peer does not
read can still be closed.

The one name they are imported by; each protocol is its own module:
`_uvicorn_http` (`HttpProtocol`, its `HttpExchange`) and `_uvicorn_ws`
(`WebSocketProtocol`, its `FrameSink`). They share nothing but uvicorn.
"""

from __future__ import annotations

from ._uvicorn_http import EXCHANGE_EXTENSION, LINGER_S, HttpExchange, HttpProtocol, http_protocol
from ._uvicorn_ws import WIRE_EXTENSION, FrameSink, WebSocketProtocol

__all__ = ["EXCHANGE_EXTENSION", "LINGER_S", "WIRE_EXTENSION", "FrameSink", "HttpExchange",
           "HttpProtocol", "WebSocketProtocol", "http_protocol"]
