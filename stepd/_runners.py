"""The worker's runners: the tasks leases run on, and the slots they hold
(mixed into `stepd.Worker` under `stepd._leases.LeaseProtocol`).

Why runners: a lease must cost no task, no task group and no event. A runner
is a long-lived task (at most ``concurrency`` of them) that parks on a
`stepd.actors.Waiter` between leases; a lease that arrives goes to the runner
reporting in this task (in process: `stepd._bodies.REPORTING`), else an idle
runner, else a new one. A runner's leases run inside one cancel scope of its
own, made anew only after it was used to cancel a body. What one lease does
on its runner (``started``, the body, ``complete``) is `stepd._leases`; here
is only who runs it and the slot it holds (``running``) until it is over.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

import anyio

from stepd._bodies import REPORTING, Active, Runner
from stepd._calls import LOST_REASONS, LeaseCalls
from stepd.actors import Waiter

if TYPE_CHECKING:
    from stepd.embedded import Embedded

__all__ = ["CANCELLED", "DIRECT_FAIL_TIMEOUT_S", "LeaseRunners"]

DIRECT_FAIL_TIMEOUT_S: Final = 5.0
CANCELLED: Final = ("cancelled",)
"""The outcome of a body that did not finish (cancelled, or never started)."""


class LeaseRunners(LeaseCalls):
    """The runner pool of `stepd.Worker`: it reads the worker's state below."""

    name: str
    concurrency: int
    running: int
    _daemon: Embedded | None
    _tg: anyio.abc.TaskGroup | None
    _active: dict[str, Active]
    _idle: list[Runner]
    _runners: int
    _handoffs: int
    _done_running: bool

    if TYPE_CHECKING:  # the worker's (`stepd.worker`) and one lease's (`stepd._leases`)
        def _slots_changed(self) -> None: ...

        async def _lease(self, runner: Runner) -> None: ...

        async def _started(self, active: Active) -> None: ...

        async def _after_body(self, runner: Runner, active: Active,
                              outcome: tuple[Any, ...]) -> None: ...

    # ------------------------------------------------------------------ leases in

    def accept(self, lease: dict[str, Any]) -> None:
        """A lease arrived (from any channel): the runner reporting in this task takes it
        when its call returns (`stepd._bodies.REPORTING`), else an idle runner, else a new one."""
        self.running += 1
        channel = self._channel
        if self._daemon is not None or (channel is not None and channel.answers_leases):
            # In process, or a lease in a call's answer (HTTP): offered inside a call.
            reporting = REPORTING.get()
            if reporting is not None and reporting.reporting and reporting.handoff is None:
                reporting.handoff = lease
                return
        idle = self._idle
        if idle:
            runner = idle.pop()
            runner.lease = lease
            runner.holding = True
            waiter = runner.waiter
            runner.waiter = None
            waiter.set()  # type: ignore[union-attr]
            return
        assert self._tg is not None
        runner = Runner(lease)
        runner.holding = True
        self._runners += 1
        self._tg.start_soon(self._runner, runner, name="stepd worker runner")

    # ------------------------------------------------------------------ runners

    async def _runner(self, runner: Runner) -> None:
        cancelled = anyio.get_cancelled_exc_class()
        try:
            while True:
                scope = runner.scope = anyio.CancelScope()
                with scope:
                    while True:
                        job = runner.job
                        if job is None:
                            await self._lease(runner)
                        else:  # an idle runner lent to send a lease's `started`
                            runner.job = None
                            await self._started(job)
                        if not await self._park(runner):
                            return
                # A body's cancellation left the scope (or a body swallowed it, and the
                # scope's cancellation hit what followed): finish its lease out here.
                active = runner.active
                if active is not None:
                    await self._after_body(runner, active, active.outcome or CANCELLED)
                else:
                    self._release(runner, None)
                if not await self._park(runner):
                    return
        except cancelled:
            await self._abandon(runner)
            raise
        finally:
            self._runners -= 1

    def _pass_on(self, runner: Runner) -> None:
        """The lease handed to ``runner`` goes to another one: ``runner`` is not free yet."""
        lease = runner.handoff
        if lease is not None:
            runner.handoff = None
            self.running -= 1
            self.accept(lease)

    async def _park(self, runner: Runner) -> bool:
        """Wait for the next lease (or job); False: this runner ends (the worker has finished)."""
        lease = runner.handoff
        if lease is not None:  # offered while this runner reported: taken without a wait
            runner.handoff = None
            runner.lease = lease
            runner.holding = True
            self._handoffs += 1
            return True
        if self._done_running or self._runners > self.concurrency:
            return False
        waiter = runner.waiter = Waiter()
        self._idle.append(runner)
        await waiter.wait()
        return runner.lease is not None or runner.job is not None

    def _release(self, runner: Runner, active: Active | None) -> None:
        """The lease is over (reported, dropped or refused): free its slot."""
        if active is not None:
            active.finished = True
            self._active.pop(active.ctx.lease_id, None)
            runner.active = None
        if runner.holding:
            runner.holding = False
            self.running -= 1
            self._slots_changed()

    async def _abandon(self, runner: Runner) -> None:
        """The worker itself is being cancelled: fail the attempt back, not silently."""
        active = runner.active
        if active is not None and not active.reported \
                and active.ctx._cancel_reason not in LOST_REASONS:
            with anyio.CancelScope(shield=True), anyio.move_on_after(DIRECT_FAIL_TIMEOUT_S):
                await self._direct_fail(active.ctx.lease_id, "retryable",
                                        f"worker {self.name} was cancelled")
        self._release(runner, active)

