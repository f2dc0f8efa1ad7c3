"""`Actor.sync_handlers` and `Actor.sync_start`: work done in the caller's call, no turn."""

from __future__ import annotations

from typing import Any

import anyio

from stepd.actors import Actor, ActorDead, ActorSystem, ChildSpec, ManualClock, Restart

from ._helpers import Boom, settle


class Counter(Actor):
    """Synchronous handlers; ``"wait"`` breaks the promise, ``"crash"`` raises."""

    sync_handlers = True

    def __init__(self, log: list[Any]) -> None:
        self.log = log

    async def receive(self, message: Any) -> Any:
        if message == "wait":
            await anyio.lowlevel.checkpoint()
        if message == "crash":
            raise Boom
        if message == "tell-self":
            self.ref.tell_nowait("from-self")  # busy: queued, handled after this one
        self.log.append(message)
        return len(self.log)


async def test_a_tell_to_an_idle_sync_actor_is_handled_before_it_returns() -> None:
    log: list[Any] = []
    async with ActorSystem(clock=ManualClock()) as system:
        ref = await system.spawn(ChildSpec("c", lambda: Counter(log)))
        ref.tell_nowait("a")
        assert log == ["a"]
        await ref.tell("b")
        assert log == ["a", "b"]
        assert await ref.ask("c") == 3  # asks are as before (inline when idle)


async def test_a_sync_actor_with_work_queued_keeps_the_order() -> None:
    log: list[Any] = []
    async with ActorSystem(clock=ManualClock()) as system:
        ref = await system.spawn(ChildSpec("c", lambda: Counter(log)))
        ref.tell_nowait("tell-self")  # its own tell, sent while busy, waits in the mailbox
        assert log == ["tell-self"]
        ref.tell_nowait("after")  # queued behind "from-self", not ahead of it
        assert log == ["tell-self"]
        await settle()
        assert log == ["tell-self", "from-self", "after"]


async def test_a_sync_handler_that_raises_or_waits_is_a_crash_of_the_actor() -> None:
    log: list[Any] = []
    async with ActorSystem(clock=ManualClock()) as system:
        ref = await system.spawn(ChildSpec("c", lambda: Counter(log)))
        ref.tell_nowait("crash")  # the teller hears nothing: a tell
        await settle()
        assert ref.statistics().restarts == 1 and ref.alive
        ref.tell_nowait("wait")
        await settle()
        assert ref.statistics().restarts == 2 and ref.alive
        assert log == []
        ref.tell_nowait("x")
        assert log == ["x"]


class Starts(Actor):
    sync_start = True

    def __init__(self, log: list[Any], how: str) -> None:
        self.log = log
        self.how = how

    async def on_start(self) -> None:
        if self.how == "crash":
            self.how = "ok"
            raise Boom
        if self.how == "wait":
            self.how = "ok"
            await anyio.lowlevel.checkpoint()
        self.log.append("started")

    async def receive(self, message: Any) -> Any:
        self.log.append(message)
        return None


async def test_a_sync_start_runs_on_start_inside_start_child_nowait() -> None:
    log: list[Any] = []
    async with ActorSystem(clock=ManualClock()) as system:
        ref = system.root.start_child_nowait(ChildSpec("s", lambda: Starts(log, "ok")))
        assert log == ["started"] and ref.statistics().state == "running"
        ref.tell_nowait("m")
        await settle()
        assert log == ["started", "m"]


async def test_a_sync_start_that_fails_or_waits_is_a_crash_of_the_child() -> None:
    for how in ("crash", "wait"):
        log: list[Any] = []
        instances: list[Starts] = []

        def make(how: str = how, log: list[Any] = log,
                 instances: list[Starts] = instances) -> Starts:
            actor = Starts(log, how if not instances else "ok")
            instances.append(actor)
            return actor

        async with ActorSystem(clock=ManualClock()) as system:
            ref = system.root.start_child_nowait(
                ChildSpec("s", make, restart=Restart.PERMANENT))
            await settle()
            assert log == ["started"]  # the restart, from a fresh instance
            assert ref.statistics().restarts == 1 and len(instances) == 2


class Answers(Actor):
    """A plain actor (no class-wide promise); some of its handlers never wait."""

    reply_errors = (KeyError,)

    def __init__(self, log: list[Any], gate: anyio.Event) -> None:
        self.log = log
        self.gate = gate

    async def receive(self, message: Any) -> Any:
        if message == "block":
            await self.gate.wait()
        elif message == "wait":
            await anyio.lowlevel.checkpoint()
        elif message == "reject":
            raise KeyError(message)
        self.log.append(message)
        return len(self.log)


async def test_ask_now_answers_from_an_idle_actor_in_the_callers_call() -> None:
    log: list[Any] = []
    async with ActorSystem(clock=ManualClock()) as system:
        ref = await system.spawn(ChildSpec("a", lambda: Answers(log, anyio.Event())))
        assert ref.ask_now("x") == 1
        assert ref.ask_now("y") == 2
        try:
            ref.ask_now("reject")
        except KeyError:
            pass
        else:
            raise AssertionError("a reply error reaches the caller")
        assert ref.alive and ref.statistics().restarts == 0


async def test_ask_now_sends_nothing_to_a_busy_actor() -> None:
    log: list[Any] = []
    gate = anyio.Event()
    async with ActorSystem(clock=ManualClock()) as system:
        ref = await system.spawn(ChildSpec("a", lambda: Answers(log, gate)))
        await ref.tell("block")
        await settle()
        try:
            ref.ask_now("x")
        except anyio.WouldBlock:
            pass
        else:
            raise AssertionError("a busy actor is not asked now")
        ref.tell_nowait("queued")
        gate.set()
        await settle()
        try:
            ref.ask_now("x")  # idle again: answered
        except anyio.WouldBlock:
            raise AssertionError("idle again") from None
        assert log == ["block", "queued", "x"]


async def test_a_handler_that_waits_under_ask_now_is_a_crash() -> None:
    log: list[Any] = []
    async with ActorSystem(clock=ManualClock()) as system:
        ref = await system.spawn(ChildSpec("a", lambda: Answers(log, anyio.Event())))
        try:
            ref.ask_now("wait")
        except ActorDead as exc:
            assert isinstance(exc.__cause__, RuntimeError)
        else:
            raise AssertionError("a handler that waits is a crash")
        await settle()
        assert ref.alive and ref.statistics().restarts == 1
        assert ref.ask_now("x") == 1  # a fresh incarnation
