"""A small OTLP/HTTP trace receiver on 127.0.0.1: for the tests and for bench B with export on.

It decodes what it is sent as a collector would (``POST /v1/traces``, an
``ExportTraceServiceRequest`` in protobuf, gzip or not) and answers 200 with
an empty ``ExportTraceServiceResponse``. The tests keep every span
(`OtlpSink.spans`: ids in hex, attributes as Python values); the bench only
counts (``keep=False``), so a long run holds no memory.

    python -m bench._otlp_sink     # prints "otlp sink listening on http://127.0.0.1:PORT"

Needs ``opentelemetry-proto`` (installed with ``stepd[otel]`` and ``stepd[test]``).
"""

from __future__ import annotations

import gzip
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

__all__ = ["OtlpSink", "ReceivedSpan", "otlp_sink"]


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return None if kind is None else getattr(v, kind)


@dataclass(frozen=True)
class ReceivedSpan:
    """One span as the collector received it (ids in lowercase hex)."""

    trace_id: str
    span_id: str
    parent_span_id: str | None
    name: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    status_code: int  # 0 unset, 1 ok, 2 error
    status_message: str
    events: list[tuple[str, int]]
    links: list[tuple[str, str]]
    resource: dict[str, Any]
    scope: str


@dataclass
class OtlpSink:
    """The receiver's findings: spans (when kept), counts, and the requests' headers."""

    keep: bool = True
    spans: list[ReceivedSpan] = field(default_factory=list)
    span_count: int = 0
    requests: int = 0
    headers: list[dict[str, str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    url: str = ""

    def take(self, body: bytes, headers: dict[str, str]) -> None:
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        found: list[ReceivedSpan] = []
        count = 0
        for rs in request.resource_spans:
            resource = {kv.key: _value(kv.value) for kv in rs.resource.attributes}
            for ss in rs.scope_spans:
                count += len(ss.spans)
                if not self.keep:
                    continue
                for s in ss.spans:
                    found.append(ReceivedSpan(
                        trace_id=s.trace_id.hex(), span_id=s.span_id.hex(),
                        parent_span_id=s.parent_span_id.hex() or None, name=s.name,
                        start_ns=s.start_time_unix_nano, end_ns=s.end_time_unix_nano,
                        attributes={kv.key: _value(kv.value) for kv in s.attributes},
                        status_code=s.status.code, status_message=s.status.message,
                        events=[(e.name, e.time_unix_nano) for e in s.events],
                        links=[(ln.trace_id.hex(), ln.span_id.hex()) for ln in s.links],
                        resource=resource, scope=ss.scope.name,
                    ))
        with self.lock:
            self.requests += 1
            self.span_count += count
            self.spans.extend(found)
            if self.keep:
                self.headers.append(headers)

    def snapshot(self) -> list[ReceivedSpan]:
        with self.lock:
            return list(self.spans)

    def by_id(self) -> dict[str, ReceivedSpan]:
        return {s.span_id: s for s in self.snapshot()}


def _handler(sink: OtlpSink) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:  # http.server calls it by this name
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length)
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            if self.path != "/v1/traces":
                self._answer(404, b"")
                return
            try:
                sink.take(body, {k.lower(): v for k, v in self.headers.items()})
            except Exception as exc:  # noqa: BLE001 - a bad request is the sender's bug: 400
                self._answer(400, repr(exc).encode())
                return
            self._answer(200, ExportTraceServiceResponse().SerializeToString())

        def _answer(self, status: int, payload: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return Handler


@contextmanager
def otlp_sink(*, keep: bool = True, port: int = 0) -> Iterator[OtlpSink]:
    """A receiver on 127.0.0.1 (``port`` 0: a free one) serving from a thread while inside."""
    sink = OtlpSink(keep=keep)
    server = ThreadingHTTPServer(("127.0.0.1", port), _handler(sink))
    server.daemon_threads = True
    sink.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                              name="otlp-sink", daemon=True)
    thread.start()
    try:
        yield sink
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def main() -> None:
    """Serve until SIGTERM or SIGINT; then print how many spans arrived."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    with otlp_sink(keep=False) as sink:
        print(f"otlp sink listening on {sink.url}", flush=True)
        stop.wait()
    print(f"otlp sink: {sink.span_count} spans in {sink.requests} requests", flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
