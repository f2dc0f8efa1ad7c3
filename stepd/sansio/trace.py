"""The spans of a run, read off its committed journal: pure, no OpenTelemetry import.

Export (docs/otel.md) describes only what is on record: the daemon hands the
exporter each run write (`actors/daemon/store.RunWrite`: the run's record,
the transition's journal entries, the lease records and lease endings it
writes), and `TraceBuilder.feed` turns them into finished `SpanData`:

* one span per run, the trace's root: trace id `trace_id_for(run_id)` (what
  every lease already carries), span id `run_span_id(run_id)`; from the run's
  creation to the journal entry that ended it; a child run links to its
  parent run's span (its own trace: trace ids are per run);
* one span per step attempt, child of the run span, under the lease's own
  span id (`span_id_for(lease_id)`, the ``span_id`` the worker got): from the
  offer to the entry that ended the attempt (completed, failed, lost,
  released, unservable, or the lease fenced or ended with the run), with the
  worker, attempt, fence, delivery and outcome as attributes;
* the body spans the worker reported with ``complete``, under their own ids
  and parents (the attempt's span or an enclosing body span), with their
  token usage and price;
* one span per local step (docs/affinity.md "Local steps"), child of the
  parent lease's span it ran under, id `local_span_id(lease, step)` (what the
  lease's plan handed the worker), with its attempts as events, and under it
  the local body's own spans. The daemon has only the worker's times relative
  to the step's first attempt, so the span ends at the commit that journaled
  it and starts its measured duration earlier.

The builder remembers the attempts it saw offered (start time, delivery,
worker) until they end: bounded by `max_open` (the oldest is forgotten and
counted). An attempt offered before a daemon restart is still exported when
it ends by a journaled outcome: its start comes from the lease record when
the write carries one, else it is the end (the builder says so in
``stepd.start_unknown``). One ended by a fence or by its run's end only (no
journal entry of its own) is exported only when the builder saw its offer.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ._run_base import span_id_for, trace_id_for
from .local_steps import local_span_id

__all__ = ["RUN_ENDS", "SpanData", "TraceBuilder", "run_span_id", "span_attributes"]

#: Journal entry types that end a run, and the status each one means.
RUN_ENDS = {
    "run_completed": "completed",
    "run_failed": "failed",
    "run_cancelled": "cancelled",
    "run_timed_out": "timed_out",
}

#: Journal entry types that end a step attempt (its lease), and the outcome each one means.
_ATTEMPT_ENDS = {
    "step_completed": "completed",
    "step_failed": "failed",
    "step_unservable": "unservable",
    "step_recovered": "lost",
}

#: Attribute values OpenTelemetry takes as they are; others are sent as JSON text.
_PLAIN = (str, bool, int, float)


def run_span_id(run_id: str) -> str:
    """The run's own span id (16 hex digits): stable, so a restart exports the same id."""
    return hashlib.sha256(b"run\x00" + run_id.encode()).hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class SpanData:
    """A finished span, in stepd's terms (hex ids, epoch milliseconds).

    Attributes:
        error: None for a span that went well, else the status description.
        links: (trace id, span id) pairs: a child run's span links to its parent run's.
        events: (name, epoch ms, attributes) triples, such as the attempt's ``started``.
    """

    trace_id: str
    span_id: str
    parent_span_id: str | None
    name: str
    start_ms: int
    end_ms: int
    attributes: dict[str, Any]
    error: str | None = None
    links: tuple[tuple[str, str], ...] = ()
    events: tuple[tuple[str, int, dict[str, Any]], ...] = ()


@dataclass(slots=True)
class _Attempt:
    start_ms: int
    step_id: str
    item_index: int | None
    attempt: int | None
    fence: int | None
    worker_id: str | None
    worker_name: str | None
    delivery: str | None = None
    started_ms: int | None = None


