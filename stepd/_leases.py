"""One lease's life in the worker, by PROTOCOL.md (mixed into `stepd.Worker`).

From arrival to the last answer: the unservable check, ``started`` (awaited
before an ``at_most_once`` body; in parallel with an ``at_least_once`` body,
and always answered before ``complete`` is sent), heartbeats, the body itself
(async in the worker's loop, sync in its thread pool), and ``complete`` or
``fail`` with every 409 answered by its reason:

=================  ==========================================================
``already_applied``  success (an earlier send arrived; its answer was lost)
``fenced``           abandon: post nothing more; a running body is cancelled
``run_terminal``     stop every body of the run; take nothing more of it
``not_started``      a worker bug: logged at error level, recorded, the worker stops
=================  ==========================================================

Calls lost with a connection are sent again on the next one (every lease call
is safe to repeat); heartbeats are not (the next one follows soon).
"""

from __future__ import annotations

import abc
import collections
import functools
import heapq
import inspect
import itertools
import logging
import random
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

import anyio
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread

from stepd._bodies import Active, Body, Definition, call_in_thread
from stepd._channels import Channel, HttpChannel, InProcessChannel, Lost, Unencodable
from stepd._errors import (
    AlreadyApplied,
    Cancelled,
    Fenced,
    Invalid,
    NotFound,
    NotStarted,
    Retryable,
    RunTerminal,
    StepdError,
    StepFailure,
    Unavailable,
)
from stepd.actors import Waiter, current_time
from stepd.context import StepContext, _current_ctx

if TYPE_CHECKING:
    import httpx

    from stepd._http1 import Http1Client
    from stepd.embedded import Embedded

log = logging.getLogger("stepd.worker")

RECONNECT_BASE_S: Final = 0.05
RECONNECT_CAP_S: Final = 5.0
TERMINAL_MEMORY_S: Final = 600.0
TERMINAL_MEMORY_MAX: Final = 10_000
DIRECT_FAIL_TIMEOUT_S: Final = 5.0
MAX_MESSAGE_CHARS: Final = 4000
LOST_REASONS: Final = frozenset({"fenced", "run_terminal", "lost"})


_JITTER = random.Random()
"""Our own generator: backoff jitter never touches the `random` module's global state
(which the application, or hypothesis in a test, may own)."""


def backoff(attempt: int) -> float:
    """Bounded exponential backoff with jitter (half to full)."""
    return _JITTER.uniform(0.5, 1.0) * min(RECONNECT_CAP_S,
                                          RECONNECT_BASE_S * float(2 ** min(attempt, 16)))


def _message(text: str) -> str:
    return text if len(text) <= MAX_MESSAGE_CHARS else text[: MAX_MESSAGE_CHARS - 1] + "…"


