"""Local steps in the worker (mixed into `stepd.Worker`): AFFINITY.md "Local steps".

A lease whose ``local_steps`` plan is not empty (the daemon sends one only to
a worker that declared the ``local_steps`` capability) names the local steps
that follow its step. Right after the parent body returns an output, and
while the parent lease is still held, `_run_local` runs them in order in
this worker, with no round trip: it renders each one's input from the run's
input, the outputs so far (the parent's included) and the state as patched,
calls its body, applies its retry policy, and records every attempt. The
records ride the parent's ``complete`` (`stepd._calls`), and the daemon
journals them in the same transaction as the parent's completion.

Why it is built this way:

* The parent lease keeps heartbeating on its own (`stepd._heartbeats`): the
  local bodies run while the parent is still "in body". A local body's
  ``ctx.heartbeat()`` renews nothing; it records progress and is where
  cancellation and timeouts are observed.
* A local body stops on its per-attempt timeout (``timeout_ms``), the step's
  total timeout (``total_timeout_ms``, error class ``total_timeout``), loss
  of the parent lease (fenced, run over, unknown) and worker shutdown. They are
  observed before each attempt, at ``ctx.heartbeat()`` (which raises
  `stepd.Cancelled` then) and after the body returns; an async body is also
  interrupted at its deadline.
* Only finished local steps are reported. Loss of the lease reports nothing
  (the parent runs again elsewhere, and so may its local bodies: their
  idempotency key is stable); shutdown, a body this worker lacks, a template
  that does not render or an output that jumps ends the chain, and the rest run
  as ordinary leases.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Final

import anyio

from stepd._bodies import Active, Body, Definition
from stepd._errors import Cancelled
from stepd.context import StepContext
from stepd.sansio.definition import parse_retry
from stepd.sansio.errors import Invalid as EngineInvalid
from stepd.sansio.errors import TemplateError
from stepd.sansio.local_steps import local_span_id
from stepd.sansio.run import ALWAYS_RETRIED
from stepd.sansio.templates import TemplateContext, render

log = logging.getLogger("stepd.worker")

#: Error class of a local step whose attempts together passed ``total_timeout_ms``.
TOTAL_TIMEOUT: Final = "total_timeout"


def _ms() -> int:
    return int(time.monotonic() * 1000)


class LocalHost:
    """A local body's context host: its ``ctx.heartbeat()`` checks, renews nothing."""

    __slots__ = ("deadline", "parent", "timeout_reason")

    def __init__(self, parent: StepContext, deadline: int | None, timeout_reason: str) -> None:
        self.parent = parent
        self.deadline = deadline  # monotonic ms: this attempt's (or the total) limit
        self.timeout_reason = timeout_reason

    def reason(self) -> str | None:
        """Why the body must stop now, or None."""
        if self.parent._cancel_reason is not None:
            return self.parent._cancel_reason
        if self.deadline is not None and _ms() >= self.deadline:
            return self.timeout_reason
        return None

    def _poke(self, ctx: StepContext) -> None:
        reason = self.reason()
        if reason is not None:
            ctx._cancel(reason)
            raise Cancelled(reason)

    def _cancel_body(self, ctx: StepContext) -> None:
        """``ctx.cancel_scope.cancel()`` in a local body: observed at its next heartbeat."""
        ctx._cancel("cancelled")