def span_attributes(attributes: Mapping[str, Any]) -> dict[str, Any]:
    """Attributes as OpenTelemetry takes them: plain values kept, None dropped, others as JSON.

    A list of one plain type is kept as a list (OTLP's array value); anything
    else (objects, mixed lists) becomes its JSON text, so nothing a body wrote
    is lost or rejected.
    """
    out: dict[str, Any] = {}
    for key, value in attributes.items():
        if value is None:
            continue
        if isinstance(value, _PLAIN):
            out[str(key)] = value
        elif (isinstance(value, (list, tuple)) and value
              and len({type(v) for v in value}) == 1 and isinstance(value[0], _PLAIN)):
            out[str(key)] = list(value)
        else:
            out[str(key)] = json.dumps(value, sort_keys=True, default=str)
    return out


def _usage_attributes(usage: Any) -> dict[str, Any]:
    """Token usage and price, as GenAI semantic conventions name them (and stepd's cost)."""
    if not isinstance(usage, Mapping):
        return {}
    out: dict[str, Any] = {}
    for key in ("input_tokens", "output_tokens"):
        value = usage.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            out[f"gen_ai.usage.{key}"] = value
    model = usage.get("model")
    if isinstance(model, str):
        out["gen_ai.request.model"] = model
    cost = usage.get("cost_usd")
    if isinstance(cost, (int, float)) and not isinstance(cost, bool):
        out["stepd.cost_usd"] = float(cost)
    return out


