"""Actor timers on a ManualClock: exact virtual deadlines, re-arm, cancel, death."""

from __future__ import annotations

import functools
from typing import Any

import anyio
import pytest

from stepd.actors import Actor, ActorDead, ActorSystem, ChildSpec, ManualClock, Restart

from ._helpers import Block, Echo, lines, rec, settle


class Timed(Actor):
    """Arms a timer in on_start (deadline: 1 s after start) and logs deliveries."""

    def __init__(self, log: list[str], delay: float = 1.0) -> None:
        self.log = log
        self.delay = delay

    async def on_start(self) -> None:
        self.arm_timer("expiry", self.clock.now() + self.delay, "expired")

    async def receive(self, message: Any) -> Any:
        if message == "deadline?":
            return self.timer_deadline("expiry")
        self.log.append(f"{message} at {self.clock.now()}")
        return None


async def test_a_timer_fires_at_its_virtual_deadline_and_not_a_millisecond_before() -> None:
    clock = ManualClock()
    log: list[str] = []
    async with ActorSystem(clock=clock) as system:
        ref = await system.spawn(ChildSpec("t", lambda: Timed(log)))
        assert await ref.ask("deadline?") == 1.0
        assert ref.statistics().timers == 1
        clock.advance(0.999)
        await settle()
        assert log == []
        clock.advance(0.001)
        await settle()
        assert log == ["expired at 1.0"]
        assert ref.statistics().timers == 0
        assert await ref.ask("deadline?") is None
        clock.advance(10)
        await settle()
        assert log == ["expired at 1.0"]  # one-shot


async def test_rearming_a_key_replaces_the_timer() -> None:
    clock = ManualClock()
    log: list[str] = []
    async with ActorSystem(clock=clock) as system:
        ref = await system.spawn(ChildSpec("a", rec("a", log)))
        await ref.ask(("arm", "k", 1.0, "first"))
        await ref.ask(("arm", "k", 3.0, "second"))  # replaces: later
        clock.advance(2.0)
        await settle()
        assert lines(log, "got") == []
        clock.advance(1.0)
        await settle()
        assert lines(log, "got") == ["got a second"]
        await ref.ask(("arm", "k", 5.0, "third"))
        await ref.ask(("arm", "k", 0.5, "fourth"))  # replaces: earlier (wakes the service)
        clock.advance(0.5)
        await settle()
        assert lines(log, "got") == ["got a second", "got a fourth"]
        clock.advance(10.0)
        await settle()
        assert lines(log, "got") == ["got a second", "got a fourth"]


async def test_cancel_timer_means_it_never_delivers() -> None:
    clock = ManualClock()
    log: list[str] = []
    async with ActorSystem(clock=clock) as system:
        ref = await system.spawn(ChildSpec("a", rec("a", log)))
        await ref.ask(("arm", "k", 1.0, "ring"))
        assert await ref.ask(("cancel", "k")) is True
        assert await ref.ask(("cancel", "k")) is False
        clock.advance(5.0)
        await settle()
        assert lines(log, "got") == []


async def test_fired_timers_are_served_before_queued_messages() -> None:
    clock = ManualClock()
    log: list[str] = []
    gate = anyio.Event()
    async with ActorSystem(clock=clock) as system:
        ref = await system.spawn(ChildSpec("a", rec("a", log, gate=gate)))
        await ref.ask(("arm", "k", 1.0, "ring"))
        await ref.tell(Block())  # the actor is busy...
        await ref.tell("queued")  # ...with a message waiting behind it
        await settle()
        clock.advance(1.0)  # fires while the actor is busy
        await settle()
        gate.set()
        await settle()
        assert lines(log, "got") == ["got a ring", "got a queued"]


class CancelsWhileBusy(Actor):
    """Waits on a gate, then cancels timer "k": by then it has fired already."""

    def __init__(self, log: list[str], gate: anyio.Event) -> None:
        self.log = log
        self.gate = gate

    async def on_start(self) -> None:
        self.arm_timer("k", self.clock.now() + 1.0, "ring")

    async def receive(self, message: Any) -> Any:
        if message == "busy":
            await self.gate.wait()
            self.log.append(f"cancelled {self.cancel_timer('k')}")
        else:
            self.log.append(f"got {message}")


async def test_a_fired_but_undelivered_timer_can_still_be_cancelled() -> None:
    clock = ManualClock()
    log: list[str] = []
    gate = anyio.Event()
    async with ActorSystem(clock=clock) as system:
        ref = await system.spawn(ChildSpec("a", lambda: CancelsWhileBusy(log, gate)))
        await ref.tell("busy")
        await settle()
        clock.advance(1.0)  # fires; the delivery waits for the handler to finish
        await settle()
        gate.set()  # the handler cancels the timer, which has fired but not arrived
        await settle()
        clock.advance(5.0)
        await settle()
        assert log == ["cancelled True"]


