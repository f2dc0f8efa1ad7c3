"""`StepContext`: what a step body sees of its lease, and what it reports through it.

A body is called ``body(ctx, input, steps)`` (or with fewer parameters; see
`stepd.Worker`). Through ``ctx`` it

* reads the lease: ``run_id``, ``step_id``, ``attempt``, ``idempotency_key``
  (stable across retries: give it to the APIs you call), ``state`` (read-only;
  shows the patches made so far), ``correlation``, ``trace_id``, ``span_id``,
  ``item_index`` (the item of a ``for_each``), ``lease_id``;
* patches the run's state: ``ctx.patch_state(summary=...)`` (merged, top-level
  keys replace; sent with ``complete``);
* records spans: ``with ctx.span("llm.call", model="m") as span:
  span.set_usage(model="m", input_tokens=10, output_tokens=5)``. Spans nest
  (the parent is the enclosing span, else the step's own span); each is sent
  with its *own* usage, and the daemon sums every span into the step's usage,
  so a body that records its model calls as spans never sums by hand
  (`stepd.sansio.pricing`). ``ctx.set_usage(...)`` overrides the sum;
* heartbeats: ``ctx.heartbeat(progress)`` (optional: the worker heartbeats on
  its own while the body runs; calls are coalesced, the last progress wins);
* learns it was cancelled (the lease was fenced, the run ended, the worker is
  stopping): ``ctx.cancelled``, ``ctx.check_cancelled()`` (raises
  `stepd.Cancelled`), ``ctx.cancel_event`` (a `threading.Event`, for sync bodies
  and threads), ``ctx.cancel_scope`` (`BodyScope`: the body's cancel scope,
  which the worker cancels: an async body is interrupted at its next
  ``await``).

`current_context()` returns the context of the body running in this task or
thread, for code deep in a call stack (a model client wrapper recording spans).
"""

from __future__ import annotations

import contextvars
import math
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from types import MappingProxyType
from typing import Any

from stepd import _otel_context
from stepd._errors import Cancelled

__all__ = ["BodyScope", "Span", "StepContext", "current_context"]

_current_ctx: contextvars.ContextVar[StepContext | None] = contextvars.ContextVar(
    "stepd_current_context", default=None)
_LOCK = threading.Lock()
"""Guards the few multi-step updates of any context (patches, spans, the cancel event):
they take microseconds, so one lock for all costs nothing per lease."""

_current_span: contextvars.ContextVar[Span | None] = contextvars.ContextVar(
    "stepd_current_span", default=None)


