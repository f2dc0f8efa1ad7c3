"""Supervisors: strategies, restart types, intensity, handshakes, dynamic children."""

from __future__ import annotations

import functools
import logging
from typing import Any, ClassVar

import anyio
import pytest

from stepd.actors import (
    Actor,
    ActorDead,
    ActorNotFound,
    ActorSystem,
    ChildExists,
    ChildSpec,
    ManualClock,
    Restart,
    StartFailed,
    Strategy,
    Supervisor,
    SupervisorEscalation,
    SupervisorRef,
)

from ._helpers import Boom, Echo, Rec, lines, paths, rec, settle


def three(log: list[str]) -> list[ChildSpec]:
    return [ChildSpec(name, rec(name, log)) for name in ("a", "b", "c")]


@pytest.mark.parametrize(
    ("strategy", "expected", "restarts"),
    [
        (
            Strategy.ONE_FOR_ONE,
            ["stop b Boom", "start b", "started b"],
            {"a": 0, "b": 1, "c": 0},
        ),
        (
            Strategy.ONE_FOR_ALL,
            [
                "stop b Boom",
                "stop c normal",
                "stop a normal",
                "start a",
                "started a",
                "start b",
                "started b",
                "start c",
                "started c",
            ],
            {"a": 1, "b": 1, "c": 1},
        ),
        (
            Strategy.REST_FOR_ONE,
            ["stop b Boom", "stop c normal", "start b", "started b", "start c", "started c"],
            {"a": 0, "b": 1, "c": 1},
        ),
    ],
    ids=lambda v: v.value if isinstance(v, Strategy) else "",
)
async def test_strategies_restart_the_right_children_in_the_right_order(
    strategy: Strategy, expected: list[str], restarts: dict[str, int]
) -> None:
    log: list[str] = []
    async with ActorSystem(clock=ManualClock()) as system:
        await system.spawn(ChildSpec("sup", lambda: Supervisor(three(log), strategy=strategy)))
        log.clear()
        await system.resolve("/sup/b").tell("crash")
        await settle()
        assert log == expected
        for name, count in restarts.items():
            assert system.statistics(f"/sup/{name}").restarts == count
        assert system.statistics("/sup").restarts == 0
        assert paths(system) == ["/", "/sup", "/sup/a", "/sup/b", "/sup/c"]
        for name in ("a", "b", "c"):
            assert await system.resolve(f"/sup/{name}").ask(Echo(name)) == name


async def test_one_for_all_drops_temporary_siblings_instead_of_restarting_them() -> None:
    log: list[str] = []
    specs = [
        ChildSpec("a", rec("a", log)),
        ChildSpec("t", rec("t", log), restart=Restart.TEMPORARY),
        ChildSpec("c", rec("c", log)),
    ]
    async with ActorSystem(clock=ManualClock()) as system:
        await system.spawn(
            ChildSpec("sup", lambda: Supervisor(specs, strategy=Strategy.ONE_FOR_ALL))
        )
        log.clear()
        await system.resolve("/sup/c").tell("crash")
        await settle()
        assert log == [
            "stop c Boom",
            "stop t normal",
            "stop a normal",
            "start a",
            "started a",
            "start c",
            "started c",
        ]
        assert paths(system) == ["/", "/sup", "/sup/a", "/sup/c"]


class SlowStart(Rec):
    """on_start takes several event loop turns, to expose any overlap."""

    async def on_start(self) -> None:
        self.log.append(f"start {self.name}")
        for _ in range(5):
            await anyio.lowlevel.checkpoint()
        self.log.append(f"started {self.name}")


