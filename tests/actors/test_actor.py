"""Actors and refs: ask/tell, bounded mailboxes, and nobody hanging on the dead."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from stepd.actors import (
    Actor,
    ActorDead,
    ActorKilled,
    ActorNotFound,
    ActorRef,
    ActorSystem,
    ChildSpec,
    ManualClock,
    Restart,
    StartFailed,
    WouldBlock,
)

from ._helpers import Block, Boom, Echo, Rec, Rejected, lines, rec, settle


class SmallMailbox(Rec):
    mailbox_size = 2


async def test_ask_gets_the_reply_and_tells_are_handled_in_order() -> None:
    log: list[str] = []
    async with ActorSystem(clock=ManualClock()) as system:
        ref = await system.spawn(ChildSpec("a", rec("a", log)))
        assert await ref.ask(Echo("hi")) == "hi"
        for i in range(5):
            await ref.tell(i)
        ref.tell_nowait(5)
        assert await ref.ask(Echo("after")) == "after"  # handled after the tells
        assert lines(log, "got") == [f"got a {i}" for i in range(6)]


async def test_a_full_mailbox_makes_tell_wait_and_tell_nowait_raise() -> None:
    log: list[str] = []
    gate = anyio.Event()
    async with ActorSystem(clock=ManualClock()) as system:
        ref = await system.spawn(ChildSpec("a", lambda: SmallMailbox("a", log, gate=gate)))
        await ref.tell(Block("first"))  # taken out of the mailbox; the actor waits
        await settle()
        await ref.tell(1)
        await ref.tell(2)
        assert ref.statistics().mailbox_depth == 2
        with pytest.raises(WouldBlock):
            ref.tell_nowait(3)

        told = anyio.Event()

        async def blocked_teller() -> None:
            await ref.tell(3)
            told.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(blocked_teller)
            await settle()
            assert not told.is_set(), "tell returned although the mailbox was full"
            gate.set()  # the actor drains its mailbox: room for the blocked tell
            await told.wait()
        assert await ref.ask(Echo("done")) == "done"
        assert lines(log, "got") == ["got a 1", "got a 2", "got a 3"]


async def test_ask_timeout_raises_timeout_error() -> None:
    log: list[str] = []
    gate = anyio.Event()
    async with ActorSystem(clock=ManualClock()) as system:
        ref = await system.spawn(ChildSpec("a", rec("a", log, gate=gate)))
        with pytest.raises(TimeoutError):
            await ref.ask(Block(), timeout=0.002)  # two real milliseconds
        gate.set()
        assert await ref.ask(Echo(1), timeout=5.0) == 1  # the late reply was dropped


async def _ask_into(results: dict[str, Any], tag: str, ref: ActorRef, message: object) -> None:
    try:
        results[tag] = await ref.ask(message)
    except ActorDead as exc:
        results[tag] = exc


async def test_in_flight_and_queued_asks_fail_when_the_actor_is_killed() -> None:
    log: list[str] = []
    gate = anyio.Event()
    results: dict[str, Any] = {}
    async with ActorSystem(clock=ManualClock()) as system:
        ref = await system.spawn(
            ChildSpec("a", rec("a", log, gate=gate), restart=Restart.TEMPORARY)
        )
        async with anyio.create_task_group() as tg:
            tg.start_soon(_ask_into, results, "in-flight", ref, Block())
            await settle()
            tg.start_soon(_ask_into, results, "queued-1", ref, Echo(1))
            tg.start_soon(_ask_into, results, "queued-2", ref, Echo(2))
            await settle()
            assert ref.statistics().mailbox_depth == 2
            await system.kill("/a")
    assert set(results) == {"in-flight", "queued-1", "queued-2"}
    for tag, outcome in results.items():
        assert isinstance(outcome, ActorDead), tag
        assert isinstance(outcome.reason, ActorKilled)
        assert outcome.path == "/a"
    assert "stop a" not in " ".join(log), "a kill must not run on_stop"


async def test_an_ask_whose_handler_crashes_fails_with_the_crash_as_cause() -> None:
    log: list[str] = []
    async with ActorSystem(clock=ManualClock()) as system:
        ref = await system.spawn(ChildSpec("a", rec("a", log)))
        with pytest.raises(ActorDead) as excinfo:
            await ref.ask("crash")
        assert isinstance(excinfo.value.__cause__, Boom)
        assert isinstance(excinfo.value.reason, Boom)
        await settle()
        assert await ref.ask(Echo("restarted")) == "restarted"  # permanent: back again


async def test_asks_and_tells_after_death_fail_fast() -> None:
    log: list[str] = []
    async with ActorSystem(clock=ManualClock()) as system:
        ref = await system.spawn(ChildSpec("a", rec("a", log), restart=Restart.TEMPORARY))
        await ref.tell("crash")
        await settle()
        assert not ref.alive
        with pytest.raises(ActorDead):
            await ref.ask(Echo(1))
        with pytest.raises(ActorDead):
            await ref.tell(1)
        with pytest.raises(ActorDead):
            ref.tell_nowait(1)
        with pytest.raises(ActorNotFound):
            system.resolve("/a")


async def test_senders_waiting_for_room_fail_when_the_actor_dies() -> None:
    log: list[str] = []
    gate = anyio.Event()
    results: dict[str, Any] = {}
    told: list[object] = []
    async with ActorSystem(clock=ManualClock()) as system:
        ref = await system.spawn(
            ChildSpec("a", lambda: SmallMailbox("a", log, gate=gate), restart=Restart.TEMPORARY)
        )
        await ref.tell(Block())
        await settle()
        await ref.tell(1)
        await ref.tell(2)  # now full

        async def teller() -> None:
            try:
                await ref.tell(3)
                told.append("queued")  # accepted just before the actor died: dropped
            except ActorDead as exc:
                told.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(_ask_into, results, "waiting-ask", ref, Echo(1))
            tg.start_soon(teller)
            await settle()
            await system.kill("/a")
    assert isinstance(results["waiting-ask"], ActorDead)
    assert len(told) == 1  # it returned, one way or the other: nobody hangs


async def test_queued_asks_fail_when_the_actor_stops_normally() -> None:
    log: list[str] = []
    gate = anyio.Event()
    results: dict[str, Any] = {}
    async with ActorSystem(clock=ManualClock()) as system:
        ref = await system.spawn(
            ChildSpec("a", rec("a", log, gate=gate), restart=Restart.TRANSIENT)
        )
        async with anyio.create_task_group() as tg:
            tg.start_soon(_ask_into, results, "blocker", ref, Block())
            await settle()
            tg.start_soon(_ask_into, results, "stop", ref, "stop")
            await settle()
            tg.start_soon(_ask_into, results, "queued", ref, Echo(1))
            await settle()
            gate.set()
        await settle()
        assert results["blocker"] == "unblocked"
        assert results["stop"] == "stopping"  # the stopping message itself is answered
        assert isinstance(results["queued"], ActorDead)
        assert results["queued"].reason is None  # a normal stop
        assert "stop a normal" in log
        with pytest.raises(ActorNotFound):  # transient + normal stop: not restarted
            system.resolve("/a")


async def test_reply_errors_go_to_the_caller_and_the_actor_lives_on() -> None:
    log: list[str] = []
    async with ActorSystem(clock=ManualClock()) as system:
        ref = await system.spawn(ChildSpec("a", rec("a", log)))
        with pytest.raises(Rejected):
            await ref.ask("reject")
        assert await ref.ask(Echo(1)) == 1
        assert ref.statistics().restarts == 0
        # The same error from a tell has nobody to go to: it is a crash.
        await ref.tell("reject")
        await settle()
        assert ref.statistics().restarts == 1
        assert "stop a Rejected" in log


async def test_on_stop_sees_the_reason_and_a_failing_on_stop_turns_a_stop_into_a_crash() -> None:
    class FailingStop(Rec):
        async def on_stop(self, reason: BaseException | None) -> None:
            await super().on_stop(reason)
            raise Boom("on_stop failed")

    log: list[str] = []
    async with ActorSystem(clock=ManualClock()) as system:
        ref = await system.spawn(
            ChildSpec("a", lambda: FailingStop("a", log), restart=Restart.TRANSIENT)
        )
        await ref.tell("stop")
        await settle()
        # A normal stop would not restart a transient child; the crash in
        # on_stop makes it abnormal, so it is restarted.
        assert ref.statistics().restarts == 1
        assert lines(log, "start") == ["start a", "started a", "start a", "started a"]


async def test_a_ref_reaches_the_current_incarnation_and_later_actors_at_its_path() -> None:
    log: list[str] = []
    async with ActorSystem(clock=ManualClock()) as system:
        ref = await system.spawn(ChildSpec("a", rec("a", log)))
        await system.kill("/a")
        await settle()
        assert await ref.ask(Echo("after restart")) == "after restart"
        await system.stop("/a")
        with pytest.raises(ActorDead):
            await ref.ask(Echo(1))
        await system.spawn(ChildSpec("a", rec("a2", log)))  # same path, new actor
        assert await ref.ask(Echo("new actor")) == "new actor"
        assert ref == system.resolve("/a")
        assert hash(ref) == hash(system.resolve("/a"))
        assert repr(ref) == "<ActorRef /a>"


async def test_messages_sent_while_on_start_runs_wait_in_the_mailbox() -> None:
    log: list[str] = []
    start_gate = anyio.Event()
    results: dict[str, Any] = {}
    started: list[ActorRef] = []
    async with ActorSystem(clock=ManualClock()) as system:

        async def start() -> None:
            started.append(await system.spawn(ChildSpec("a", rec("a", log, start_gate=start_gate))))

        async with anyio.create_task_group() as tg:
            tg.start_soon(start)
            await settle()
            assert log == ["start a"] and not started  # the handshake has not happened
            assert system.statistics("/a").state == "starting"
            tg.start_soon(_ask_into, results, "early", system.resolve("/a"), Echo("early"))
            await settle()
            assert "early" not in results
            start_gate.set()
        assert results["early"] == "early"
        assert started[0].statistics().state == "running"


async def test_the_factory_must_return_a_fresh_actor() -> None:
    log: list[str] = []
    shared = Rec("shared", log)
    async with ActorSystem(clock=ManualClock()) as system:
        ref = await system.spawn(ChildSpec("a", lambda: shared, restart=Restart.TRANSIENT))
        with pytest.raises(StartFailed) as excinfo:
            await system.spawn(ChildSpec("b", lambda: shared))
        assert isinstance(excinfo.value.__cause__, RuntimeError)
        assert "fresh" in str(excinfo.value.__cause__)
        with pytest.raises(StartFailed) as excinfo:
            await system.spawn(ChildSpec("c", lambda: "not an actor"))  # type: ignore[arg-type,return-value]
        assert isinstance(excinfo.value.__cause__, TypeError)
        assert await ref.ask(Echo(1)) == 1


async def test_a_bad_mailbox_size_fails_the_start() -> None:
    class Bad(Actor):
        mailbox_size = 0

    async with ActorSystem(clock=ManualClock()) as system:
        with pytest.raises(StartFailed) as excinfo:
            await system.spawn(ChildSpec("bad", Bad))
        assert "mailbox_size" in str(excinfo.value.__cause__)
        assert [n.path for n in system.tree().walk()] == ["/"]


def test_an_actor_that_was_never_started_says_so() -> None:
    actor = Rec("a", [])
    with pytest.raises(RuntimeError, match="not running"):
        _ = actor.path
    with pytest.raises(RuntimeError, match="not running"):
        actor.stop()
    assert repr(actor) == "<Rec not started>"


async def test_the_default_receive_crashes_on_any_message() -> None:
    class Mute(Actor):
        pass

    async with ActorSystem(clock=ManualClock()) as system:
        ref = await system.spawn(ChildSpec("m", Mute, restart=Restart.TEMPORARY))
        with pytest.raises(ActorDead) as excinfo:
            await ref.ask(1)
        assert isinstance(excinfo.value.__cause__, NotImplementedError)
