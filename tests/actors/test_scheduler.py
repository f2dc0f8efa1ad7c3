"""Light actors: inline asks, the dispatcher pool, kills of running handlers, fairness, GC."""

from __future__ import annotations

import gc
import weakref
from typing import Any, ClassVar

import anyio
import anyio.lowlevel
import pytest

from stepd.actors import (
    Actor,
    ActorDead,
    ActorKilled,
    ActorSystem,
    ChildSpec,
    ManualClock,
    Restart,
    Supervisor,
    SupervisorRef,
)
from stepd.actors._scheduler import KEEP_IDLE

from ._helpers import settle


class Where(Actor):
    """Records which task ran each handler; waits on a gate for "block"."""

    def __init__(self, log: list[Any], gate: anyio.Event | None = None) -> None:
        self.log = log
        self.gate = gate

    async def receive(self, message: Any) -> Any:
        task = anyio.get_current_task().id
        if message == "block":
            assert self.gate is not None
            try:
                await self.gate.wait()
            except BaseException:
                self.log.append(("interrupted", task))
                raise
            self.log.append(("unblocked", task))
            return task
        self.log.append((message, task))
        return task


async def test_an_ask_to_an_idle_actor_runs_in_the_callers_task_with_no_dispatcher() -> None:
    log: list[Any] = []
    async with ActorSystem(clock=ManualClock()) as system:
        ref = await system.spawn(ChildSpec("w", lambda: Where(log)))
        me = anyio.get_current_task().id
        for _ in range(100):
            assert await ref.ask("hi") == me
        assert system._sched.started == 0  # no task was started for any of it


async def test_messages_arriving_during_an_inline_handler_go_to_a_dispatcher() -> None:
    log: list[Any] = []
    gate = anyio.Event()
    async with ActorSystem(clock=ManualClock()) as system:
        ref = await system.spawn(ChildSpec("w", lambda: Where(log, gate)))
        asker: list[int] = []

        async def ask_block() -> None:
            asker.append(anyio.get_current_task().id)
            await ref.ask("block")

        async with anyio.create_task_group() as tg:
            tg.start_soon(ask_block)
            await settle()
            await ref.tell("told")  # the actor is busy: queued
            await settle()
            assert log == []  # one handler at a time
            gate.set()
        await settle()
        assert log[0] == ("unblocked", asker[0])
        assert log[1][0] == "told" and log[1][1] != asker[0]  # not the asker's task
        assert system._sched.started >= 1


class Logged(Where):
    async def on_start(self) -> None:
        self.log.append(("start", self.restart_reason))


async def test_cancelling_an_inline_ask_restarts_the_actor_without_counting_it() -> None:
    log: list[Any] = []
    gate = anyio.Event()
    sup = ChildSpec("sup", lambda: Supervisor([ChildSpec("w", lambda: Logged(log, gate))],
                                              intensity=0, period=60.0))
    async with ActorSystem(clock=ManualClock(), root=Supervisor([sup], intensity=0)) as system:
        ref = system.resolve("/sup/w")
        with anyio.move_on_after(0.01) as scope:
            await ref.ask("block")
        assert scope.cancelled_caught  # the cancellation went on in the caller
        await settle()
        assert [entry[0] for entry in log] == ["start", "interrupted", "start"]
        reason = log[2][1]
        assert isinstance(reason, ActorKilled) and reason.detail is not None
        assert system.statistics("/sup/w").restarts == 1
        assert system.statistics("/sup").restarts == 0  # intensity 0, yet no escalation
        gate.set()
        assert await ref.ask("after") is not None


async def test_killing_an_actor_interrupts_its_running_handler_where_it_stands() -> None:
    log: list[Any] = []
    gate = anyio.Event()
    async with ActorSystem(clock=ManualClock()) as system:
        ref = await system.spawn(
            ChildSpec("w", lambda: Where(log, gate), restart=Restart.TEMPORARY))
        await ref.tell("block")  # run by a dispatcher
        await settle()
        await system.kill("/w")
        assert [entry[0] for entry in log] == ["interrupted"]
        gate.set()
        await settle()
        assert [entry[0] for entry in log] == ["interrupted"]  # never resumed


