"""One lease's life in the worker, by PROTOCOL.md (mixed into `stepd.Worker`).

From arrival to the last answer: the unservable check, ``started`` (awaited
before an ``at_most_once`` body; in parallel with an ``at_least_once`` body,
and always answered before ``complete`` is sent, unless both go out in order
on one WebSocket), the body itself (async in the worker's loop, sync in its
thread pool), and ``complete`` or ``fail`` with every 409 answered by its reason:

=================  ==========================================================
``already_applied``  success (an earlier send arrived; its answer was lost)
``fenced``           abandon: post nothing more; a running body is cancelled
``run_terminal``     stop every body of the run; take nothing more of it
``not_started``      a worker bug: logged at error level, recorded, the worker stops
=================  ==========================================================

Calls lost with a connection are sent again on the next one (every lease call
is safe to repeat); heartbeats are not (the next one follows soon).

What a lease costs, and why. Leases run on *runners* (`stepd._runners`):
long-lived tasks that park between leases, so a lease costs no task, no task
group and no event; a runner's leases run inside one cancel scope of its
own, made anew only after it was used to cancel a body (``fenced``,
``run_terminal``, the grace period, or ``ctx.cancel_scope.cancel()``), so a
lease costs no cancel scope either. Over the WebSocket ``started`` is a frame
sent ahead (`Channel.send_soon`) whose answer comes back to a callback: no
task, no wait. Heartbeats are in `stepd._heartbeats` (nothing per lease for a
body that ends within a second).
"""

from __future__ import annotations

import collections
import functools
import inspect
import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Final

import anyio
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread

from stepd import _otel_context
from stepd._bodies import REPORTING, Active, Body, Definition, Runner, call_in_thread
from stepd._errors import (
    AlreadyApplied,
    Cancelled,
    Fenced,
    NotFound,
    Retryable,
    RunTerminal,
    StepdError,
    StepFailure,
)
from stepd._runners import CANCELLED, LeaseRunners
from stepd.actors import Waiter
from stepd.channels import Channel, Lost, Unencodable, frame_error
from stepd.context import StepContext, _current_ctx

if TYPE_CHECKING:
    import httpx

    from stepd._http1 import Http1Client

log = logging.getLogger("stepd.worker")

TERMINAL_MEMORY_S: Final = 600.0
TERMINAL_MEMORY_MAX: Final = 10_000