class LocalSteps:
    """The local-step half of `stepd.Worker`."""

    name: str
    stopping: bool
    local_steps: bool
    _defs: dict[tuple[str, str | None], Definition]

    if TYPE_CHECKING:
        async def _invoke(self, active: Active, body: Body) -> tuple[Any, ...]: ...

    async def _run_local(self, active: Active, parent_output: Any) -> None:
        """Run the lease's local steps after its body returned `parent_output`."""
        lease = active.lease
        plan = lease.get("local_steps")
        if not plan or not self.local_steps:
            return
        if isinstance(parent_output, dict) and "_next_step" in parent_output:
            return  # the run jumps elsewhere: the plan does not apply
        held = self._defs.get((lease.get("workflow"), lease.get("version")))  # type: ignore[arg-type]
        if held is None:
            return
        parent = active.ctx
        state = dict(lease.get("state") or {})
        state.update(parent._patch or {})
        steps = dict(lease.get("steps") or {})
        steps[lease["step_id"]] = parent_output
        records = active.local_records = []
        for entry in plan:
            body = held.bodies.get(entry.get("body"))
            if body is None or self.stopping or parent._cancel_reason is not None:
                return
            try:
                rendered = render(entry.get("input"), TemplateContext(
                    input=lease.get("run_input"), state=state, steps=steps,
                    run_id=lease["run_id"], correlation=lease.get("correlation")))
            except TemplateError:
                return  # the daemon schedules it and fails the run as it would
            record = await self._local_step(active, entry, body, rendered, steps, state)
            if record is None:
                return
            records.append(record)
            if record.get("error") is not None:
                return
            output = record["output"]
            steps[entry["step_id"]] = output
            state.update(record.get("state_patch") or {})
            if isinstance(output, dict) and "_next_step" in output:
                return

    async def _local_step(self, active: Active, entry: dict[str, Any], body: Body,
                          rendered: Any, steps: dict[str, Any], state: dict[str, Any]
                          ) -> dict[str, Any] | None:
        """All attempts of one local step; its record (with what its body spent), or None
        when it was stopped."""
        spent: list[StepContext] = []
        record = await self._local_attempts(active, entry, body, rendered, steps, state, spent)
        if record is not None:
            record.update(_spent(spent))
        return record

    async def _local_attempts(self, active: Active, entry: dict[str, Any], body: Body,
                              rendered: Any, steps: dict[str, Any], state: dict[str, Any],
                              spent: list[StepContext]) -> dict[str, Any] | None:
        """All attempts of one local step; its record, or None when it was stopped. Each
        attempt's context goes to `spent` (its usage and spans)."""
        try:
            retry = parse_retry(entry.get("retry") or {})
        except EngineInvalid:
            return None
        timeout_ms = entry.get("timeout_ms")
        total_ms = entry.get("total_timeout_ms")
        first = _ms()
        total_at = None if total_ms is None else first + int(total_ms)
        attempts: list[dict[str, Any]] = []
        record: dict[str, Any] = {
            "step_id": entry["step_id"], "input": rendered, "retry": entry.get("retry"),
            "timeout_ms": timeout_ms, "total_timeout_ms": total_ms, "attempts": attempts,
            "progress": None, "output": None, "error": None,
        }
        parent = active.ctx
        for number in range(1, retry.max_attempts + 1):
            # Observed before the attempt: the parent lease, shutdown, the total timeout.
            if parent._cancel_reason is not None or self.stopping:
                return None
            started = _ms()
            if total_at is not None and started >= total_at:
                return _fail(record, TOTAL_TIMEOUT, f"no result within total_timeout_ms={total_ms}")
            deadline, why = total_at, TOTAL_TIMEOUT
            if timeout_ms is not None and (deadline is None or started + timeout_ms < deadline):
                deadline, why = started + int(timeout_ms), "timeout"
            outcome, progress = await self._local_attempt(active, entry, body, rendered, steps,
                                                         state, number, deadline, why, spent)
            ended = _ms()
            if progress is not None:
                record["progress"] = progress
            if outcome[0] == "stopped":
                return None
            attempt: dict[str, Any] = {"attempt": number, "started_ms": started - first,
                                       "ended_ms": ended - first}
            attempts.append(attempt)
            if outcome[0] == "ok":
                attempt["output"] = outcome[1]
                record["output"] = outcome[1]
                if outcome[2]:
                    record["state_patch"] = outcome[2]
                return record
            error = {"class": outcome[1], "message": outcome[2]}
            attempt["error"] = error
            if outcome[1] == TOTAL_TIMEOUT:
                record["error"] = error
                return record
            if not (outcome[1] in ALWAYS_RETRIED or outcome[1] in retry.retry_on) \
                    or number == retry.max_attempts:
                record["error"] = error
                return record
            delay = retry.backoff_ms(number) / 1000
            if total_at is not None:
                delay = min(delay, max(0.0, (total_at - _ms()) / 1000))
            await anyio.sleep(delay)
        return None  # not reached: the last attempt returns above

    async def _local_attempt(self, active: Active, entry: dict[str, Any], body: Body,
                             rendered: Any, steps: dict[str, Any], state: dict[str, Any],
                             number: int, deadline: int | None, why: str,
                             spent: list[StepContext]) -> tuple[tuple[Any, ...], Any]:
        """One attempt: ``(("ok", output, patch) | ("error", class, message) | ("stopped",),
        progress)``."""
        parent = active.ctx
        lease = {k: v for k, v in active.lease.items() if k not in ("local_steps", "run_input")}
        lease.update({"step_id": entry["step_id"], "body": entry.get("body"), "attempt": number,
                      "input": rendered, "steps": dict(steps), "state": dict(state),
                      "idempotency_key": entry.get("idempotency_key"),
                      "timeout_ms": entry.get("timeout_ms"), "execution_mode": "local",
                      # The local step's span in the run's trace: its body's spans nest
                      # under it (a daemon older than local spans sends none: derived).
                      "span_id": entry.get("span_id")
                      or local_span_id(active.lease["lease_id"], entry["step_id"])})
        ctx = StepContext(lease)
        spent.append(ctx)
        host = LocalHost(parent, deadline, why)
        ctx._host = host
        active.local_ctx, active.local_async = ctx, body.is_async
        local = Active(lease, ctx, body, active.scope)
        try:
            if body.is_async and deadline is not None:
                with anyio.move_on_after(max(0.0, (deadline - _ms()) / 1000)):
                    return self._outcome(await self._invoke(local, body), ctx, host), ctx._progress
                ctx._cancel(why)
                return ("error", why, _timeout_message(why, entry)), ctx._progress
            return self._outcome(await self._invoke(local, body), ctx, host), ctx._progress
        finally:
            active.local_ctx = None

    @staticmethod
    def _outcome(outcome: tuple[Any, ...], ctx: StepContext, host: LocalHost) -> tuple[Any, ...]:
        """An attempt's outcome as observed after the body returned."""
        reason = ctx._cancel_reason or host.reason()
        if reason in ("timeout", TOTAL_TIMEOUT):
            return ("error", reason, "no result within the step's "
                    + ("timeout_ms" if reason == "timeout" else "total_timeout_ms"))
        if reason is not None or outcome[0] == "cancelled":
            return ("stopped",)
        if outcome[0] == "ok":
            return ("ok", outcome[1], dict(ctx._patch) if ctx._patch else None)
        return outcome


