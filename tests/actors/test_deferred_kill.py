"""`Actor.deferred_kill`: handlers run with no cancel scope; a kill lands when the wait ends."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from stepd.actors import ActorDead, ActorKilled, ActorSystem, ChildSpec, ManualClock, StartFailed
from stepd.actors._runtime import Runtime

from ._helpers import settle
from .test_scheduler import Where


class Deferred(Where):
    deferred_kill = True

    def __init__(self, log: list[Any], gate: anyio.Event | None = None,
                 seen: list[Any] | None = None) -> None:
        super().__init__(log, gate)
        self.seen = seen

    async def receive(self, message: Any) -> Any:
        if message == "own-scope":
            assert self.gate is not None
            with anyio.move_on_after(3600):  # would make a plain class learn a scope
                await self.gate.wait()
            self.log.append("unblocked")
            return None
        if message == "scope?" and self.seen is not None:
            rt = self._actor_runtime
            assert isinstance(rt, Runtime)
            await anyio.lowlevel.checkpoint()
            self.seen.append(rt.scope)
            return None
        return await super().receive(message)


class DeferredStart(Deferred):
    async def on_start(self) -> None:
        assert self.gate is not None
        self.log.append("starting")
        await self.gate.wait()
        self.log.append("started")


async def test_a_deferred_kill_handler_waits_with_no_scope_and_never_learns_one() -> None:
    gate = anyio.Event()
    log: list[Any] = []
    seen: list[Any] = []
    async with ActorSystem(clock=ManualClock()) as system:
        ref = await system.spawn(ChildSpec("w", lambda: Deferred(log, gate, seen)))
        await ref.ask("scope?")  # inline
        await ref.tell("scope?")  # a dispatcher
        await ref.tell("own-scope")
        await settle()
        gate.set()
        await settle()
        assert seen == [None, None]
        assert log == ["unblocked"]
        assert not Deferred._actor_scoped


async def test_a_kill_of_a_deferred_handler_lands_when_its_wait_ends() -> None:
    gate = anyio.Event()
    log: list[Any] = []
    async with ActorSystem(clock=ManualClock()) as system:
        ref = await system.spawn(ChildSpec("w", lambda: Deferred(log, gate)))
        await ref.tell("block")
        await settle()
        killed = False

        async def kill() -> None:
            nonlocal killed
            await system.kill("/w")
            killed = True

        async with anyio.create_task_group() as tg:
            tg.start_soon(kill)
            await settle()
            assert not killed  # its wait is still in hand: the kill waits for it
            gate.set()
        assert killed
        # `Killed` was thrown in at the resumption: the rest of the handler never ran.
        assert [entry[0] for entry in log] == ["interrupted"]
        await settle()
        assert ref.statistics().restarts == 1


async def test_a_kill_of_a_deferred_inline_ask_fails_the_asker_with_actor_dead() -> None:
    gate = anyio.Event()
    log: list[Any] = []
    outcome: list[BaseException] = []
    async with ActorSystem(clock=ManualClock()) as system:
        ref = await system.spawn(ChildSpec("w", lambda: Deferred(log, gate)))

        async def ask() -> None:
            try:
                await ref.ask("block")  # inline: the handler runs in this task
            except ActorDead as exc:
                outcome.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(ask)
            await settle()
            tg.start_soon(system.kill, "/w")
            await settle()
            assert outcome == []
            gate.set()
        assert len(outcome) == 1 and isinstance(outcome[0].__cause__, ActorKilled)
        assert [entry[0] for entry in log] == ["interrupted"]


async def test_the_askers_cancellation_still_reaches_a_deferred_inline_handler() -> None:
    gate = anyio.Event()
    log: list[Any] = []
    async with ActorSystem(clock=ManualClock()) as system:
        ref = await system.spawn(ChildSpec("w", lambda: Deferred(log, gate)))
        with anyio.move_on_after(0.01):
            await ref.ask("block")
        assert [entry[0] for entry in log] == ["interrupted"]
        await settle()
        assert ref.statistics().restarts == 1  # restarted from scratch, like after a kill


async def test_a_kill_during_a_deferred_on_start_fails_the_start() -> None:
    gate = anyio.Event()
    log: list[Any] = []
    outcome: list[BaseException] = []
    async with ActorSystem(clock=ManualClock()) as system:

        async def start() -> None:
            try:
                await system.spawn(ChildSpec("w", lambda: DeferredStart(log, gate)))
            except StartFailed as exc:
                outcome.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(start)
            await settle()
            assert log == ["starting"]
            tg.start_soon(system.kill, "/w")
            await settle()
            assert outcome == []
            gate.set()
        assert log == ["starting"]  # killed at its resumption: "started" never ran
        assert len(outcome) == 1


@pytest.mark.parametrize("message", ["hello", "own-scope"])
async def test_a_deferred_actor_answers_like_any_other(message: str) -> None:
    gate = anyio.Event()
    gate.set()
    log: list[Any] = []
    async with ActorSystem(clock=ManualClock()) as system:
        ref = await system.spawn(ChildSpec("w", lambda: Deferred(log, gate)))
        await ref.ask(message)
        assert len(log) == 1