class LeaseProtocol(LeaseRunners):
    """The per-lease half of `stepd.Worker`: it reads the worker's state below."""

    timeout: float
    stopping: bool
    _http: httpx.AsyncClient | Http1Client | None
    _channel: Channel | None
    _channel_ready: Waiter
    _defs: dict[tuple[str, str | None], Definition]
    _terminal_runs: collections.OrderedDict[str, float]
    _fatal: list[BaseException]
    _threads: anyio.CapacityLimiter | None
    _lease_ttl_s: float
    _fold_started: bool
    _token: Any
    _loop_thread: int | None
    grace: float

    if TYPE_CHECKING:  # the worker's (`stepd.worker`) and the heartbeats' (`stepd._heartbeats`)
        def _stop_here(self, grace: float) -> None: ...

        def _body_starts(self, active: Active) -> None: ...

        def _body_ends(self, active: Active) -> None: ...

        async def _enter_session(self, lease: dict[str, Any]) -> tuple[Any, ...] | None: ...
        async def _run_local(self, active: Active, parent_output: Any) -> None: ...

        async def _sticky_history(self, active: Active) -> None: ...

        def _sticky_forget(self, run_id: str) -> None: ...

    # ------------------------------------------------------------------ cancels from outside

    def on_cancel(self, lease_id: str, reason: str) -> None:
        """The daemon ended one of our leases (a WebSocket or in-process ``cancel`` push)."""
        active = self._active.get(lease_id)
        if active is None:
            return
        if reason == "run_terminal":
            self._run_over(active.ctx.run_id)
        else:
            self._cancel_active(active, "fenced" if reason == "fenced" else reason)

    def _cancel_active(self, active: Active, reason: str) -> None:
        ctx = active.ctx
        local = active.local_ctx
        if local is not None:
            local._cancel(reason)
        if ctx._cancel(reason):
            log.info("worker %s: cancelling %s/%s (lease %s): %s", self.name, ctx.run_id,
                     ctx.step_id, ctx.lease_id, reason)
            # A sync body keeps its slot until its thread returns: only async ones are
            # interrupted (the grace period's end interrupts both).
            # A local body running after the parent's (`stepd._local`) is judged by its own.
            running_async = active.local_async if local is not None else active.body.is_async
            if active.in_body and running_async:
                active.scope.cancel()

    def _cancel_body(self, ctx: StepContext) -> None:
        """``ctx.cancel_scope.cancel()``: interrupt that body, if it still runs."""
        active = self._active.get(ctx.lease_id)
        if active is not None and active.ctx is ctx and active.in_body:
            active.scope.cancel()

    def _run_over(self, run_id: str) -> None:
        """``run_terminal``: stop every body of the run and take nothing more of it."""
        now = time.monotonic()
        memory = self._terminal_runs
        memory[run_id] = now + TERMINAL_MEMORY_S
        memory.move_to_end(run_id)
        while memory and (len(memory) > TERMINAL_MEMORY_MAX or next(iter(memory.values())) < now):
            memory.popitem(last=False)
        for active in list(self._active.values()):
            if active.ctx.run_id == run_id:
                self._cancel_active(active, "run_terminal")
        self._sticky_forget(run_id)

    def _run_is_over(self, run_id: str) -> bool:
        expiry = self._terminal_runs.get(run_id)
        return expiry is not None and expiry > time.monotonic()

    def _unservable(self, lease: dict[str, Any]) -> str:
        key = (lease.get("workflow"), lease.get("version"))
        held = self._defs.get(key)  # type: ignore[arg-type]
        if held is None:
            return f"worker {self.name} does not hold workflow {key[0]!r} version {key[1]!r}"
        if lease.get("definition_hash") != held.definition_hash:
            theirs = str(lease.get("definition_hash"))[:12]
            return (f"worker {self.name} holds {key[0]!r} version {key[1]!r} with "
                    f"definition_hash {held.definition_hash[:12]}, not {theirs}")
        return f"worker {self.name} holds no body {lease.get('body')!r} of {key[0]!r}"

    # ------------------------------------------------------------------ one lease

    async def _lease(self, runner: Runner) -> None:
        lease = runner.lease
        runner.lease = None
        assert lease is not None
        lease_id = lease["lease_id"]
        run_id = lease["run_id"]
        # Required fields of a Lease (transport/openapi.json) are read by subscript.
        held = self._defs.get((lease["workflow"], lease["version"]))
        body = None
        if held is not None and lease["definition_hash"] == held.definition_hash:
            body = held.bodies.get(lease["body"])
        if body is None or self.stopping:
            problem = self._unservable(lease) if body is None \
                else f"worker {self.name} is stopping"
            await self._final(None, lease_id, run_id, "fail",
                              {"error": {"class": "unservable", "message": problem}})
            self._release(runner, None)
            return
        if self._terminal_runs and self._run_is_over(run_id):
            log.debug("worker %s: lease %s of run %s, which is over: not run", self.name,
                      lease_id, run_id)
            self._release(runner, None)
            return
        ctx = StepContext(lease)
        ctx._host = self
        active = runner.active = Active(lease, ctx, body, runner.scope)
        self._active[lease_id] = active
        if "sticky" in lease:
            # The history before anything else: a lease whose history cannot be had
            # (fenced, the run over) is treated as a refused `started`.
            try:
                await self._sticky_history(active)
            except (StepdError, Lost, Unencodable) as exc:
                self._started_refused(active, exc)
                await self._after_body(runner, active, CANCELLED)
                return
        if lease["delivery"] == "at_most_once":
            # The daemon persists `started` before answering: only then may the body run.
            await self._started(active)
        elif self._fold_started:
            # Held back: most bodies end before their first heartbeat is due, and
            # then `started` rides in their `complete` (docs/leases.md "A folded
            # started"); a longer body sends it with that heartbeat (`_heartbeats`).
            active.started_state = 3
        else:
            self._started_soon(active)  # the body starts at once; `started` goes out beside it
        outcome: tuple[Any, ...] = CANCELLED
        if not (ctx._cancel_reason or active.reported):
            self._body_starts(active)
            active.in_body = True
            try:
                outcome = await self._invoke(active, body)
                if outcome[0] == "ok" and lease.get("local_steps"):
                    # Still "in body": the parent lease keeps heartbeating, and a
                    # cancel (grace end) reports the parent's output with the
                    # local steps finished so far (`_runner`'s `active.outcome`).
                    active.outcome = outcome
                    await self._run_local(active, outcome[1])
            finally:
                active.in_body = False
                if active.beat_scope is not None:
                    self._body_ends(active)
        active.outcome = outcome
        await self._after_body(runner, active, outcome)

    async def _after_body(self, runner: Runner, active: Active, outcome: tuple[Any, ...]) -> None:
        # `complete` never overtakes `started`: it waits for started's answer, or
        # (one WebSocket) follows it on the wire (`_call`'s `after`).
        channel = self._channel
        if self._daemon is None and (channel is None or not channel.answers_leases):
            await self._report(active, outcome)
            self._release(runner, active)
            return
        # In process, a lease offered while this runner's `complete` is in flight (the
        # run's next step), or when the slot it frees is granted back (the credit, in
        # `_release`), is this runner's to take when it parks (`_bodies.REPORTING`);
        # over HTTP, the lease the `complete`'s answer carries (``claim_next``).
        token = REPORTING.set(runner)
        try:
            await self._report(active, outcome, runner)
            runner.reporting = True
            try:
                self._release(runner, active)
            finally:
                runner.reporting = False
        finally:
            REPORTING.reset(token)

    # -- started ----------------------------------------------------------------------

    def _started_soon(self, active: Active) -> None:
        channel = self._channel
        if channel is not None and channel.ordered:
            try:
                channel.send_soon("started", active.ctx.lease_id, {},
                                  functools.partial(self._started_answer, active))
            except Lost:
                pass
            else:
                active.started_on, active.started_state = channel, 1
                return
        # An idle runner (else a task) sends it, and again on the next connection.
        idle = self._idle
        if idle:
            runner = idle.pop()
            runner.job = active
            waiter = runner.waiter
            runner.waiter = None
            waiter.set()  # type: ignore[union-attr]
            return
        assert self._tg is not None
        runner = Runner(None)
        runner.job = active
        self._runners += 1
        self._tg.start_soon(self._runner, runner, name="stepd worker runner")

    def _started_answer(self, active: Active, frame: dict[str, Any] | None) -> None:
        """The answer to a `started` sent ahead (None: its connection ended first)."""
        if frame is None:
            if not active.finished and active.started_state == 1:
                active.started_state = 0
                assert self._tg is not None
                self._tg.start_soon(self._started, active, name="stepd started")
            return
        if frame["op"] != "ok":
            self._started_refused(active, frame_error(frame))
        self._started_answered(active)

    async def _started(self, active: Active) -> None:
        try:
            await self._call("started", active.ctx.lease_id, {},
                             give_up_s=max(30.0, 2 * self._lease_ttl_s), started=active)
        except (StepdError, Lost, Unencodable) as exc:
            self._started_refused(active, exc)
        finally:
            self._started_answered(active)

    def _started_answered(self, active: Active) -> None:
        active.started_state = 2
        done = active.started_done
        if done is not None:
            done.set()

    def _started_refused(self, active: Active, exc: BaseException) -> None:
        if isinstance(exc, AlreadyApplied):
            active.reported = True
            self._cancel_active(active, "lost")
        elif isinstance(exc, Fenced):
            self._cancel_active(active, "fenced")
        elif isinstance(exc, RunTerminal):
            self._run_over(active.ctx.run_id)
        elif isinstance(exc, NotFound):
            self._cancel_active(active, "lost")
        else:
            log.error("worker %s: started of lease %s failed: %r", self.name,
                      active.ctx.lease_id, exc)
            self._cancel_active(active, "lost")

    # -- the body ---------------------------------------------------------------------

    async def _invoke(self, active: Active, body: Body) -> tuple[Any, ...]:
        ctx = active.ctx
        lease = active.lease
        nargs = body.nargs
        if nargs == 0:
            args: tuple[Any, ...] = ()
        elif nargs == 1:
            args = (ctx,)
        elif nargs == 2:
            args = (ctx, lease["input"])
        else:
            args = (ctx, lease["input"], lease.get("steps") or {})
        # The daemon's trace, continued here when the application uses OpenTelemetry.
        ctx._otel = _otel_context.parent_for(lease["trace_id"], lease["span_id"])
        if "session" in lease:  # a worker session's step: its holder restores resources first
            refused = await self._enter_session(lease)
            if refused is not None:
                return refused
        try:
            if body.is_async:
                token = _current_ctx.set(ctx)
                otel = None if ctx._otel is None else _otel_context.attach(ctx._otel)
                try:
                    return ("ok", await body.fn(*args))
                finally:
                    if otel is not None:
                        _otel_context.detach(otel)
                    _current_ctx.reset(token)
            value = await anyio.to_thread.run_sync(
                call_in_thread, body.fn, args, ctx, limiter=self._threads,
                abandon_on_cancel=True)
            if inspect.isawaitable(value):
                if inspect.iscoroutine(value):
                    value.close()
                message = f"body {body.name!r} returned an awaitable: declare it `async def`"
                return ("error", "fatal", message)
            return ("ok", value)
        except Retryable as exc:
            return ("error", "retryable", str(exc))
        except StepFailure as exc:
            return ("error", exc.error_class, exc.message)
        except Cancelled:
            return CANCELLED
        except Exception as exc:  # the body failed: class fatal, the traceback stays here
            log.warning("worker %s: body %r of %s/%s (attempt %s) failed", self.name, body.name,
                        ctx.run_id, ctx.step_id, ctx.attempt, exc_info=True)
            return ("error", "fatal", f"{type(exc).__name__}: {exc}")

    # ------------------------------------------------------------------ heartbeats asked for

    def _poke(self, ctx: StepContext) -> None:
        """``ctx.heartbeat()``: wake the lease's heartbeat loop (from any thread)."""
        active = self._active.get(ctx.lease_id)
        if active is None or active.ctx is not ctx or active.poke_pending:
            return
        active.poke_pending = True
        if threading.get_ident() == self._loop_thread:
            if active.poke is not None:
                active.poke.set()
            return
        token = self._token
        if token is None or active.poke is None:
            return  # the heartbeat loop, once started, sees `poke_pending`
        try:
            anyio.from_thread.run_sync(_set_poke, active, token=token)
        except RuntimeError:
            pass  # the worker's loop has ended


def _set_poke(active: Active) -> None:
    if active.poke is not None:
        active.poke.set()