def _spent(attempts: list[StepContext]) -> dict[str, Any]:
    """A local step's ``usage`` and ``spans`` for its record, over all its attempts (a
    failed attempt's model calls cost as much as a successful one's).

    ``spans``: every attempt's, each with its own usage (the daemon prices each
    by its model and sums them). ``usage``: only when a body called
    ``ctx.set_usage`` (it overrides the sum of spans, as in a ``complete``):
    then the sum over attempts of each one's override, else its spans' sum,
    naming the model when every attempt set the same one.
    """
    out: dict[str, Any] = {}
    spans = [s.to_json() for ctx in attempts for s in ctx.spans]
    if spans:
        out["spans"] = spans
    overrides = [ctx._usage for ctx in attempts if ctx._usage is not None]
    if overrides:
        usage: dict[str, Any] = {"input_tokens": 0, "output_tokens": 0}
        for ctx in attempts:
            u = ctx.usage
            usage["input_tokens"] += u["input_tokens"]
            usage["output_tokens"] += u["output_tokens"]
        models = {o.get("model") for o in overrides}
        if len(overrides) == len(attempts) and len(models) == 1 and None not in models:
            usage["model"] = models.pop()
        out["usage"] = usage
    return out


def _timeout_message(why: str, entry: dict[str, Any]) -> str:
    if why == "timeout":
        return f"no result within timeout_ms={entry.get('timeout_ms')}"
    return f"no result within total_timeout_ms={entry.get('total_timeout_ms')}"


def _fail(record: dict[str, Any], cls: str, message: str) -> dict[str, Any] | None:
    """End a record in an error without a new attempt (it needs one attempt at least)."""
    attempts = record["attempts"]
    if not attempts:
        return None
    record["error"] = {"class": cls, "message": message}  # the last attempt keeps its own
    return record
