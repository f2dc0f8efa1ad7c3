"""The ActorSystem: lifecycle, addressing, kill, and introspection."""

from __future__ import annotations

import json
from typing import Any

import anyio
import pytest

from stepd.actors import (
    Actor,
    ActorDead,
    ActorNotFound,
    ActorStatistics,
    ActorSystem,
    ChildSpec,
    ManualClock,
    Restart,
    Supervisor,
    SupervisorEscalation,
    SystemClock,
)

from ._helpers import Block, Boom, Echo, Rec, rec, settle


class Lease(Rec):
    kind = "lease"


async def test_tree_shows_path_kind_restarts_mailbox_depth_and_children() -> None:
    clock = ManualClock(wall_ms=1_000_000)
    log: list[str] = []
    gate = anyio.Event()
    root = Supervisor(
        [
            ChildSpec(
                "leases",
                lambda: Supervisor([ChildSpec("l_1", lambda: Lease("l_1", log, gate=gate))]),
            ),
            ChildSpec("runs", Supervisor),
        ]
    )
    async with ActorSystem(clock=clock, root=root) as system:
        clock.advance(2.5)
        runs = system.supervisor("/runs")
        await runs.start_child(ChildSpec("r_1", rec("r_1", log)))
        await system.kill("/runs/r_1")
        await settle()
        lease = system.resolve("/leases/l_1")
        await lease.tell(Block())
        await settle()
        await lease.tell(1)
        await lease.tell(2)

        tree = system.tree()
        assert [node.path for node in tree.walk()] == [
            "/",
            "/leases",
            "/leases/l_1",
            "/runs",
            "/runs/r_1",
        ]
        by_path = {node.path: node.statistics for node in tree.walk()}
        assert by_path["/"].kind == "Supervisor"
        assert by_path["/leases/l_1"] == ActorStatistics(
            path="/leases/l_1",
            kind="lease",
            state="running",
            restarts=0,
            mailbox_depth=2,
            mailbox_size=1024,
            timers=0,
            started_at=1_000_000,
        )
        assert by_path["/runs/r_1"].kind == "Rec"
        assert by_path["/runs/r_1"].restarts == 1
        assert by_path["/runs/r_1"].started_at == 1_002_500  # restarted 2.5 s later
        leases_node = tree.find("/leases")
        assert leases_node is not None
        assert [c.path for c in leases_node.children] == ["/leases/l_1"]
        assert tree.find("/nope") is None

        data = tree.to_dict()
        assert json.loads(json.dumps(data)) == data  # JSON-friendly as is
        assert data["path"] == "/"
        assert [c["path"] for c in data["children"]] == ["/leases", "/runs"]
        assert data["children"][0]["children"][0]["mailbox_depth"] == 2
        assert set(data) == {
            "path",
            "kind",
            "state",
            "restarts",
            "mailbox_depth",
            "mailbox_size",
            "timers",
            "started_at",
            "children",
        }
        assert system.statistics("/runs/r_1") == lease_stats_for(system, "/runs/r_1")
        gate.set()


def lease_stats_for(system: ActorSystem, path: str) -> ActorStatistics:
    return system.resolve(path).statistics()


async def test_resolve_stop_and_kill_name_what_is_missing() -> None:
    async with ActorSystem(clock=ManualClock()) as system:
        with pytest.raises(ActorNotFound) as excinfo:
            system.resolve("/nobody")
        assert excinfo.value.path == "/nobody"
        assert isinstance(excinfo.value, LookupError)
        with pytest.raises(ActorNotFound):
            await system.kill("/nobody")
        with pytest.raises(ActorNotFound):
            await system.stop("/nobody")
        with pytest.raises(ActorNotFound):
            system.statistics("/nobody")
        with pytest.raises(ValueError, match="root"):
            await system.kill("/")
        with pytest.raises(ValueError, match="root"):
            await system.stop("/")
        assert system.root.path == "/"
        assert system.resolve("/") == system.root
        assert system.find("/nobody") is None and system.find("/") == system.root