async def test_killing_an_actor_whose_handler_runs_inline_fails_the_asker() -> None:
    log: list[Any] = []
    gate = anyio.Event()
    outcome: list[BaseException] = []
    async with ActorSystem(clock=ManualClock()) as system:
        ref = await system.spawn(ChildSpec("w", lambda: Where(log, gate)))

        async def ask_block() -> None:
            try:
                await ref.ask("block")
            except ActorDead as exc:
                outcome.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(ask_block)
            await settle()
            await system.kill("/w")
        assert isinstance(outcome[0].__cause__, ActorKilled)
        assert [entry[0] for entry in log] == ["interrupted"]
        await settle()
        assert ref.statistics().restarts == 1


class ScopedWait(Where):
    """Suspends inside a cancel scope it opened itself (a timeout)."""

    async def receive(self, message: Any) -> Any:
        if message == "block":
            assert self.gate is not None
            with anyio.move_on_after(3600):
                await self.gate.wait()
            self.log.append("unblocked")
        return None


async def test_a_handler_waiting_in_its_own_scope_is_killed_once_it_resumes_then_at_once() -> None:
    gate = anyio.Event()
    log: list[Any] = []
    ScopedWait._actor_scoped = False  # learned per process: start from scratch
    async with ActorSystem(clock=ManualClock()) as system:
        ref = await system.spawn(ChildSpec("w", lambda: ScopedWait(log, gate)))
        await ref.tell("block")
        await settle()
        assert ScopedWait._actor_scoped  # learned: its next handlers get a scope first
        async with anyio.create_task_group() as tg:
            tg.start_soon(system.kill, "/w")
            await settle()
            gate.set()  # the first time, the kill lands when the handler resumes
        assert log == []
        await settle()
        gate2 = anyio.Event()
        ref2 = await system.spawn(ChildSpec("w2", lambda: ScopedWait(log, gate2)))
        await ref2.tell("block")
        await settle()
        with anyio.fail_after(5):
            await system.kill("/w2")  # now at once, gate or no gate
        assert log == []


async def test_the_dispatcher_pool_grows_with_waiting_handlers_and_parks_when_idle() -> None:
    gate = anyio.Event()
    log: list[Any] = []
    n = KEEP_IDLE * 3
    async with ActorSystem(clock=ManualClock()) as system:
        sched = system._sched
        refs = [await system.spawn(ChildSpec(f"w{i}", lambda: Where(log, gate)))
                for i in range(n)]
        for ref in refs:
            await ref.tell("block")
        await settle()
        assert sched.count == n  # one per waiting handler
        assert sched.awake == 0 and not sched.ready
        gate.set()
        await settle()
        assert len(log) == n
        assert sched.count == KEEP_IDLE == len(sched.idle)  # the rest ended
        for ref in refs:
            await ref.tell("again")
        await settle()
        assert len(log) == 2 * n
        assert sched.peak == n


async def test_a_bounded_pool_queues_ready_actors_until_a_dispatcher_returns() -> None:
    gate = anyio.Event()
    log: list[Any] = []
    async with ActorSystem(clock=ManualClock(), max_dispatchers=2) as system:
        refs = [await system.spawn(ChildSpec(f"w{i}", lambda: Where(log, gate)))
                for i in range(4)]
        for ref in refs:
            await ref.tell("block")
        await settle()
        assert system._sched.count == 2
        assert len(system._sched.ready) == 2
        gate.set()
        await settle()
        assert len(log) == 4
    with pytest.raises(ValueError, match="max_dispatchers"):
        ActorSystem(max_dispatchers=0)


class Chatty(Actor):
    """Tells itself again and again (up to `limit`), logging each turn."""

    def __init__(self, log: list[str], limit: int) -> None:
        self.log = log
        self.limit = limit
        self.n = 0

    async def receive(self, message: Any) -> Any:
        self.n += 1
        if message == "go" and self.n < self.limit:
            self.ref.tell_nowait("go")
        if message != "go" or self.n == self.limit:
            self.log.append(f"{message} {self.n}")