async def test_timers_of_one_actor_deliver_in_deadline_order() -> None:
    clock = ManualClock()
    log: list[str] = []
    async with ActorSystem(clock=clock) as system:
        ref = await system.spawn(ChildSpec("a", rec("a", log)))
        for key, delay in [("c", 3.0), ("a", 1.0), ("b", 2.0), ("a2", 1.0)]:
            await ref.ask(("arm", key, delay, key))
        clock.advance(10.0)  # all due in one advance
        await settle()
        assert lines(log, "got") == ["got a a", "got a a2", "got a b", "got a c"]


async def test_a_past_deadline_fires_at_once() -> None:
    clock = ManualClock(100.0)
    log: list[str] = []
    async with ActorSystem(clock=clock) as system:
        ref = await system.spawn(ChildSpec("a", rec("a", log)))
        await ref.ask(("arm", "k", -5.0, "late"))
        await settle()
        assert lines(log, "got") == ["got a late"]


async def test_a_killed_actors_timer_never_delivers() -> None:
    clock = ManualClock()
    log: list[str] = []
    async with ActorSystem(clock=clock) as system:
        ref = await system.spawn(ChildSpec("a", rec("a", log)))
        await ref.ask(("arm", "k", 1.0, "ghost"))
        await system.kill("/a")
        await settle()
        assert ref.statistics().restarts == 1
        assert ref.statistics().timers == 0  # the new incarnation starts with none
        clock.advance(5.0)
        await settle()
        assert lines(log, "got") == []
        assert system._timers.live == 0


async def test_timers_die_with_a_crash_and_with_a_normal_stop() -> None:
    clock = ManualClock()
    log: list[str] = []
    async with ActorSystem(clock=clock) as system:
        a = await system.spawn(ChildSpec("a", rec("a", log), restart=Restart.TEMPORARY))
        b = await system.spawn(ChildSpec("b", rec("b", log)))
        await a.ask(("arm", "k", 1.0, "ghost-a"))
        await b.ask(("arm", "k", 1.0, "ghost-b"))
        await a.tell("stop")
        await b.tell("crash")
        await settle()
        clock.advance(5.0)
        await settle()
        assert lines(log, "got") == []


async def test_timers_fire_for_many_actors_from_one_service_task() -> None:
    clock = ManualClock()
    log: list[str] = []
    async with ActorSystem(clock=clock) as system:
        for i in range(50):
            await system.spawn(
                ChildSpec(f"t{i}", functools.partial(Timed, log, delay=1.0 + i / 100))
            )
        assert system._timers.live == 50
        # Spawning runs on_start in this task without a task switch: let the
        # timer service see its new heap head before asking the clock.
        await settle()
        assert clock.next_deadline() == 1.0  # one sleeper: the service
        clock.advance(0.255)  # nothing yet
        await settle()
        assert log == []
        clock.advance(0.75)  # now 1.005: of the deadlines 1.00, 1.01, ... only t0's is due
        await settle()
        assert len(log) == 1
        clock.advance(1.0)
        await settle()
        assert len(log) == 50
        assert system._timers.live == 0


async def test_arming_in_on_stop_is_refused() -> None:
    errors: list[BaseException] = []

    class ArmsLate(Actor):
        async def receive(self, message: Any) -> Any:
            return None

        async def on_stop(self, reason: BaseException | None) -> None:
            try:
                self.arm_timer("k", self.clock.now() + 1, "late")
            except ActorDead as exc:
                errors.append(exc)

    async with ActorSystem(clock=ManualClock()) as system:
        await system.spawn(ChildSpec("a", ArmsLate))
        await system.stop("/a")
    assert len(errors) == 1


async def test_a_nan_deadline_is_refused() -> None:
    class ArmsNaN(Actor):
        async def receive(self, message: Any) -> Any:
            self.arm_timer("k", float("nan"), "x")

    async with ActorSystem(clock=ManualClock()) as system:
        ref = await system.spawn(ChildSpec("a", ArmsNaN, restart=Restart.TEMPORARY))
        with pytest.raises(ActorDead) as excinfo:
            await ref.ask(Echo(1))
        assert isinstance(excinfo.value.__cause__, ValueError)


async def test_heavy_rearming_does_not_grow_the_heap_without_bound() -> None:
    clock = ManualClock()
    async with ActorSystem(clock=clock) as system:
        ref = await system.spawn(ChildSpec("a", rec("a", [])))
        for i in range(500):  # a heartbeat re-arming its expiry each time
            await ref.ask(("arm", "expiry", 30.0 + i, "expired"))
        assert system._timers.live == 1
        assert len(system._timers._heap) <= 130