async def test_stop_removes_a_nested_actor_for_good() -> None:
    log: list[str] = []
    async with ActorSystem(clock=ManualClock()) as system:
        await system.spawn(
            ChildSpec("runs", lambda: Supervisor([ChildSpec("r_1", rec("r_1", log))]))
        )
        await system.stop("/runs/r_1")
        assert log[-1] == "stop r_1 normal"
        with pytest.raises(ActorNotFound):
            system.resolve("/runs/r_1")
        await settle()
        assert [n.path for n in system.tree().walk()] == ["/", "/runs"]


async def test_an_error_in_the_body_stops_the_actors_gracefully_and_propagates_unwrapped() -> None:
    log: list[str] = []
    with pytest.raises(Boom):
        async with ActorSystem(clock=ManualClock()) as system:
            await system.spawn(ChildSpec("a", rec("a", log)))
            await system.spawn(ChildSpec("b", rec("b", log)))
            raise Boom("body")
    assert log[-2:] == ["stop b normal", "stop a normal"]


async def test_cancelling_the_system_from_outside_is_brutal_but_fails_pending_asks() -> None:
    log: list[str] = []
    gate = anyio.Event()
    outcome: list[object] = []
    system_ready = anyio.Event()
    holder: list[ActorSystem] = []

    async def run_system(scope: anyio.CancelScope) -> None:
        with scope:
            async with ActorSystem(clock=ManualClock()) as system:
                holder.append(system)
                await system.spawn(ChildSpec("a", rec("a", log, gate=gate)))
                system_ready.set()
                await anyio.sleep_forever()

    async def ask_from_outside() -> None:
        try:
            outcome.append(await holder[0].resolve("/a").ask(Block()))
        except ActorDead as exc:
            outcome.append(exc)

    scope = anyio.CancelScope()
    async with anyio.create_task_group() as tg:
        tg.start_soon(run_system, scope)
        await system_ready.wait()
        tg.start_soon(ask_from_outside)
        await settle()
        scope.cancel()
    assert len(outcome) == 1 and isinstance(outcome[0], ActorDead)
    assert "stop a normal" not in log  # cancelled from outside: no on_stop
    assert holder[0]._registry == {}


async def test_the_root_supervisor_giving_up_leaves_the_block_as_an_exception_group() -> None:
    log: list[str] = []
    root = Supervisor([ChildSpec("w", rec("w", log))], intensity=0, period=1.0)
    with pytest.RaisesGroup(SupervisorEscalation) as excinfo:
        async with ActorSystem(clock=ManualClock(), root=root) as system:
            await system.resolve("/w").tell("crash")
            await anyio.sleep_forever()  # cancelled when the root gives up
    failure = excinfo.value.exceptions[0]
    assert isinstance(failure, SupervisorEscalation)
    assert failure.path == "/" and failure.intensity == 0
    assert isinstance(failure.__cause__, Boom)


async def test_a_system_runs_once_and_only_under_a_supervisor() -> None:
    system = ActorSystem(clock=ManualClock())
    with pytest.raises(RuntimeError, match="not running"):
        system.tree()
    async with system:
        pass
    with pytest.raises(RuntimeError, match="once"):
        async with system:
            pass  # pragma: no cover
    with pytest.raises(TypeError, match="Supervisor"):
        ActorSystem(root=Rec("x", []))  # type: ignore[arg-type]


async def test_the_default_clock_is_the_system_clock() -> None:
    class Clocked(Actor):
        async def receive(self, message: Any) -> Any:
            return self.clock.now()

    async with ActorSystem() as system:
        assert isinstance(system.clock, SystemClock)
        ref = await system.spawn(ChildSpec("c", Clocked))
        assert await ref.ask(Echo(0)) == pytest.approx(anyio.current_time(), abs=1.0)
        assert system.statistics("/c").started_at is not None
        assert "ActorSystem" in repr(system)


async def test_a_killed_actor_that_is_not_restarted_leaves_the_tree() -> None:
    log: list[str] = []
    async with ActorSystem(clock=ManualClock()) as system:
        ref = await system.spawn(ChildSpec("t", rec("t", log), restart=Restart.TEMPORARY))
        await system.kill("/t")
        await settle()
        assert [n.path for n in system.tree().walk()] == ["/"]
        assert ref.statistics().state == "dead"
        with pytest.raises(ActorNotFound):
            await system.kill("/t")