async def test_an_actor_that_keeps_itself_busy_does_not_starve_others() -> None:
    log: list[str] = []
    async with ActorSystem(clock=ManualClock()) as system:
        chatty = await system.spawn(ChildSpec("chatty", lambda: Chatty(log, 10_000)))
        other = await system.spawn(ChildSpec("other", lambda: Chatty(log, 1)))
        await chatty.tell("go")  # chatty is first in the ready queue...
        await other.tell("hello")  # ...other right behind it
        with anyio.fail_after(10):
            while len(log) < 2:
                await anyio.lowlevel.checkpoint()
        assert log[0] == "hello 1", log  # served long before chatty's 10,000th turn
        assert log[1] == "go 10000"


class Selfish(Actor):
    async def receive(self, message: Any) -> Any:
        if message == "self":
            return await self.ref.ask("inner", timeout=0.01)
        if isinstance(message, tuple):
            return await message[1].ask(("back", self.ref), timeout=0.01)
        return "ok"


async def test_asking_oneself_or_in_a_cycle_times_out_rather_than_hanging() -> None:
    async with ActorSystem(clock=ManualClock()) as system:
        a = await system.spawn(ChildSpec("a", Selfish, restart=Restart.TEMPORARY))
        with pytest.raises(ActorDead) as excinfo:
            await a.ask("self")
        assert isinstance(excinfo.value.__cause__, TimeoutError)
        b = await system.spawn(ChildSpec("b", Selfish))
        c = await system.spawn(ChildSpec("c", Selfish))
        with pytest.raises(ActorDead):
            await b.ask(("to", c))  # b asks c, which asks b back: b is busy


async def test_short_lived_actors_leave_no_cycles_behind() -> None:
    made: list[weakref.ref[Actor]] = []

    class Short(Where):
        def __init__(self) -> None:
            super().__init__([])
            made.append(weakref.ref(self))

    async with ActorSystem(clock=ManualClock()) as system:
        sup = await system.spawn(ChildSpec("sup", Supervisor))
        assert isinstance(sup, SupervisorRef)
        gc.collect()
        gc.disable()
        try:
            for i in range(50):
                ref = sup.start_child_nowait(ChildSpec(f"s{i}", Short, restart=Restart.TEMPORARY))
                assert await ref.ask("inline") is not None
                await ref.tell("told")  # a dispatcher's turn
                await settle()
                if i % 2:
                    await sup.stop_child(f"s{i}")
                else:
                    await ref.tell("x")
                    await settle()
                    await system.stop(ref.path)
            await settle()
            assert len(made) == 50
            # With the collector off, only a cycle (or a stray reference) keeps an actor:
            # name what holds one. (The loop guard once did, through a held stack frame:
            # tests/_loopguard.py.)
            alive = [r for r in made if r() is not None]
            holders = [sorted({type(h).__name__ for h in gc.get_referrers(r())}) for r in alive]
            assert alive == [], f"still reachable without the collector, held by {holders}"
        finally:
            gc.enable()


class FailsToStart(Actor):
    attempts: ClassVar[list[int]] = []

    async def on_start(self) -> None:
        FailsToStart.attempts.append(1)
        if len(FailsToStart.attempts) == 1:
            raise RuntimeError("first start fails")

    async def receive(self, message: Any) -> Any:
        return message


async def test_a_failing_nowait_start_is_a_crash_of_the_child_and_it_restarts() -> None:
    FailsToStart.attempts = []
    async with ActorSystem(clock=ManualClock()) as system:
        ref = system.root.start_child_nowait(ChildSpec("f", FailsToStart))
        await settle()
        assert len(FailsToStart.attempts) == 2
        assert ref.statistics().restarts == 1
        assert await ref.ask("ok") == "ok"


async def test_a_cancelled_start_child_leaves_nothing_behind() -> None:
    gate = anyio.Event()

    class Slow(Actor):
        async def on_start(self) -> None:
            await gate.wait()

    async with ActorSystem(clock=ManualClock()) as system:
        with anyio.move_on_after(0.01) as scope:
            await system.spawn(ChildSpec("slow", Slow))
        assert scope.cancelled_caught
        assert [n.path for n in system.tree().walk()] == ["/"]
        assert system.find("/slow") is None


async def test_spawning_and_stopping_an_actor_without_hooks_starts_no_task() -> None:
    async with ActorSystem(clock=ManualClock()) as system:
        for i in range(10):
            ref = await system.spawn(ChildSpec(f"w{i}", lambda: Where([])))
            assert await ref.ask("x") is not None
            await system.stop(ref.path)
        assert system._sched.started == 0