async def test_children_start_in_order_each_after_the_previous_handshake_and_stop_in_reverse() -> (
    None
):
    log: list[str] = []
    specs = [ChildSpec(n, functools.partial(SlowStart, n, log)) for n in ("a", "b", "c")]
    inner = ChildSpec(
        "inner",
        lambda: Supervisor(
            [ChildSpec(n, functools.partial(SlowStart, n, log)) for n in ("x", "y")]
        ),
    )
    root = Supervisor([*specs, inner])
    async with ActorSystem(clock=ManualClock(), root=root):
        log.append("entered")
    assert log == [
        "start a",
        "started a",
        "start b",
        "started b",
        "start c",
        "started c",
        "start x",
        "started x",
        "start y",
        "started y",
        "entered",
        "stop y normal",
        "stop x normal",
        "stop c normal",
        "stop b normal",
        "stop a normal",
    ]


async def test_a_static_child_that_fails_to_start_fails_its_supervisor_start() -> None:
    log: list[str] = []
    root = Supervisor(
        [
            ChildSpec("a", rec("a", log)),
            ChildSpec("b", rec("b", log, fail_start=True)),
            ChildSpec("c", rec("c", log)),
        ]
    )
    system = ActorSystem(clock=ManualClock(), root=root)
    with pytest.raises(StartFailed) as excinfo:
        async with system:
            pytest.fail("the system should not have started")  # pragma: no cover
    assert excinfo.value.path == "/"
    cause = excinfo.value.__cause__
    assert isinstance(cause, StartFailed) and cause.path == "/b"
    assert isinstance(cause.__cause__, Boom)
    # a was started and is stopped again; c never started; on_stop is not
    # called for b, which never finished starting.
    assert log == ["start a", "started a", "start b", "stop a normal"]
    assert system._registry == {}


async def test_a_nested_static_start_failure_fails_the_dynamic_start_of_its_supervisor() -> None:
    log: list[str] = []
    async with ActorSystem(clock=ManualClock()) as system:
        with pytest.raises(StartFailed) as excinfo:
            await system.spawn(
                ChildSpec(
                    "sup",
                    lambda: Supervisor(
                        [
                            ChildSpec("ok", rec("ok", log)),
                            ChildSpec("bad", rec("bad", log, fail_start=True)),
                        ]
                    ),
                )
            )
        assert excinfo.value.path == "/sup"
        assert log == ["start ok", "started ok", "start bad", "stop ok normal"]
        assert paths(system) == ["/"]
        assert set(system._registry) == {"/"}


async def test_dynamic_children_start_and_stop() -> None:
    log: list[str] = []
    async with ActorSystem(clock=ManualClock()) as system:
        assert isinstance(await system.spawn(ChildSpec("runs", Supervisor)), SupervisorRef)
        runs = system.supervisor("/runs")
        refs = [await runs.start_child(ChildSpec(f"r_{i}", rec(f"r_{i}", log))) for i in range(20)]
        assert [r.path for r in refs] == [f"/runs/r_{i}" for i in range(20)]
        assert [cid for cid, _ in runs.which_children()] == [f"r_{i}" for i in range(20)]
        assert await refs[7].ask(Echo(7)) == 7
        with pytest.raises(ChildExists) as exists:
            await runs.start_child(ChildSpec("r_3", rec("dup", log)))
        assert exists.value.path == "/runs/r_3"
        await runs.stop_child("r_7")
        assert "stop r_7 normal" in log
        with pytest.raises(ActorDead):
            await refs[7].ask(Echo(7))
        with pytest.raises(ActorNotFound):
            await runs.stop_child("r_7")
        assert len(runs.which_children()) == 19
        log.clear()
    # Leaving the system stops the dynamic children in reverse start order.
    assert lines(log, "stop") == [f"stop r_{i} normal" for i in reversed(range(20)) if i != 7]


async def test_a_dynamic_start_failure_raises_to_the_caller_and_leaves_nothing() -> None:
    log: list[str] = []
    async with ActorSystem(clock=ManualClock()) as system:
        await system.spawn(ChildSpec("runs", Supervisor))
        runs = system.supervisor("/runs")
        with pytest.raises(StartFailed) as excinfo:
            await runs.start_child(ChildSpec("r_1", rec("r_1", log, fail_start=True)))
        assert excinfo.value.path == "/runs/r_1"
        assert isinstance(excinfo.value.__cause__, Boom)
        assert runs.which_children() == []
        with pytest.raises(ActorNotFound):
            system.resolve("/runs/r_1")
        # The id is free again.
        ref = await runs.start_child(ChildSpec("r_1", rec("r_1", log)))
        assert await ref.ask(Echo(1)) == 1


