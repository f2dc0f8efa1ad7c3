"""The worker side of tracing: a step body runs inside the daemon's trace (docs/otel.md).

A lease carries its run's ``trace_id`` and its attempt's ``span_id``; the
daemon exports the attempt's span under those ids. When the application
uses OpenTelemetry (it has imported ``opentelemetry.trace``: it has a tracer
to make spans with), the worker makes that span the current OpenTelemetry
parent while the body runs, so the spans the application makes (its own
tracer, or an instrumented HTTP or database client) are children of the
step attempt, in the daemon's trace. Inside ``with ctx.span(...)`` the
current parent is that body span (the daemon exports it too), so a model
call's instrumentation nests under the body span that records its usage.

Nothing is imported here: an application without OpenTelemetry pays one
``sys.modules`` look-up per lease. The parent is a non-recording span (the
daemon, not this process, exports the attempt and body spans), marked
sampled and remote, so a ``ParentBased`` sampler (the default) records the
application's children.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["attach", "detach", "parent_for"]


def parent_for(trace_id: Any, span_id: Any) -> Any:
    """An OpenTelemetry context whose current span is (trace_id, span_id), or None.

    None when the application has not imported OpenTelemetry, or the ids are
    not the hex a lease carries.
    """
    trace = sys.modules.get("opentelemetry.trace")
    if trace is None or not isinstance(trace_id, str) or not isinstance(span_id, str):
        return None
    try:
        tid, sid = int(trace_id, 16), int(span_id, 16)
    except ValueError:
        return None
    if not tid or not sid:
        return None
    span_context = trace.SpanContext(tid, sid, is_remote=True,
                                     trace_flags=trace.TraceFlags(trace.TraceFlags.SAMPLED))
    return trace.set_span_in_context(trace.NonRecordingSpan(span_context))


def attach(context: Any) -> Any:
    """Make ``context`` current in this task or thread; returns the token for `detach`."""
    from opentelemetry import context as otel_context

    return otel_context.attach(context)


def detach(token: Any) -> None:
    from opentelemetry import context as otel_context

    otel_context.detach(token)