def current_context() -> StepContext:
    """The context of the step body running in this task (or thread).

    Raises:
        LookupError: not inside a step body.
    """
    ctx = _current_ctx.get()
    if ctx is None:
        raise LookupError("not inside a stepd step body")
    return ctx


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def _usage(model: str | None, input_tokens: int, output_tokens: int) -> dict[str, Any]:
    for name, value in (("input_tokens", input_tokens), ("output_tokens", output_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    if model is not None and (not isinstance(model, str) or not model):
        raise ValueError(f"model must be a non-empty string or None, got {model!r}")
    usage: dict[str, Any] = {"input_tokens": input_tokens, "output_tokens": output_tokens}
    if model is not None:
        usage["model"] = model
    return usage


class Span:
    """One span recorded by ``ctx.span(...)``.

    Attributes:
        span_id: 16 hex digits.
        parent_span_id: the enclosing span's id, or the step's (the lease's ``span_id``).
        name: what it measures (``llm.call``).
        attributes: free JSON attributes (set at creation or with `set_attribute`).
        start_ms, end_ms: wall-clock epoch milliseconds (end is None while open).
        usage: this span's *own* usage (exclusive of its children), or None.
    """

    __slots__ = ("attributes", "end_ms", "name", "parent_span_id", "span_id", "start_ms", "usage")

    def __init__(self, name: str, parent_span_id: str | None, attributes: dict[str, Any]) -> None:
        self.span_id = secrets.token_hex(8)
        self.parent_span_id = parent_span_id
        self.name = name
        self.attributes = attributes
        self.start_ms = _now_ms()
        self.end_ms: int | None = None
        self.usage: dict[str, Any] | None = None

    def __repr__(self) -> str:
        return f"<Span {self.name!r} {self.span_id} parent={self.parent_span_id}>"

    def set_usage(self, *, model: str | None = None, input_tokens: int = 0,
                  output_tokens: int = 0) -> None:
        """Set this span's own usage (children report theirs; the daemon sums all).

        Raises:
            ValueError: a negative or non-integer token count, or an empty model name.
        """
        self.usage = _usage(model, input_tokens, output_tokens)

    def add_usage(self, *, model: str | None = None, input_tokens: int = 0,
                  output_tokens: int = 0) -> None:
        """Add to this span's own usage (several calls inside one span).

        A span has one model: ``model`` replaces the one set before, if given.

        Raises:
            ValueError: as `set_usage`.
        """
        add = _usage(model, input_tokens, output_tokens)
        if self.usage is None:
            self.usage = add
            return
        self.usage["input_tokens"] += add["input_tokens"]
        self.usage["output_tokens"] += add["output_tokens"]
        if model is not None:
            self.usage["model"] = model

    def set_attribute(self, key: str, value: Any) -> None:
        """Set one attribute (a JSON value)."""
        self.attributes[key] = value

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "span_id": self.span_id, "parent_span_id": self.parent_span_id, "name": self.name,
            "start_ms": self.start_ms,
            "end_ms": self.end_ms if self.end_ms is not None else _now_ms(),
            "attributes": self.attributes,
        }
        if self.usage is not None:
            out["usage"] = dict(self.usage)
        return out


class BodyScope:
    """``ctx.cancel_scope``: cancels the body it belongs to, as an anyio `CancelScope` around
    it would (the worker runs bodies inside a scope of its own, shared by the leases its
    task runs one after another, so no scope is made per lease).

    ``cancel()`` interrupts an async body at its next ``await`` (a no-op once the body is
    over); ``cancel_called`` is True once the body was cancelled, by the worker (see
    `StepContext.cancel_reason`) or by ``cancel()``.
    """

    __slots__ = ("_ctx",)

    def __init__(self, ctx: StepContext) -> None:
        self._ctx = ctx

    def __repr__(self) -> str:
        return f"<BodyScope of {self._ctx!r} cancel_called={self.cancel_called}>"

    def cancel(self) -> None:
        ctx = self._ctx
        if ctx._self_cancelled:
            return
        ctx._self_cancelled = True
        host = ctx._host
        if host is not None:
            host._cancel_body(ctx)

    @property
    def cancel_called(self) -> bool:
        ctx = self._ctx
        return ctx._cancel_reason is not None or ctx._self_cancelled

    @property
    def cancelled_caught(self) -> bool:
        return self.cancel_called

    @property
    def shield(self) -> bool:
        return False

    @property
    def deadline(self) -> float:
        return math.inf


class StepContext:
    """The context a step body receives as its first argument. Built by the worker.

    Attributes:
        run_id, step_id, lease_id: which attempt this is.
        attempt: 1 for the first attempt, then 2, 3...
        item_index: the item's index in a ``for_each`` step, else None.
        idempotency_key: stable across retries of this step (and item).
        correlation: the run's correlation value.
        trace_id, span_id: the step's trace (32 hex) and span (16 hex).
        workflow, version, definition_hash, body: what the lease runs.
        delivery: ``at_least_once`` or ``at_most_once``.
        timeout_ms: the step's timeout, or None.
        lease: the lease as the daemon sent it (a read-only mapping).

    Built once per lease, so it makes nothing until asked: the lease's fields are
    read from the lease when read, the state is copied at the first read or
    patch, the cancel event and scope are made at the first use.
    """

    __slots__ = (
        "__dict__",
        "_cancel_event",
        "_cancel_reason",
        "_cancel_scope",
        "_host",
        "_lease",
        "_notify",
        "_otel",
        "_patch",
        "_progress",
        "_progress_set",
        "_self_cancelled",
        "_spans",
        "_state",
        "_state_view",
        "_usage",
        "lease_id",
        "run_id",
        "step_id",
    )

    def __init__(self, lease: dict[str, Any], *, notify_heartbeat: Callable[[], None] | None = None
                 ) -> None:
        self._lease = lease
        self.lease_id: str = lease["lease_id"]
        self.run_id: str = lease["run_id"]
        self.step_id: str = lease["step_id"]
        self._state: dict[str, Any] | None = None
        self._state_view: Mapping[str, Any] | None = None
        self._patch: dict[str, Any] | None = None
        self._spans: list[Span] | None = None
        self._usage: dict[str, Any] | None = None
        self._progress: Any = None
        self._progress_set = False
        self._notify = notify_heartbeat
        self._host: Any = None  # the worker (set by it): heartbeats, BodyScope.cancel()
        self._cancel_event: threading.Event | None = None
        self._cancel_scope: BodyScope | None = None
        self._cancel_reason: str | None = None
        self._self_cancelled = False
        # The OpenTelemetry parent of the body (`stepd._otel_context`), or None.
        self._otel: Any = None

    def __repr__(self) -> str:
        item = "" if self.item_index is None else f"[{self.item_index}]"
        return (f"<StepContext {self.run_id}/{self.step_id}{item} attempt={self.attempt} "
                f"lease={self.lease_id}>")

    # -- the lease -----------------------------------------------------------------------

    @property
    def lease(self) -> Mapping[str, Any]:
        return MappingProxyType(self._lease)

    @property
    def attempt(self) -> int:
        return self._lease.get("attempt", 1)  # type: ignore[no-any-return]

    @property
    def item_index(self) -> int | None:
        return self._lease.get("item_index")

    @property
    def idempotency_key(self) -> str | None:
        return self._lease.get("idempotency_key")

    @property
    def correlation(self) -> Any:
        return self._lease.get("correlation")

    @property
    def trace_id(self) -> str | None:
        return self._lease.get("trace_id")

    @property
    def span_id(self) -> str | None:
        return self._lease.get("span_id")

    @property
    def workflow(self) -> str:
        return self._lease.get("workflow", "")  # type: ignore[no-any-return]

    @property
    def version(self) -> str | None:
        return self._lease.get("version")

    @property
    def definition_hash(self) -> str:
        return self._lease.get("definition_hash", "")  # type: ignore[no-any-return]

    @property
    def body(self) -> str:
        return self._lease.get("body", "")  # type: ignore[no-any-return]

    @property
    def delivery(self) -> str:
        return self._lease.get("delivery", "at_least_once")  # type: ignore[no-any-return]

    @property
    def timeout_ms(self) -> int | None:
        return self._lease.get("timeout_ms")

    # -- state ---------------------------------------------------------------------

    @property
    def state(self) -> Mapping[str, Any]:
        """The run's public state as the lease carried it, with this body's patches applied.

        Read-only: change it with `patch_state`.
        """
        view = self._state_view
        if view is None:
            with _LOCK:
                self._own_state()
                view = self._state_view
        return view  # type: ignore[return-value]

    def _own_state(self) -> dict[str, Any]:
        """The state this context shows (copied from the lease once; under `_LOCK`)."""
        state = self._state
        if state is None:
            raw = self._lease.get("state")
            state = self._state = dict(raw) if isinstance(raw, dict) else {}
            self._state_view = MappingProxyType(state)
        return state

    def patch_state(self, patch: Mapping[str, Any] | None = None, /, **values: Any) -> None:
        """Merge into the run's state when the step completes (top-level keys replace).

        ``ctx.patch_state(summary="...")`` or ``ctx.patch_state({"a b": 1})``.
        Later patches replace earlier ones key by key; `state` shows the result
        at once. Nothing is sent if the body fails.
        """
        merged: dict[str, Any] = dict(patch) if patch is not None else {}
        merged.update(values)
        with _LOCK:
            if self._patch is None:
                self._patch = {}
            self._patch.update(merged)
            self._own_state().update(merged)

    # -- usage and spans -----------------------------------------------------------------

    @contextmanager
    def span(self, name: str, **attributes: Any) -> Iterator[Span]:
        """Record a span around a block: ``with ctx.span("llm.call", model="m") as span:``.

        The parent is the span enclosing this one in the same task (or thread),
        else the step's span. The span is sent with ``complete``; an exception
        leaving the block is recorded as the ``error`` attribute (its type name)
        and re-raised.
        """
        parent = _current_span.get()
        spans = self._spans
        mine = spans is not None and parent is not None and parent in spans
        parent_id = parent.span_id if mine else self.span_id  # type: ignore[union-attr]
        span = Span(name, parent_id, dict(attributes))
        with _LOCK:
            if self._spans is None:
                self._spans = []
            self._spans.append(span)
        token = _current_span.set(span)
        # The application's OpenTelemetry spans inside this block nest under it.
        otel = (None if self._otel is None else
                _otel_context.attach(_otel_context.parent_for(self.trace_id, span.span_id)))
        try:
            yield span
        except BaseException as exc:
            span.attributes.setdefault("error", type(exc).__name__)
            raise
        finally:
            span.end_ms = _now_ms()
            if otel is not None:
                _otel_context.detach(otel)
            _current_span.reset(token)

    def set_usage(self, *, model: str | None = None, input_tokens: int = 0,
                  output_tokens: int = 0) -> None:
        """The step's usage, overriding the sum of its spans (for a body that records none).

        Raises:
            ValueError: a negative or non-integer token count, or an empty model name.
        """
        self._usage = _usage(model, input_tokens, output_tokens)

    @property
    def usage(self) -> dict[str, Any]:
        """The step's usage so far: the override if set, else the sum over spans."""
        if self._usage is not None:
            return dict(self._usage)
        total = {"input_tokens": 0, "output_tokens": 0}
        for span in list(self._spans or ()):
            if span.usage is not None:
                total["input_tokens"] += span.usage["input_tokens"]
                total["output_tokens"] += span.usage["output_tokens"]
        return total

    @property
    def spans(self) -> tuple[Span, ...]:
        """The spans recorded so far, in the order they opened."""
        return tuple(self._spans or ())

    # -- heartbeats ---------------------------------------------------------------------

    def heartbeat(self, progress: Any = None) -> None:
        """Ask for a heartbeat soon, carrying ``progress`` (any JSON) if given.

        Never blocks and never raises: calls are coalesced (at most one
        heartbeat per throttle interval, the last progress wins). Safe from any
        thread. The worker heartbeats every ``heartbeat_ms`` anyway.

        In a local step (``.then(body, local=True)``, docs/affinity.md) it sends
        nothing (the parent lease is renewed on its own): it keeps the progress
        for the step's record and raises `stepd.Cancelled` once the step must
        stop (its timeout, the parent lease lost, shutdown).
        """
        if progress is not None:
            self._progress = progress
            self._progress_set = True
        notify = self._notify
        if notify is not None:
            notify()
        host = self._host
        if host is not None:
            host._poke(self)

    def _take_progress(self) -> tuple[bool, Any]:
        if not self._progress_set:
            return False, None
        self._progress_set = False
        return True, self._progress

    # -- cancellation --------------------------------------------------------------------

    @property
    def cancelled(self) -> bool:
        """True once the worker cancelled this body (see `cancel_reason`)."""
        return self._cancel_reason is not None

    @property
    def cancel_reason(self) -> str | None:
        """``fenced``, ``run_terminal``, ``lost``, ``shutdown``, or None."""
        return self._cancel_reason

    @property
    def cancel_event(self) -> threading.Event:
        """A `threading.Event` set when the body is cancelled (for sync bodies and threads)."""
        event = self._cancel_event
        if event is None:
            with _LOCK:
                event = self._cancel_event
                if event is None:
                    event = self._cancel_event = threading.Event()
                    if self._cancel_reason is not None:
                        event.set()
        return event

    @property
    def cancel_scope(self) -> BodyScope:
        """The body's cancel scope: ``cancel()`` interrupts an async body at its next
        ``await``; ``cancel_called`` (see `BodyScope`)."""
        scope = self._cancel_scope
        if scope is None:
            scope = self._cancel_scope = BodyScope(self)
        return scope

    def check_cancelled(self) -> None:
        """Raise `stepd.Cancelled` if the body was cancelled (for loops in sync bodies).

        Raises:
            Cancelled: with the reason.
        """
        reason = self._cancel_reason
        if reason is not None:
            raise Cancelled(reason)

    def _cancel(self, reason: str) -> bool:
        """Cancel the body (called on the worker's loop). Returns False if it already was."""
        if self._cancel_reason is not None:
            return False
        with _LOCK:
            self._cancel_reason = reason
            event = self._cancel_event
        if event is not None:
            event.set()
        return True

    # -- what complete sends ---------------------------------------------------------------

    def _completion(self, output: Any) -> dict[str, Any]:
        body: dict[str, Any] = {"output": output}
        if self._patch:
            body["state_patch"] = dict(self._patch)
        if self._usage is not None:
            body["usage"] = dict(self._usage)
        if self._spans:
            body["spans"] = [s.to_json() for s in self._spans]
        return body