async def test_start_child_returns_only_after_on_start_finished() -> None:
    log: list[str] = []
    gate = anyio.Event()
    done = anyio.Event()
    async with ActorSystem(clock=ManualClock()) as system:
        await system.spawn(ChildSpec("runs", Supervisor))
        runs = system.supervisor("/runs")

        async def start() -> None:
            await runs.start_child(ChildSpec("r", rec("r", log, start_gate=gate)))
            log.append("start_child returned")
            done.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(start)
            await settle()
            assert log == ["start r"]
            gate.set()
            await done.wait()
        assert log == ["start r", "started r", "start_child returned"]


async def test_killing_a_child_in_on_start_fails_its_start() -> None:
    log: list[str] = []
    gate = anyio.Event()
    outcome: list[BaseException] = []
    async with ActorSystem(clock=ManualClock()) as system:
        await system.spawn(ChildSpec("runs", Supervisor))
        runs = system.supervisor("/runs")

        async def start() -> None:
            try:
                await runs.start_child(ChildSpec("r", rec("r", log, start_gate=gate)))
            except StartFailed as exc:
                outcome.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(start)
            await settle()
            await system.kill("/runs/r")
        assert len(outcome) == 1
        assert type(outcome[0].__cause__).__name__ == "ActorKilled"
        assert runs.which_children() == []


@pytest.mark.parametrize(
    ("restart", "after_kill", "after_normal_stop"),
    [
        (Restart.PERMANENT, True, True),
        (Restart.TRANSIENT, True, False),
        (Restart.TEMPORARY, False, False),
    ],
    ids=lambda v: v.value if isinstance(v, Restart) else "",
)
async def test_restart_types_after_kill_crash_and_normal_stop(
    restart: Restart, after_kill: bool, after_normal_stop: bool
) -> None:
    log: list[str] = []
    async with ActorSystem(clock=ManualClock()) as system:
        # After a kill.
        ref = await system.spawn(ChildSpec("k", rec("k", log), restart=restart))
        await system.kill("/k")
        await settle()
        assert ref.alive is after_kill
        if after_kill:
            assert ref.statistics().restarts == 1
            assert await ref.ask(Echo("back")) == "back"
        # After a crash: the same verdict as a kill.
        ref = await system.spawn(ChildSpec("c", rec("c", log), restart=restart))
        await ref.tell("crash")
        await settle()
        assert ref.alive is after_kill
        # After a normal stop.
        ref = await system.spawn(ChildSpec("n", rec("n", log), restart=restart))
        await ref.tell("stop")
        await settle()
        assert ref.alive is after_normal_stop
        assert "stop n normal" in log
        if not after_normal_stop:
            with pytest.raises(ActorNotFound):
                system.resolve("/n")


async def test_a_child_crashing_too_often_escalates_to_the_parent_which_restarts_it() -> None:
    clock = ManualClock()
    log: list[str] = []
    inner = ChildSpec(
        "inner", lambda: Supervisor([ChildSpec("w", rec("w", log))], intensity=2, period=5.0)
    )
    root = Supervisor([ChildSpec("other", rec("other", log)), inner], intensity=1, period=5.0)
    with pytest.RaisesGroup(SupervisorEscalation) as excinfo:
        async with ActorSystem(clock=clock, root=root) as system:
            w = system.resolve("/inner/w")
            for expected in (1, 2):
                await w.tell("crash")
                await settle()
                assert system.statistics("/inner/w").restarts == expected
            log.clear()
            await w.tell("crash")  # the third in 5 s: more than 2
            await settle()
            # inner gave up; root restarted it, which started a fresh w.
            assert log == ["stop w Boom", "start w", "started w"]
            assert system.statistics("/inner").restarts == 1
            assert system.statistics("/inner/w").restarts == 0
            assert system.statistics("/other").restarts == 0
            # The same again: now root sees a second restart in 5 s: more than 1.
            log.clear()
            for _ in range(3):
                await w.tell("crash")
                await settle()
            pytest.fail("the root supervisor should have given up")  # pragma: no cover
    root_failure = excinfo.value.exceptions[0]
    assert isinstance(root_failure, SupervisorEscalation)
    assert root_failure.path == "/"
    inner_failure = root_failure.__cause__
    assert isinstance(inner_failure, SupervisorEscalation) and inner_failure.path == "/inner"
    assert isinstance(inner_failure.__cause__, Boom)
    # The root stopped its remaining children in reverse order before giving up.
    assert log[-1] == "stop other normal"