@dataclass(slots=True)
class TraceBuilder:
    """Turns committed run writes into finished spans (see the module docstring).

    Attributes:
        max_open: how many attempts seen offered and not yet ended it remembers.
        forgotten: attempts forgotten past `max_open` (their span, if they end,
            starts at its end).
    """

    max_open: int = 100_000
    forgotten: int = 0
    _open: dict[str, _Attempt] = field(default_factory=dict)

    def open_attempts(self) -> int:
        return len(self._open)

    def feed(self, run_id: str, record: Mapping[str, Any], journal: Iterable[Mapping[str, Any]],
             leases: Iterable[Mapping[str, Any]] = (),
             lease_status: Iterable[tuple[str, str, int]] = ()) -> list[SpanData]:
        """The spans that a committed write of run `run_id` finished.

        Args:
            record: the run's record as written (`RunRecord.to_dict()`).
            journal: the entries the write journals, in order.
            leases: the lease records it writes (`LeaseRecord.to_dict()`).
            lease_status: the leases it ends without a journal entry of their
                own: (lease id, ``fenced`` or ``run_terminal``, epoch ms).
        """
        out: list[SpanData] = []
        trace_id = trace_id_for(run_id)
        by_lease = {lease.get("lease_id"): lease for lease in leases}
        ended: set[str] = set()
        local: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
        for entry in journal:
            kind = entry.get("type")
            lease_id = entry.get("lease_id")
            if entry.get("execution_mode") == "local":
                # Under the parent's lease id, but a step of its own: never the
                # parent attempt's start or end.
                if isinstance(lease_id, str) and kind != "step_scheduled":
                    local.setdefault((lease_id, str(entry.get("step_id"))), []).append(entry)
                continue
            if kind == "step_offered" and isinstance(lease_id, str):
                self._offered(entry, lease_id, by_lease.get(lease_id))
            elif kind == "step_started" and isinstance(lease_id, str):
                a = self._open.get(lease_id)
                if a is not None:
                    a.started_ms = int(entry.get("at") or 0)
            elif kind in _ATTEMPT_ENDS and isinstance(lease_id, str) and lease_id not in ended:
                ended.add(lease_id)
                out.extend(self._attempt_end(trace_id, run_id, entry, lease_id,
                                             by_lease.get(lease_id)))
            elif kind in RUN_ENDS:
                out.append(self._run_span(trace_id, run_id, record, entry))
        for (lease_id, step_id), entries in local.items():
            out.extend(self._local_spans(trace_id, run_id, lease_id, step_id, entries))
        for lease_id, status, at in lease_status:
            if lease_id in ended:
                continue
            a = self._open.pop(lease_id, None)
            if a is not None:
                ended.add(lease_id)
                out.append(self._attempt_span(trace_id, run_id, lease_id, a, int(at), status,
                                              {}, None))
        return out

    # -- attempts -------------------------------------------------------------------------

    def _offered(self, entry: Mapping[str, Any], lease_id: str,
                 lease: Mapping[str, Any] | None) -> None:
        if len(self._open) >= self.max_open:
            del self._open[next(iter(self._open))]
            self.forgotten += 1
        self._open[lease_id] = _Attempt(
            start_ms=int(entry.get("at") or 0), step_id=str(entry.get("step_id")),
            item_index=entry.get("item_index"), attempt=entry.get("attempt"),
            fence=entry.get("fence"), worker_id=entry.get("worker_id"),
            worker_name=entry.get("worker_name"),
            delivery=None if lease is None else lease.get("delivery"),
        )

    def _attempt_end(self, trace_id: str, run_id: str, entry: Mapping[str, Any], lease_id: str,
                     lease: Mapping[str, Any] | None) -> list[SpanData]:
        end_ms = int(entry.get("at") or 0)
        a = self._open.pop(lease_id, None)
        extra: dict[str, Any] = {}
        if a is None:  # offered before this builder existed (a daemon restart)
            start = lease.get("offered_at") if lease is not None else None
            if not isinstance(start, int) or start <= 0:
                start, extra["stepd.start_unknown"] = end_ms, True
            a = _Attempt(
                start_ms=start, step_id=str(entry.get("step_id")),
                item_index=entry.get("item_index"), attempt=entry.get("attempt"),
                fence=entry.get("fence"),
                worker_id=entry.get("worker_id") or (lease or {}).get("worker_id"),
                worker_name=(lease or {}).get("worker_name"),
            )
        if a.delivery is None and lease is not None:
            a.delivery = lease.get("delivery")
        kind = str(entry.get("type"))
        outcome = _ATTEMPT_ENDS[kind]
        error = None
        if kind == "step_recovered" and entry.get("released"):
            outcome = "released"
        if kind == "step_failed":
            extra["stepd.error_class"] = entry.get("error_class")
            error = f"{entry.get('error_class')}: {entry.get('message') or ''}".rstrip(": ")
        if kind == "step_recovered":
            extra["stepd.started"] = bool(entry.get("started"))
        if kind == "step_completed":
            extra.update(_usage_attributes(entry.get("usage")))
        span = self._attempt_span(trace_id, run_id, lease_id, a, end_ms, outcome, extra, error)
        out = [span]
        if kind == "step_completed":
            out.extend(self._body_spans(trace_id, span.span_id, entry.get("spans")))
        return out

    def _attempt_span(self, trace_id: str, run_id: str, lease_id: str, a: _Attempt,
                      end_ms: int, outcome: str, extra: dict[str, Any],
                      error: str | None) -> SpanData:
        name = f"step {a.step_id}" if a.item_index is None else f"step {a.step_id}[{a.item_index}]"
        attributes = span_attributes({
            "stepd.run_id": run_id, "stepd.step_id": a.step_id, "stepd.item_index": a.item_index,
            "stepd.lease_id": lease_id, "stepd.worker_id": a.worker_id,
            "stepd.worker_name": a.worker_name, "stepd.attempt": a.attempt,
            "stepd.fence": a.fence, "stepd.delivery": a.delivery, "stepd.outcome": outcome,
            **extra,
        })
        events: tuple[tuple[str, int, dict[str, Any]], ...] = (
            () if a.started_ms is None else (("started", a.started_ms, {}),))
        return SpanData(trace_id, span_id_for(lease_id), run_span_id(run_id), name,
                        a.start_ms, max(end_ms, a.start_ms), attributes, error, (), events)

    def _body_spans(self, trace_id: str, attempt_span: str, spans: Any) -> list[SpanData]:
        """The body's own spans (validated by the transport: ids, names, times, usage)."""
        out: list[SpanData] = []
        for s in spans or ():
            if not isinstance(s, Mapping):
                continue
            start = int(s.get("start_ms") or 0)
            attributes = span_attributes(s.get("attributes") or {})
            attributes.update(_usage_attributes(s.get("usage")))
            error = attributes.get("error")
            out.append(SpanData(
                trace_id, str(s.get("span_id")), s.get("parent_span_id") or attempt_span,
                str(s.get("name")), start, max(int(s.get("end_ms") or start), start), attributes,
                None if error is None else str(error),
            ))
        return out

    # -- local steps ----------------------------------------------------------------------

    def _local_spans(self, trace_id: str, run_id: str, lease_id: str, step_id: str,
                     entries: list[Mapping[str, Any]]) -> list[SpanData]:
        """A local step's span (its attempts as events) and its body's spans beneath."""
        done = next((e for e in entries if e.get("type") == "step_completed"), None)
        failed = [e for e in entries if e.get("type") == "step_failed"]
        last = done if done is not None else (failed[-1] if failed else entries[-1])
        end_ms = int(last.get("at") or 0)
        duration = last.get("ended_ms")
        start_ms = end_ms - duration if isinstance(duration, int) and duration >= 0 else end_ms
        events: list[tuple[str, int, dict[str, Any]]] = []
        for e in entries:
            offset = e.get("started_ms") if e.get("type") == "step_started" else e.get("ended_ms")
            at = start_ms + offset if isinstance(offset, int) else end_ms
            if e.get("type") == "step_started":
                events.append(("started", min(at, end_ms), {"stepd.attempt": e.get("attempt")}))
            elif e.get("type") == "step_failed":
                events.append(("attempt_failed", min(at, end_ms), span_attributes({
                    "stepd.attempt": e.get("attempt"), "stepd.error_class": e.get("error_class"),
                    "stepd.error_message": e.get("message")})))
        error = None
        extra: dict[str, Any] = _usage_attributes(last.get("usage"))
        if done is None:
            extra["stepd.error_class"] = last.get("error_class")
            error = f"{last.get('error_class')}: {last.get('message') or ''}".rstrip(": ")
        attributes = span_attributes({
            "stepd.run_id": run_id, "stepd.step_id": step_id, "stepd.lease_id": lease_id,
            "stepd.execution_mode": "local", "stepd.parent_step_id": last.get("parent_step_id"),
            "stepd.worker_id": last.get("worker_id"), "stepd.attempt": last.get("attempt"),
            "stepd.outcome": "completed" if done is not None else "failed", **extra,
        })
        span = SpanData(trace_id, local_span_id(lease_id, step_id), span_id_for(lease_id),
                        f"step {step_id}", start_ms, end_ms, attributes, error, (),
                        tuple(events))
        return [span, *self._body_spans(trace_id, span.span_id, last.get("spans"))]

    # -- runs -----------------------------------------------------------------------------

    def _run_span(self, trace_id: str, run_id: str, record: Mapping[str, Any],
                  entry: Mapping[str, Any]) -> SpanData:
        status = RUN_ENDS[str(entry.get("type"))]
        end_ms = int(entry.get("at") or 0)
        start_ms = record.get("created_at")
        if not isinstance(start_ms, int) or start_ms <= 0:
            start_ms = end_ms
        parent = record.get("parent")
        parent_run = parent.get("run_id") if isinstance(parent, Mapping) else None
        attributes = span_attributes({
            "stepd.run_id": run_id, "stepd.workflow": record.get("workflow"),
            "stepd.version": record.get("version"),
            "stepd.definition_hash": record.get("hash"), "stepd.status": status,
            "stepd.correlation": record.get("correlation"),
            "stepd.idempotency_key": record.get("idempotency_key"),
            "stepd.parent_run_id": parent_run,
            "gen_ai.usage.input_tokens": record.get("input_tokens"),
            "gen_ai.usage.output_tokens": record.get("output_tokens"),
            "stepd.cost_usd": record.get("cost_usd"),
        })
        error = None
        err = entry.get("error")
        if status != "completed":
            reason = err.get("reason") if isinstance(err, Mapping) else None
            message = err.get("message") if isinstance(err, Mapping) else None
            error = f"{reason or status}: {message or ''}".rstrip(": ")
            if reason is not None:
                attributes["stepd.error_reason"] = str(reason)
        links = (() if not isinstance(parent_run, str)
                 else ((trace_id_for(parent_run), run_span_id(parent_run)),))
        return SpanData(trace_id, run_span_id(run_id), None, f"run {record.get('workflow')}",
                        start_ms, max(end_ms, start_ms), attributes, error, links)