class LeaseProtocol(abc.ABC):
    """The per-lease half of `stepd.Worker`: it reads the worker's state below."""

    name: str
    timeout: float
    _daemon: Embedded | None
    _http: httpx.AsyncClient | Http1Client | None
    _tg: anyio.abc.TaskGroup | None
    _channel: Channel | None
    _channel_ready: anyio.Event
    _defs: dict[tuple[str, str | None], Definition]
    _active: dict[str, Active]
    _beats_due: list[tuple[float, int, Active, anyio.CancelScope]]
    _beats_seq: itertools.count[int]
    _beats_wake: Waiter
    _running: int
    _stopping: bool
    _terminal_runs: collections.OrderedDict[str, float]
    _fatal: list[BaseException]
    _threads: anyio.CapacityLimiter | None
    _heartbeat_s: float
    _lease_ttl_s: float
    _token: Any
    _loop_thread: int | None
    grace: float

    @abc.abstractmethod
    def _slots_changed(self) -> None: ...

    @abc.abstractmethod
    def _stop_here(self, grace: float) -> None: ...

    # ------------------------------------------------------------------ calls

    async def _call(self, op: str, lease_id: str, body: dict[str, Any], *,
                    give_up_s: float | None = None,
                    on_sent: Callable[[Channel], None] | None = None,
                    after: Active | None = None) -> dict[str, Any]:
        """A lease call, sent again on the next connection if this one is lost.

        Args:
            on_sent: called with the channel once the request is on an ordered
                channel's wire (`Channel.ordered`).
            after: the lease whose `started` this call must not overtake: it is
                sent once `started` is answered, or at once when `started` went
                out on the same ordered channel (the daemon applies them in order).

        Raises:
            the typed answer (a conflict, NotFound, Invalid...), Unencodable, or
            Lost once ``give_up_s`` has passed.
        """
        deadline = None if give_up_s is None else current_time() + give_up_s
        attempt = 0
        while True:
            channel = self._channel
            if after is not None and after.started_done is not None \
                    and not after.started_done.is_set() \
                    and not (channel is not None and channel.ordered
                             and after.started_on is channel):
                await after.started_done.wait()
                continue  # the connection may have changed meanwhile
            if channel is not None:
                try:
                    sent = None if on_sent is None else functools.partial(on_sent, channel)
                    return await channel.call(op, lease_id, body, on_sent=sent)
                except (Lost, Unavailable) as exc:
                    failure: BaseException = exc
            else:
                failure = Lost("not connected")
            now = anyio.current_time()
            if deadline is not None and now >= deadline:
                raise Lost(f"gave up {op} of lease {lease_id} after {give_up_s:.0f} s: {failure}")
            delay = backoff(attempt)
            attempt += 1
            if deadline is not None:
                delay = min(delay, max(0.0, deadline - now))
            if self._channel is channel or channel is None:
                with anyio.move_on_after(delay):
                    await self._channel_ready.wait()
            else:
                await anyio.lowlevel.checkpoint()

    async def _call_once(self, op: str, lease_id: str, body: dict[str, Any]) -> dict[str, Any]:
        channel = self._channel
        if channel is None:
            raise Lost("not connected")
        return await channel.call(op, lease_id, body)

    async def _direct_fail(self, lease_id: str, error_class: str, message: str) -> None:
        """Fail a lease outside the connection (the worker is being cancelled)."""
        body = {"error": {"class": error_class, "message": _message(message)}}
        try:
            if self._daemon is not None:
                await InProcessChannel(self._daemon).call("fail", lease_id, body)
            elif self._http is not None:
                await HttpChannel(self._http, self.timeout).call("fail", lease_id, body)
        except (StepdError, Lost, Unencodable) as exc:
            log.warning("worker %s: could not fail lease %s back: %r", self.name, lease_id, exc)

    # ------------------------------------------------------------------ leases in

    def accept(self, lease: dict[str, Any]) -> None:
        """A lease arrived (from any channel): run it in its own task."""
        assert self._tg is not None
        self._running += 1
        self._tg.start_soon(self._run_lease, lease, name=f"stepd lease {lease.get('lease_id')}")

    def on_cancel(self, lease_id: str, reason: str) -> None:
        """The daemon ended one of our leases (a WebSocket ``cancel`` push)."""
        if reason == "run_terminal":
            active = self._active.get(lease_id)
            if active is not None:
                self._run_over(active.ctx.run_id)
            return
        active = self._active.get(lease_id)
        if active is not None:
            self._cancel_active(active, "fenced" if reason == "fenced" else reason)

    def _cancel_active(self, active: Active, reason: str) -> None:
        if active.ctx._cancel(reason):
            log.info("worker %s: cancelling %s/%s (lease %s): %s", self.name, active.ctx.run_id,
                     active.ctx.step_id, active.ctx.lease_id, reason)

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

    def _run_is_over(self, run_id: str) -> bool:
        expiry = self._terminal_runs.get(run_id)
        return expiry is not None and expiry > time.monotonic()

    def _unservable(self, lease: dict[str, Any]) -> tuple[str | None, Body | None]:
        key = (lease.get("workflow"), lease.get("version"))
        held = self._defs.get(key)  # type: ignore[arg-type]
        if held is None:
            return (f"worker {self.name} does not hold workflow {key[0]!r} version {key[1]!r}",
                    None)
        if lease.get("definition_hash") != held.definition_hash:
            theirs = str(lease.get("definition_hash"))[:12]
            message = (f"worker {self.name} holds {key[0]!r} version {key[1]!r} with "
                       f"definition_hash {held.definition_hash[:12]}, not {theirs}")
            return message, None
        body = held.bodies.get(lease.get("body"))  # type: ignore[arg-type]
        if body is None:
            return (f"worker {self.name} holds no body {lease.get('body')!r} of {key[0]!r}", None)
        return None, body

    async def _run_lease(self, lease: dict[str, Any]) -> None:
        try:
            await self._handle_lease(lease)
        finally:
            self._running -= 1
            self._slots_changed()

    async def _handle_lease(self, lease: dict[str, Any]) -> None:
        lease_id = lease["lease_id"]
        run_id = lease["run_id"]
        problem, body = self._unservable(lease)
        if problem is None and self._stopping:
            problem = f"worker {self.name} is stopping"
        if problem is not None:
            await self._final(None, lease_id, run_id, "fail",
                              {"error": {"class": "unservable", "message": problem}})
            return
        assert body is not None
        if self._run_is_over(run_id):
            log.debug("worker %s: lease %s of run %s, which is over: not run", self.name,
                      lease_id, run_id)
            return
        active = Active(lease, StepContext(lease))
        active.ctx._notify = lambda: self._poke(active)
        self._active[lease_id] = active
        try:
            await self._execute(active, body)
        except anyio.get_cancelled_exc_class():
            # The worker itself is being cancelled: fail the attempt back, not silently.
            if not active.reported and active.ctx.cancel_reason not in LOST_REASONS:
                with anyio.CancelScope(shield=True), anyio.move_on_after(DIRECT_FAIL_TIMEOUT_S):
                    await self._direct_fail(lease_id, "retryable",
                                            f"worker {self.name} was cancelled")
            raise
        finally:
            self._active.pop(lease_id, None)

    # ------------------------------------------------------------------ one lease

    async def _execute(self, active: Active, body: Body) -> None:
        ctx = active.ctx
        started = active.started_done = anyio.Event()
        sent = anyio.Event()
        outcome: tuple[Any, ...] = ("cancelled",)
        async with anyio.create_task_group() as tg:
            if ctx.delivery == "at_most_once":
                # The daemon persists `started` before answering: only then may the body run.
                await self._started(active, started, sent)
            else:
                # The body starts at once; `started` goes out beside it.
                tg.start_soon(self._started, active, started, sent)
            if not (ctx.cancelled or active.reported):
                beats = anyio.CancelScope()  # entered by the heartbeat task, if it starts
                self._schedule_heartbeats(active, beats)
                try:
                    outcome = await self._invoke(active, body)
                finally:
                    active.body_done = True
                    if active.beating:
                        beats.cancel()
            # `complete` never overtakes `started`: it waits for started's answer, or
            # (one WebSocket) follows it on the wire (`_call`'s `after`).
            await sent.wait()
            await self._report(active, outcome)

    async def _started(self, active: Active, done: anyio.Event, sent: anyio.Event) -> None:
        ctx = active.ctx

        def on_sent(channel: Channel) -> None:
            active.started_on = channel
            sent.set()

        try:
            await self._call("started", ctx.lease_id, {},
                             give_up_s=max(30.0, 2 * self._lease_ttl_s), on_sent=on_sent)
        except AlreadyApplied:
            active.reported = True
            self._cancel_active(active, "lost")
        except Fenced:
            self._cancel_active(active, "fenced")
        except RunTerminal:
            self._run_over(ctx.run_id)
        except NotFound:
            self._cancel_active(active, "lost")
        except (StepdError, Lost, Unencodable) as exc:
            log.error("worker %s: started of lease %s failed: %r", self.name, ctx.lease_id, exc)
            self._cancel_active(active, "lost")
        finally:
            done.set()
            sent.set()

    def _poke(self, active: Active) -> None:
        """``ctx.heartbeat()``: wake the lease's heartbeat loop (from any thread)."""
        if active.poke_pending:
            return
        active.poke_pending = True
        if threading.get_ident() == self._loop_thread:
            active.poke.set()
            return
        token = self._token
        if token is None:
            return
        try:
            anyio.from_thread.run_sync(lambda: active.poke.set(), token=token)
        except RuntimeError:
            pass  # the worker's loop has ended

    # Heartbeats. A lease's first heartbeat can go out no sooner than `gap` after
    # its body starts (on `ctx.heartbeat()`; otherwise after a whole interval), so
    # its heartbeat task is started only then, and only if the body still runs:
    # most bodies end first, and then cost no task, no cancel scope, no wake-up.
    # One task per worker (`_heartbeat_starter`) keeps the start times in a heap.

    def _heartbeat_gap(self) -> float:
        return min(1.0, self._heartbeat_s / 4)

    def _schedule_heartbeats(self, active: Active, beats: anyio.CancelScope) -> None:
        now = current_time()
        active.body_started_at = now
        due = now + self._heartbeat_gap()
        heap = self._beats_due
        heapq.heappush(heap, (due, next(self._beats_seq), active, beats))
        if heap[0][2] is active:  # a new earliest: the starter may be sleeping past it
            self._beats_wake.set()

    async def _heartbeat_starter(self) -> None:
        """Start the heartbeat task of each lease whose body outlives its gap."""
        heap = self._beats_due
        while True:
            wake = self._beats_wake = Waiter()
            if not heap:
                await wake.wait()
                continue
            with anyio.move_on_at(heap[0][0]):
                await wake.wait()
            now = current_time()
            while heap and heap[0][0] <= now:
                _, _, active, beats = heapq.heappop(heap)
                if not active.body_done and self._tg is not None:
                    active.beating = True
                    self._tg.start_soon(self._heartbeats, active, beats,
                                        name=f"stepd heartbeats {active.ctx.lease_id}")

    async def _heartbeats(self, active: Active, scope: anyio.CancelScope) -> None:
        with scope:  # cancelled by `_execute` once the body is over
            await self._beat(active)

    async def _beat(self, active: Active) -> None:
        ctx = active.ctx
        interval = self._heartbeat_s
        gap = self._heartbeat_gap()
        last = active.body_started_at
        while True:
            with anyio.move_on_at(last + interval):
                await active.poke.wait()
            now = anyio.current_time()
            if now < last + gap:
                await anyio.sleep(last + gap - now)
            active.poke = anyio.Event()
            active.poke_pending = False
            has, progress = ctx._take_progress()
            last = anyio.current_time()
            try:
                await self._call_once("heartbeat", ctx.lease_id,
                                      {"progress": progress} if has else {})
            except Fenced:
                self._cancel_active(active, "fenced")
                return
            except RunTerminal:
                self._run_over(ctx.run_id)
                return
            except NotFound:
                self._cancel_active(active, "lost")
                return
            except AlreadyApplied:
                return
            except (Lost, Unavailable, Unencodable, StepdError) as exc:
                if has and not ctx._progress_set:
                    ctx._progress, ctx._progress_set = progress, True
                log.debug("worker %s: heartbeat of %s not delivered: %r", self.name,
                          ctx.lease_id, exc)

    async def _invoke(self, active: Active, body: Body) -> tuple[Any, ...]:
        ctx = active.ctx
        lease = active.lease
        args = (ctx, lease.get("input"), lease.get("steps") or {})[: body.nargs]
        try:
            if body.is_async:
                token = _current_ctx.set(ctx)
                try:
                    with ctx.cancel_scope:
                        return ("ok", await body.fn(*args))
                finally:
                    _current_ctx.reset(token)
                return ("cancelled",)
            assert self._threads is not None
            with active.hard_scope:
                value = await anyio.to_thread.run_sync(
                    call_in_thread, body.fn, args, ctx, limiter=self._threads,
                    abandon_on_cancel=True)
                if inspect.isawaitable(value):
                    if inspect.iscoroutine(value):
                        value.close()
                    message = f"body {body.name!r} returned an awaitable: declare it `async def`"
                    return ("error", "fatal", message)
                return ("ok", value)
            return ("cancelled",)
        except Retryable as exc:
            return ("error", "retryable", str(exc))
        except StepFailure as exc:
            return ("error", exc.error_class, exc.message)
        except Cancelled:
            return ("cancelled",)
        except Exception as exc:  # the body failed: class fatal, the traceback stays here
            log.warning("worker %s: body %r of %s/%s (attempt %s) failed", self.name, body.name,
                        ctx.run_id, ctx.step_id, ctx.attempt, exc_info=True)
            return ("error", "fatal", f"{type(exc).__name__}: {exc}")

    async def _report(self, active: Active, outcome: tuple[Any, ...]) -> None:
        ctx = active.ctx
        if ctx.cancel_reason in LOST_REASONS or active.reported:
            return  # fenced, run over, or unknown: post nothing more
        if outcome[0] == "ok":
            op, body = "complete", ctx._completion(outcome[1])
        elif ctx.cancel_reason == "shutdown":
            op, body = "fail", {"error": {
                "class": "retryable",
                "message": f"worker {self.name} stopped: the body was cancelled after the grace "
                           "period"}}
        elif outcome[0] == "error":
            op, body = "fail", {"error": {"class": outcome[1], "message": _message(outcome[2])}}
        else:
            op, body = "fail", {"error": {
                "class": "fatal", "message": "the body raised stepd.Cancelled unprompted"}}
        await self._final(active, ctx.lease_id, ctx.run_id, op, body)

    async def _final(self, active: Active | None, lease_id: str, run_id: str, op: str,
                     body: dict[str, Any]) -> None:
        """Send ``complete``/``fail`` and answer the outcome by PROTOCOL.md's table."""
        give_up = max(30.0, 2 * self._lease_ttl_s)
        try:
            try:
                await self._call(op, lease_id, body, give_up_s=give_up, after=active)
            except (Invalid, Unencodable) as exc:
                # The daemon refused what the body produced (output not JSON, a
                # state patch that is not an object, an unknown error class...):
                # the attempt fails, naming why.
                log.error("worker %s: %s of lease %s refused: %s", self.name, op, lease_id, exc)
                if op == "fail" and body["error"]["class"] == "fatal":
                    return
                what = "result" if op == "complete" else "failure"
                await self._call("fail", lease_id, {"error": {
                    "class": "fatal", "message": _message(f"the step's {what} was refused: {exc}")}},
                    give_up_s=give_up)
        except AlreadyApplied:
            # An earlier send arrived and its answer was lost: that is success.
            log.debug("worker %s: %s of lease %s already applied", self.name, op, lease_id)
        except Fenced:
            log.info("worker %s: lease %s was fenced; its result is dropped", self.name, lease_id)
        except RunTerminal:
            self._run_over(run_id)
        except NotStarted as exc:
            error = NotStarted(
                f"the daemon answered not_started to {op} of lease {lease_id} (run {run_id}): "
                f"the worker sent no `started` the daemon kept; this is a worker bug: {exc}")
            log.error("worker %s: %s", self.name, error)
            self._fatal.append(error)
            self._stop_here(self.grace)
        except NotFound:
            log.warning("worker %s: the daemon does not know lease %s any more", self.name,
                        lease_id)
        except (Lost, StepdError, Unencodable) as exc:
            log.error("worker %s: could not %s lease %s: %r; the daemon recovers the attempt "
                      "when the lease expires", self.name, op, lease_id, exc)
        finally:
            if active is not None:
                active.reported = True
