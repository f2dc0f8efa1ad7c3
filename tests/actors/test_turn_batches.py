"""A dispatcher's turn over a batch of told messages (`_turn._runner`); the shared empties.

Past its first `RUNNER_AFTER` items, with more messages queued, a turn runs
the handlers inside one live generator instead of stepping each by hand. What holds for a lone message must hold there too: order, a handler
that waits (the runner is detached and driven to the handler's end, then a
fresh one serves the rest), a crash (the messages behind it are dropped with
the incarnation), a kill of a waiting handler.
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from stepd.actors import (
    Actor,
    ActorKilled,
    ActorSystem,
    ChildSpec,
    ManualClock,
    Restart,
    Supervisor,
    _turn,
)
from stepd.actors._turn import RUNNER_AFTER
from stepd.actors._types import NO_ITEMS, NO_TIMERS

from ._helpers import settle

BATCH = 3 * RUNNER_AFTER


class Batch(Actor):
    """Logs what it handles; waits on `gate` for "wait", raises for "boom"."""

    def __init__(self, log: list[Any], gate: anyio.Event) -> None:
        self.log = log
        self.gate = gate

    async def receive(self, message: Any) -> Any:
        if message == "wait":
            await self.gate.wait()
        elif message == "boom":
            raise RuntimeError("boom")
        self.log.append(message)
        return None


async def _tell_batch(system: ActorSystem, messages: list[Any]) -> None:
    """Queue `messages` before any is handled (`tell_nowait` never yields)."""
    ref = system.resolve("/b")
    for message in messages:
        ref.tell_nowait(message)


async def test_a_batch_is_handled_in_order_by_one_turn_through_one_runner(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    runners: list[object] = []
    make = _turn._runner

    def counted(detached: list[bool]) -> Any:
        runners.append(detached)
        return make(detached)

    monkeypatch.setattr(_turn, "_runner", counted)
    log: list[Any] = []
    async with ActorSystem(clock=ManualClock()) as system:
        await system.spawn(ChildSpec("b", lambda: Batch(log, anyio.Event())))
        await _tell_batch(system, list(range(BATCH)))
        assert log == []
        await settle()
        assert log == list(range(BATCH))
        assert system._sched.started == 1  # one dispatcher served the batch
        assert len(runners) == 1
        await _tell_batch(system, ["lone"])  # a lone message: stepped by hand
        await settle()
        assert log[-1] == "lone"
        assert len(runners) == 1


async def test_a_handler_that_waits_inside_a_batch_is_finished_then_the_rest_follows() -> None:
    log: list[Any] = []
    gate = anyio.Event()
    async with ActorSystem(clock=ManualClock()) as system:
        ref = await system.spawn(ChildSpec("b", lambda: Batch(log, gate)))
        # "wait" comes past the first few: inside a runner.
        messages: list[Any] = [*range(2 * RUNNER_AFTER), "wait", *range(100, 100 + BATCH)]
        await _tell_batch(system, messages)
        await settle()
        assert log == list(range(2 * RUNNER_AFTER))  # the one in hand waits: nothing overtakes it
        gate.set()
        await settle()
        assert log == [*range(2 * RUNNER_AFTER), "wait", *range(100, 100 + BATCH)]
        assert ref.statistics().restarts == 0
        assert ref.statistics().mailbox_depth == 0


async def test_a_crash_inside_a_batch_drops_the_messages_behind_it_and_restarts() -> None:
    log: list[Any] = []
    async with ActorSystem(clock=ManualClock()) as system:
        ref = await system.spawn(ChildSpec("b", lambda: Batch(log, anyio.Event())))
        await _tell_batch(system, [*range(2 * RUNNER_AFTER), "boom", *range(100, 100 + BATCH)])
        await settle()
        assert log == list(range(2 * RUNNER_AFTER))  # those behind the crash died with it
        assert ref.statistics().restarts == 1
        await _tell_batch(system, list(range(200, 200 + BATCH)))
        await settle()
        assert log == [*range(2 * RUNNER_AFTER), *range(200, 200 + BATCH)]


async def test_a_kill_of_a_handler_waiting_inside_a_batch_interrupts_it() -> None:
    log: list[Any] = []
    gate = anyio.Event()  # never set: only the kill ends the wait
    reasons: list[BaseException | None] = []

    class Remembering(Batch):
        async def on_start(self) -> None:
            reasons.append(self.restart_reason)

    async with ActorSystem(clock=ManualClock()) as system:
        ref = await system.spawn(ChildSpec("b", lambda: Remembering(log, gate)))
        await _tell_batch(system, [*range(2 * RUNNER_AFTER), "wait", *range(100, 100 + BATCH)])
        await settle()
        assert log == list(range(2 * RUNNER_AFTER))
        await system.kill("/b")
        await settle()
        assert ref.statistics().restarts == 1
        assert isinstance(reasons[-1], ActorKilled)
        assert log == list(range(2 * RUNNER_AFTER))  # the waiting one and those behind it died
        await ref.tell("after")
        await settle()
        assert log[-1] == "after"


class Timed(Actor):
    async def on_start(self) -> None:
        self.arm_timer("t", self.clock.now() + 1.0, "fired")

    async def receive(self, message: Any) -> Any:
        return message


async def test_the_shared_empty_mailbox_system_queue_and_timers_stay_empty() -> None:
    """A fresh incarnation's first message, ask, timer or child exit gets its own container."""
    clock = ManualClock()
    async with ActorSystem(clock=clock) as system:
        log: list[Any] = []
        ref = await system.spawn(ChildSpec("b", lambda: Batch(log, anyio.Event())))
        ref.tell_nowait("first")  # a tell to a fresh incarnation
        other = await system.spawn(ChildSpec("o", lambda: Batch(log, anyio.Event())))
        assert await other.ask("asked", timeout=5.0) is None  # an ask through the mailbox
        timed = await system.spawn(ChildSpec("t", Timed))
        sup = await system.spawn(ChildSpec("s", Supervisor))
        await system.supervisor(sup.path).start_child(
            ChildSpec("c", lambda: Batch(log, anyio.Event()), restart=Restart.PERMANENT))
        await system.kill("/s/c")  # a child's exit on a fresh supervisor's system queue
        clock.advance(1.0)
        await settle()
        assert log == ["first", "asked"]
        assert timed.statistics().timers == 0
        assert system.resolve("/s/c").statistics().restarts == 1
        assert not NO_ITEMS
        assert not NO_TIMERS
