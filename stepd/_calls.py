"""A lease's calls to the daemon (mixed into `stepd.Worker`): sent again across
reconnects, never overtaking ``started``, and ``complete``/``fail`` answered by
PROTOCOL.md's table of 409 reasons (`stepd._leases` says what each one does).
"""

from __future__ import annotations

import logging
import random
from typing import TYPE_CHECKING, Any, Final

import anyio
import anyio.lowlevel

from stepd._bodies import Active, Runner
from stepd._errors import (
    AlreadyApplied,
    Fenced,
    Invalid,
    NotFound,
    NotStarted,
    RunTerminal,
    StepdError,
    Unavailable,
)
from stepd.actors import Waiter, current_time
from stepd.channels import Channel, Lost, Unencodable

if TYPE_CHECKING:
    import httpx

    from stepd._http1 import Http1Client
    from stepd.embedded import Embedded

log = logging.getLogger("stepd.worker")

RECONNECT_BASE_S: Final = 0.05
RECONNECT_CAP_S: Final = 5.0
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


class LeaseCalls:
    """The calls of `stepd._leases.LeaseProtocol`; they read the worker's state below."""

    name: str
    timeout: float
    grace: float
    _daemon: Embedded | None
    _http: httpx.AsyncClient | Http1Client | None
    _channel: Channel | None
    _channel_ready: Waiter
    _fatal: list[BaseException]
    _lease_ttl_s: float

    if TYPE_CHECKING:  # the worker's and `stepd._leases.LeaseProtocol`'s
        def _stop_here(self, grace: float) -> None: ...

        def _run_over(self, run_id: str) -> None: ...

        def _sticky_complete(self, active: Active, body: dict[str, Any]) -> None: ...

        def _pass_on(self, runner: Runner) -> None: ...

        def accept(self, lease: dict[str, Any]) -> None: ...


    async def _call(self, op: str, lease_id: str, body: dict[str, Any], *,
                    give_up_s: float | None = None, after: Active | None = None,
                    started: Active | None = None) -> dict[str, Any]:
        """A lease call, sent again on the next connection if this one is lost.

        Args:
            after: the lease whose `started` this call must not overtake: it is
                sent once `started` is answered, or at once when `started` went
                out on the same ordered channel (the daemon applies them in order).
            started: this is that lease's `started` (noted as sent, per channel).

        Raises:
            the typed answer (a conflict, NotFound, Invalid...), Unencodable, or
            Lost once ``give_up_s`` has passed.
        """
        channel = self._channel
        if channel is not None and (after is None or after.started_state == 2 or (
                after.started_state == 1 and after.started_on is channel)):
            try:
                if started is not None and channel.ordered:
                    started.started_on, started.started_state = channel, 1
                return await channel.call(op, lease_id, body)
            except (Lost, Unavailable) as exc:
                if started is not None and started.started_state == 1:
                    started.started_state = 0
                return await self._call_again(op, lease_id, body, give_up_s, after, started,
                                              exc, channel)
        return await self._call_again(op, lease_id, body, give_up_s, after, started, None, None)

    async def _call_again(self, op: str, lease_id: str, body: dict[str, Any],
                          give_up_s: float | None, after: Active | None, started: Active | None,
                          failure: BaseException | None, tried: Channel | None
                          ) -> dict[str, Any]:
        deadline = None if give_up_s is None else current_time() + give_up_s
        attempt = 0
        while True:
            if failure is not None:
                now = current_time()
                if deadline is not None and now >= deadline:
                    raise Lost(f"gave up {op} of lease {lease_id} after {give_up_s:.0f} s: "
                               f"{failure}")
                delay = backoff(attempt)
                attempt += 1
                if deadline is not None:
                    delay = min(delay, max(0.0, deadline - now))
                if self._channel is tried or tried is None:
                    ready = self._channel_ready
                    with anyio.move_on_after(delay):
                        await ready.wait()
                else:
                    await anyio.lowlevel.checkpoint()
            channel = self._channel
            if after is not None and after.started_state != 2 and not (
                    after.started_state == 1 and after.started_on is channel):
                done = after.started_done
                if done is None:
                    done = after.started_done = Waiter()
                await done.wait()
                failure = None
                continue  # the connection may have changed meanwhile
            if channel is None:
                failure, tried = Lost("not connected"), None
                continue
            try:
                if started is not None and channel.ordered:
                    started.started_on, started.started_state = channel, 1
                return await channel.call(op, lease_id, body)
            except (Lost, Unavailable) as exc:
                if started is not None and started.started_state == 1:
                    started.started_state = 0
                failure, tried = exc, channel

    def _answered(self, answer: dict[str, Any]) -> None:
        """A ``complete``'s answer may carry the worker's next lease (``claim_next``,
        `Channel.answers_leases`): taken as any lease that arrives, by the runner
        reporting when there is one (`stepd._bodies.REPORTING`)."""
        leases = answer.get("leases")
        if leases:
            for lease in leases:
                self.accept(lease)

    async def _call_once(self, op: str, lease_id: str, body: dict[str, Any]) -> dict[str, Any]:
        channel = self._channel
        if channel is None:
            raise Lost("not connected")
        return await channel.call(op, lease_id, body)

    async def _direct_fail(self, lease_id: str, error_class: str, message: str) -> None:
        """Fail a lease outside the connection (the worker is being cancelled)."""
        from stepd.channels.http import HttpChannel
        from stepd.channels.inprocess import direct_fail

        body = {"error": {"class": error_class, "message": _message(message)}}
        try:
            if self._daemon is not None:
                await direct_fail(self._daemon, lease_id, body)
            elif self._http is not None:
                await HttpChannel(self._http, self.timeout).call("fail", lease_id, body)
        except (StepdError, Lost, Unencodable) as exc:
            log.warning("worker %s: could not fail lease %s back: %r", self.name, lease_id, exc)

    # ------------------------------------------------------------------ the report

    async def _report(self, active: Active, outcome: tuple[Any, ...],
                      runner: Runner | None = None) -> None:
        ctx = active.ctx
        reason = ctx._cancel_reason
        if active.reported or reason in LOST_REASONS:
            return  # fenced, run over, or unknown: post nothing more
        if outcome[0] == "ok":
            op, body = "complete", ctx._completion(outcome[1])
            if active.local_records:
                body["local_steps"] = active.local_records
            self._sticky_complete(active, body)
        elif reason == "shutdown":
            op, body = "fail", {"error": {
                "class": "retryable",
                "message": f"worker {self.name} stopped: the body was cancelled after the grace "
                           "period"}}
        elif outcome[0] == "error":
            op, body = "fail", {"error": {"class": outcome[1], "message": _message(outcome[2])}}
        else:
            op, body = "fail", {"error": {
                "class": "fatal", "message": "the body raised stepd.Cancelled unprompted"}}
        await self._final(active, ctx.lease_id, ctx.run_id, op, body, runner)

    async def _final(self, active: Active | None, lease_id: str, run_id: str, op: str,
                     body: dict[str, Any], runner: Runner | None = None) -> None:
        """Send ``complete``/``fail`` and answer the outcome by PROTOCOL.md's table.

        ``runner``: the runner reporting its lease, which takes a lease offered during
        this call when it answers (`stepd._bodies.REPORTING`); anything but that
        answer (an error, a conflict, a cancellation) passes the lease on at once,
        since the runner may have more calls to make before it is free.
        """
        after = active
        if active is not None and active.started_state == 3:
            active.started_state = 2  # `started` goes in this call
            body = {**body, "started": True}
            after = None
        try:
            try:
                if runner is None:
                    answer = await self._call(op, lease_id, body,
                                              give_up_s=max(30.0, 2 * self._lease_ttl_s),
                                              after=after)
                    if answer:  # `{}` but for a lease in it (`claim_next`): no call
                        self._answered(answer)
                else:  # `REPORTING` names the runner (`_after_body`); it takes offers now
                    runner.reporting = True
                    try:
                        answer = await self._call(op, lease_id, body,
                                                  give_up_s=max(30.0, 2 * self._lease_ttl_s),
                                                  after=after)
                        if answer:
                            self._answered(answer)
                    except BaseException:
                        runner.reporting = False
                        self._pass_on(runner)
                        raise
                    finally:
                        runner.reporting = False
            except (Invalid, Unencodable) as exc:
                if op == "complete" and "local_steps" in body:
                    # Refused local records (the gate, or records the run does not
                    # take): complete the parent alone; the daemon runs the local
                    # steps as ordinary leases (local bodies are idempotent).
                    log.warning("worker %s: local steps of lease %s refused: %s; completing "
                                "without them", self.name, lease_id, exc)
                    body = {k: v for k, v in body.items() if k != "local_steps"}
                    self._answered(await self._call(
                        op, lease_id, body, give_up_s=max(30.0, 2 * self._lease_ttl_s),
                        after=after))
                    return
                # The daemon refused what the body produced (output not JSON, a
                # state patch that is not an object, an unknown error class...):
                # the attempt fails, naming why.
                log.error("worker %s: %s of lease %s refused: %s", self.name, op, lease_id, exc)
                if op == "fail" and body["error"]["class"] == "fatal":
                    return
                what = "result" if op == "complete" else "failure"
                await self._call("fail", lease_id, {"error": {
                    "class": "fatal", "message": _message(f"the step's {what} was refused: {exc}")}},
                    give_up_s=max(30.0, 2 * self._lease_ttl_s))
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