async def test_restarts_spread_wider_than_the_period_do_not_escalate() -> None:
    clock = ManualClock()
    log: list[str] = []
    async with ActorSystem(clock=clock) as system:
        await system.spawn(
            ChildSpec(
                "sup", lambda: Supervisor([ChildSpec("w", rec("w", log))], intensity=1, period=5.0)
            )
        )
        w = system.resolve("/sup/w")
        for _ in range(4):
            await w.tell("crash")
            await settle()
            clock.advance(5.001)
        assert system.statistics("/sup/w").restarts == 4
        assert system.statistics("/sup").restarts == 0


async def test_a_child_that_cannot_restart_escalates_instead_of_looping() -> None:
    log: list[str] = []
    made: list[int] = []

    def factory() -> Rec:
        made.append(1)
        return Rec("w", log, fail_start=len(made) > 1)

    async with ActorSystem(clock=ManualClock()) as system:
        await system.spawn(
            ChildSpec(
                "sup",
                lambda: Supervisor([ChildSpec("w", factory)], intensity=2, period=5.0),
                restart=Restart.TEMPORARY,
            )
        )
        await system.resolve("/sup/w").tell("crash")
        await settle()
        # Restart 1 failed, restart 2 failed, restart 3 is one too many.
        assert len(made) == 3
        assert paths(system) == ["/"]  # sup escalated; temporary, so root let it go


async def test_killing_a_supervisor_kills_its_subtree_and_its_parent_restarts_it() -> None:
    log: list[str] = []
    async with ActorSystem(clock=ManualClock()) as system:
        sup = await system.spawn(
            ChildSpec(
                "sup",
                lambda: Supervisor(
                    [
                        ChildSpec("a", rec("a", log)),
                        ChildSpec("b", rec("b", log)),
                    ]
                ),
            )
        )
        assert isinstance(sup, SupervisorRef)
        dynamic = await sup.start_child(ChildSpec("d", rec("d", log)))
        a = system.resolve("/sup/a")
        log.clear()
        await system.kill("/sup")
        await settle()
        # Brutal: no on_stop in the subtree; the fresh supervisor starts its
        # static children again; the dynamic one is gone.
        assert log == ["start a", "started a", "start b", "started b"]
        assert paths(system) == ["/", "/sup", "/sup/a", "/sup/b"]
        assert system.statistics("/sup").restarts == 1
        assert await a.ask(Echo("a again")) == "a again"
        with pytest.raises(ActorDead):
            await dynamic.ask(Echo(1))


async def test_a_hanging_on_stop_is_cut_short_by_the_shutdown_timeout() -> None:
    log: list[str] = []
    async with ActorSystem(clock=ManualClock()) as system:
        await system.spawn(ChildSpec("h", rec("h", log, hang_on_stop=True), shutdown=0.003))
        await system.stop("/h")  # 3 real milliseconds, then cancelled
        assert log[-1] == "stop h normal"
        assert paths(system) == ["/"]


async def test_brutal_shutdown_skips_on_stop() -> None:
    log: list[str] = []
    async with ActorSystem(clock=ManualClock()) as system:
        await system.spawn(ChildSpec("b", rec("b", log), shutdown="brutal"))
        await system.stop("/b")
        assert lines(log, "stop") == []


