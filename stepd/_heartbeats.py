"""Heartbeats (mixed into `stepd.Worker`): every ``heartbeat_ms`` while a body runs.

A lease's first heartbeat can go out no sooner than ``gap = min(1 s,
heartbeat_ms / 4)`` after its body starts (on ``ctx.heartbeat()``; otherwise
after a whole interval), so its heartbeat task is started only once its body
has run that long, and only if it still runs: most bodies end first, and then
cost no task, no cancel scope and no wake-up.

One task per worker, the *ticker*, finds those bodies. It ticks every ``gap``
while bodies start, and parks once a whole tick passed with none started and
none running (the next body wakes it). A body notes the tick it started in
(`Active.born_tick`, an attribute copy: no clock read); at a tick two past it
the body has run longer than ``gap`` (and less than ``2 * gap``), and its
heartbeat task starts. A busy worker pays one tick per ``gap`` (one a second
by default) for all its leases together, not one per lease.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import anyio

from stepd._bodies import Active
from stepd._errors import AlreadyApplied, Fenced, NotFound, RunTerminal, StepdError, Unavailable
from stepd.actors import Waiter, current_time
from stepd.channels import Lost, Unencodable

log = logging.getLogger("stepd.worker")


class Heartbeats:
    """The ticker and the per-lease heartbeat loops; they read the worker's state below."""

    name: str
    _active: dict[str, Active]
    _tg: anyio.abc.TaskGroup | None
    _heartbeat_s: float

    def _init_heartbeats(self) -> None:
        self._tick = 0
        self._tick_at = 0.0
        self._bodies_started = 0
        self._ticker_idle: Waiter | None = None
        self._ticker_scope: anyio.CancelScope | None = None

    def _heartbeat_gap(self) -> float:
        return min(1.0, self._heartbeat_s / 4)

    def _body_starts(self, active: Active) -> None:
        active.born_tick = self._tick
        active.born_at = self._tick_at
        self._bodies_started += 1
        idle = self._ticker_idle
        if idle is not None:  # the ticker is parked: this tick starts now
            self._ticker_idle = None
            now = current_time()
            self._tick += 1
            self._tick_at = now
            active.born_tick = self._tick
            active.born_at = now
            idle.set()

    def _body_ends(self, active: Active) -> None:
        scope = active.beat_scope
        if scope is not None:
            scope.cancel()

    async def _run_ticker(self) -> None:
        scope = self._ticker_scope = anyio.CancelScope()
        with scope:
            await self._ticker()

    async def _ticker(self) -> None:
        seen = self._bodies_started  # parked until the first body starts
        while True:
            if self._bodies_started == seen and not any(a.in_body for a in self._active.values()):
                idle = self._ticker_idle = Waiter()
                await idle.wait()  # `_body_starts` wakes it (and starts the tick)
            seen = self._bodies_started
            await anyio.sleep(self._heartbeat_gap())
            self._tick += 1
            self._tick_at = current_time()
            tick = self._tick
            for active in list(self._active.values()):
                if active.in_body and not active.beating and tick - active.born_tick >= 2 \
                        and self._tg is not None:
                    if active.started_state == 3:  # held back this long: send it now
                        active.started_state = 0
                        self._started_soon(active)
                    active.beating = True
                    beats = active.beat_scope = anyio.CancelScope()
                    self._tg.start_soon(self._heartbeats, active, beats,
                                        name=f"stepd heartbeats {active.ctx.lease_id}")

    async def _heartbeats(self, active: Active, scope: anyio.CancelScope) -> None:
        with scope:  # cancelled once the body is over (`_body_ends`)
            await self._beat(active)

    async def _beat(self, active: Active) -> None:
        ctx = active.ctx
        interval = self._heartbeat_s
        gap = self._heartbeat_gap()
        last = active.born_at  # at or a little before the body started
        while True:
            poke = active.poke = Waiter()
            if not active.poke_pending:
                with anyio.move_on_at(last + interval):
                    await poke.wait()
            now = current_time()
            if now < last + gap:
                await anyio.sleep(last + gap - now)
            active.poke = None
            active.poke_pending = False
            has, progress = ctx._take_progress()
            last = current_time()
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

    if TYPE_CHECKING:  # `stepd._leases.LeaseProtocol`'s
        async def _call_once(self, op: str, lease_id: str, body: dict[str, Any]
                             ) -> dict[str, Any]: ...

        def _cancel_active(self, active: Active, reason: str) -> None: ...

        def _run_over(self, run_id: str) -> None: ...

        def _started_soon(self, active: Active) -> None: ...
