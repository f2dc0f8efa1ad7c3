"""`SpanData` to OpenTelemetry SDK spans: imported only by an open export (`stepd.otel`).

The spans are finished facts read off the journal, not spans a tracer
times: so they are made as ``ReadableSpan`` objects directly, with the ids
the leases already carry (a tracer would draw ids of its own), and handed
to the exporter as they are.
"""

from __future__ import annotations

from collections.abc import Sequence

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags

from stepd.sansio.trace import SpanData

__all__ = ["Converter", "resource"]

_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_MS = 1_000_000  # nanoseconds per millisecond


def resource() -> Resource:
    """The process's resource: ``OTEL_RESOURCE_ATTRIBUTES`` and ``OTEL_SERVICE_NAME`` win;
    without a service name of their own, the service is ``stepd``."""
    found = Resource.create()
    name = found.attributes.get("service.name")
    if not isinstance(name, str) or name.startswith("unknown_service"):
        found = found.merge(Resource({"service.name": "stepd"}))
    return found


def _context(trace_id: str, span_id: str) -> SpanContext:
    return SpanContext(int(trace_id, 16), int(span_id, 16), is_remote=False,
                       trace_flags=_SAMPLED)


class Converter:
    """Makes SDK spans of one resource and instrumentation scope (``stepd``)."""

    def __init__(self) -> None:
        from stepd import __version__

        self.resource = resource()
        self.scope = InstrumentationScope("stepd", __version__)
        self._ok = Status(StatusCode.UNSET)

    def spans(self, spans: Sequence[SpanData]) -> list[ReadableSpan]:
        return [self.span(s) for s in spans]

    def span(self, s: SpanData) -> ReadableSpan:
        status = self._ok if s.error is None else Status(StatusCode.ERROR, s.error)
        return ReadableSpan(
            name=s.name,
            context=_context(s.trace_id, s.span_id),
            parent=None if s.parent_span_id is None else _context(s.trace_id, s.parent_span_id),
            resource=self.resource,
            attributes=s.attributes,
            events=[Event(name, attrs, timestamp=at * _MS) for name, at, attrs in s.events],
            links=[Link(_context(t, i)) for t, i in s.links],
            kind=SpanKind.INTERNAL,
            status=status,
            start_time=s.start_ms * _MS,
            end_time=s.end_ms * _MS,
            instrumentation_scope=self.scope,
        )