async def test_a_supervisor_answers_asks_with_none_and_ignores_tells() -> None:
    async with ActorSystem(clock=ManualClock()) as system:
        assert await system.root.ask(Echo(1)) is None
        await system.root.tell("anything")
        await settle()
        assert system.statistics("/").state == "running"


async def test_supervisor_refs_and_type_errors() -> None:
    log: list[str] = []
    async with ActorSystem(clock=ManualClock()) as system:
        await system.spawn(ChildSpec("w", rec("w", log)))
        assert not isinstance(system.resolve("/w"), SupervisorRef)
        with pytest.raises(TypeError, match="not a Supervisor"):
            system.supervisor("/w")
        with pytest.raises(TypeError, match="ChildSpec"):
            await system.root.start_child("w2")  # type: ignore[arg-type]


def test_child_spec_validation() -> None:
    def make() -> Actor:
        return Rec("x", [])

    for bad_id in ("", "a/b", ".", ".."):
        with pytest.raises(ValueError, match="ChildSpec.id"):
            ChildSpec(bad_id, make)
    with pytest.raises(TypeError, match="ChildSpec.start"):
        ChildSpec("x", "not callable")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="ChildSpec.restart"):
        ChildSpec("x", make, restart="permanent")  # type: ignore[arg-type]
    for bad_shutdown in (-1.0, float("nan"), "soon", True):
        with pytest.raises(ValueError, match="ChildSpec.shutdown"):
            ChildSpec("x", make, shutdown=bad_shutdown)  # type: ignore[arg-type]
    assert ChildSpec("x", make, shutdown=0).shutdown == 0


def test_supervisor_validation() -> None:
    spec = ChildSpec("x", lambda: Rec("x", []))
    with pytest.raises(ValueError, match="duplicate"):
        Supervisor([spec, spec])
    with pytest.raises(TypeError, match="ChildSpec"):
        Supervisor(["x"])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="Strategy"):
        Supervisor(strategy="one_for_one")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="intensity"):
        Supervisor(intensity=-1)
    with pytest.raises(ValueError, match="period"):
        Supervisor(period=0)


class Gate(Actor):
    """A supervisor child whose on_start waits, for concurrency tests."""

    def __init__(self, gate: anyio.Event) -> None:
        self.gate = gate

    async def on_start(self) -> None:
        await self.gate.wait()

    async def receive(self, message: Any) -> Any:
        return message


async def test_a_slow_dynamic_start_does_not_hold_up_other_starts() -> None:
    gate = anyio.Event()
    async with ActorSystem(clock=ManualClock()) as system:
        await system.spawn(ChildSpec("runs", Supervisor))
        runs = system.supervisor("/runs")
        async with anyio.create_task_group() as tg:
            tg.start_soon(runs.start_child, ChildSpec("slow", lambda: Gate(gate)))
            await settle()
            fast = await runs.start_child(ChildSpec("fast", lambda: Rec("fast", [])))
            assert await fast.ask(Echo("fast")) == "fast"
            gate.set()
        assert [cid for cid, _ in runs.which_children()] == ["slow", "fast"]


async def test_a_child_stopped_while_a_group_restart_starts_it_does_not_strand_the_rest() -> None:
    log: list[str] = []
    gate = anyio.Event()
    made: list[int] = []

    def make_b() -> Rec:
        made.append(1)  # the restarted b hangs in on_start
        return Rec("b", log, start_gate=gate if len(made) > 1 else None)

    specs = [
        ChildSpec("a", rec("a", log)),
        ChildSpec("b", make_b, shutdown="brutal"),
        ChildSpec("c", rec("c", log)),
    ]
    async with ActorSystem(clock=ManualClock()) as system:
        await system.spawn(
            ChildSpec("sup", lambda: Supervisor(specs, strategy=Strategy.ONE_FOR_ALL))
        )
        log.clear()
        await system.resolve("/sup/a").tell("crash")
        await settle()
        assert log[-1] == "start b"  # the group restart waits on b's on_start
        await system.stop("/sup/b")
        await settle()
        # b is shut down brutally (its spec), so it never logs an on_stop.
        assert log == [
            "stop a Boom", "stop c normal",
            "start a", "started a", "start b", "start c", "started c",
        ]  # fmt: skip
        assert paths(system) == ["/", "/sup", "/sup/a", "/sup/c"]
        assert await system.resolve("/sup/c").ask(Echo("c")) == "c"


@pytest.mark.parametrize("how", ["stops itself", "stop_child"])
async def test_a_child_gone_for_good_is_freed_without_the_cyclic_gc(how: str) -> None:
    """Actor, runtime, cell and mailbox must not form cycles once a child has left.

    A daemon ends a lease actor per step; as cyclic garbage, each would wait
    for a full GC pass over every live object (a third of the daemon's CPU
    under load, measured with bench B). A crash is left out: the exception's
    traceback holds the frames that hold the actor, a cycle of its own, and
    crashes are rare.
    """
    import gc
    import weakref

    log: list[str] = []
    async with ActorSystem(clock=ManualClock()) as system:
        sup = await system.spawn(ChildSpec("sup", lambda: Supervisor([])))
        assert isinstance(sup, SupervisorRef)
        made: list[weakref.ref[Rec]] = []

        def factory() -> Rec:
            actor = Rec("t", log)
            made.append(weakref.ref(actor))
            return actor

        ref = await sup.start_child(ChildSpec("t", factory, restart=Restart.TEMPORARY))
        assert await ref.ask(Echo(1)) == 1
        gc.disable()
        try:
            if how == "stops itself":
                await ref.tell("stop")
            else:
                await sup.stop_child("t")
            await settle()
            assert paths(system) == ["/", "/sup"]
            assert len(made) == 1
            assert made[0]() is None, gc.get_referrers(made[0]())
        finally:
            gc.enable()


async def test_kills_are_restarted_but_not_counted_toward_the_intensity() -> None:
    """Fault injection must not stop the tree: only the children's own crashes escalate."""
    clock = ManualClock()
    log: list[str] = []
    sup = ChildSpec("sup", lambda: Supervisor([ChildSpec("w", rec("w", log))], intensity=1,
                                              period=5.0))
    async with ActorSystem(clock=clock, root=Supervisor([sup], intensity=0, period=5.0)) as system:
        for n in range(1, 6):
            await system.kill("/sup/w")
            await settle()
            assert system.statistics("/sup/w").restarts == n
        assert system.statistics("/sup").restarts == 0  # never escalated
        assert await system.resolve("/sup/w").ask(Echo("still here")) == "still here"


class _Reasons(Rec):
    seen: ClassVar[list[str]] = []

    async def on_start(self) -> None:
        reason = self.restart_reason
        _Reasons.seen.append("first" if reason is None else type(reason).__name__)
        await super().on_start()


async def test_a_restarted_incarnation_learns_why_and_the_crash_is_logged(
        caplog: pytest.LogCaptureFixture) -> None:
    log: list[str] = []
    _Reasons.seen = []
    caplog.set_level(logging.INFO, logger="stepd.actors")
    async with ActorSystem() as system:
        ref = await system.spawn(ChildSpec("r", lambda: _Reasons("r", log)))
        await ref.tell("crash")
        await settle()
        await system.kill("/r")
        await settle()
        assert _Reasons.seen == ["first", "Boom", "ActorKilled"]
    crashes = [r for r in caplog.records if "crashed" in r.getMessage()]
    assert len(crashes) == 1 and crashes[0].levelno == logging.WARNING
    assert crashes[0].exc_info is not None and "/r" in crashes[0].getMessage()
    kills = [r for r in caplog.records if "was killed" in r.getMessage()]
    assert len(kills) == 1 and kills[0].levelno == logging.INFO
