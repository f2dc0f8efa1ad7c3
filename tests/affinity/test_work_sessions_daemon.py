"""Worker sessions in the daemon, driven through its API with a virtual clock (AFFINITY.md
"Worker sessions"; docs/affinity.md "Worker sessions").

A real daemon (`Daemon.open`: real LMDB, the real actor tree) whose clock is a
`ManualClock`: session leases, TTLs and retries move only when a test advances
time, so nothing sleeps and no time is asserted.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest

from stepd.actors import ManualClock
from stepd.actors.daemon import Daemon, DaemonConfig, store
from stepd.actors.daemon.tables import IDX_WS_HOLDER
from stepd.sansio.errors import Fenced, Invalid
from stepd.sansio.lease import Op
from tests.daemon.helpers import eventually

TTL_MS = 10_000
LEASE_MS = 4_000


def flow(name: str, *, reacquire: str = "same_requirements", max_concurrent: int = 1,
         ttl_ms: int = TTL_MS) -> dict[str, Any]:
    """load (session) -> wait for "go" -> infer (session) -> fan, a for_each (session)."""
    return {
        "name": name,
        "sessions": {"gpu": {"requirements": {"gpu": "a100"}, "queue": "gpu",
                             "lease_ms": LEASE_MS, "ttl_ms": ttl_ms,
                             "max_concurrent": max_concurrent, "reacquire": reacquire}},
        "steps": [
            {"id": "load", "kind": "task", "body": "load", "session": "gpu"},
            {"id": "go", "kind": "wait", "event": "go"},
            {"id": "infer", "kind": "task", "body": "infer", "session": "gpu"},
            {"id": "fan", "kind": "for_each", "items": [1, 2, 3, 4, 5], "body": "infer",
             "session": "gpu"},
        ],
    }


def manifest(gpu: str, max_sessions: int = 2) -> dict[str, Any]:
    return {"local_steps": {"status": "rejected"},
            "sessions": {"status": "supported", "resources": {"gpu": gpu},
                         "max_sessions": max_sessions},
            "sticky": {"status": "rejected"}}


@asynccontextmanager
async def daemon(tmp_path: Path) -> AsyncIterator[tuple[Daemon, ManualClock]]:
    clock = ManualClock(wall_ms=1_700_000_000_000)
    config = DaemonConfig(lease_ttl_ms=60_000, heartbeat_ms=20_000, recovery_window_ms=5_000)
    async with Daemon.open(str(tmp_path / "data"), clock=clock, config=config) as d:
        yield d, clock


async def register(d: Daemon, definition: dict[str, Any], gpu: str, **kw: Any) -> str:
    answer = await d.register_worker(definitions=[definition], protocol_version="1.20",
                                     capabilities=["sessions"], manifest=manifest(gpu, **kw))
    return str(answer["worker_id"])


async def claim(d: Daemon, worker_id: str, n: int = 1) -> list[dict[str, Any]]:
    return await d.claim(worker_id, max=n, wait_ms=0)


async def claim_some(d: Daemon, worker_id: str, clock: ManualClock, n: int = 1
                     ) -> list[dict[str, Any]]:
    """Claim until something comes (the session's holder search retries on a timer)."""
    with anyio.fail_after(10):
        while True:
            got = await claim(d, worker_id, n)
            if got:
                return got
            clock.advance(0.25)
            await anyio.sleep(0.002)


async def finish(d: Daemon, lease: dict[str, Any], output: Any = None) -> None:
    await d.lease_call(lease["lease_id"], Op.STARTED, {})
    await d.lease_call(lease["lease_id"], Op.COMPLETE, {"output": output})


def record(d: Daemon, session_id: str) -> dict[str, Any]:
    raw = d.storage.get(store.WORK_SESSIONS, session_id)
    assert isinstance(raw, dict)
    return raw


def events(d: Daemon, run_id: str, *types: str) -> list[dict[str, Any]]:
    return [e for e in d.journal(run_id) if e["type"] in types]


async def test_the_session_goes_to_the_matching_worker_and_renew_never_extends_its_ttl(
        tmp_path: Path) -> None:
    async with daemon(tmp_path) as (d, clock):
        other = await register(d, flow("s1"), "t4")  # resources do not match
        holder = await register(d, flow("s1"), "a100")
        run_id, _ = await d.start_run("s1", {"x": 1})
        lease = (await claim_some(d, holder, clock))[0]
        assert lease["session"]["name"] == "gpu" and lease["session"]["generation"] == 1
        sid = lease["session"]["session_id"]
        assert await claim(d, other) == []  # never offered to a worker that does not match
        await finish(d, lease)
        created = record(d, sid)
        assert created["holder"] == holder and created["status"] == "held"
        remaining = []
        # Renew every 2 s, well inside lease_ms, for longer than the TTL: the holder keeps
        # its authority, but the absolute TTL never moves.
        for _ in range(4):
            clock.advance(2.0)
            answer = await d.session_renew(sid, holder)
            remaining.append(answer["ttl_remaining_ms"])
            now = record(d, sid)
            assert now["expires_at"] == created["expires_at"]
            assert now["lease_until"] <= now["expires_at"]
        assert remaining == sorted(remaining, reverse=True) and len(set(remaining)) == 4
        with pytest.raises(Fenced):
            await d.session_renew(sid, other)  # not the holder
        clock.advance(2.5)  # past created_at + ttl_ms, renewals or not
        await eventually(lambda: record(d, sid)["status"] == "expired", what="expired")
        assert d.storage.scan(IDX_WS_HOLDER) == []  # its slot is free
        await d.signal(run_id, "go")  # the run now needs the expired session
        await eventually(lambda: d.status(run_id)["status"] == "failed", what="failed")
        assert d.status(run_id)["error"]["reason"] == "session_expired"


async def test_holder_loss_moves_the_session_keeping_its_ttl(tmp_path: Path) -> None:
    async with daemon(tmp_path) as (d, clock):
        first = await register(d, flow("s2"), "a100")
        run_id, _ = await d.start_run("s2", {})
        lease = (await claim_some(d, first, clock))[0]
        sid = lease["session"]["session_id"]
        await finish(d, lease)
        before = record(d, sid)
        second = await register(d, flow("s2"), "a100")
        # The first holder renews no more: its authority ends after lease_ms.
        clock.advance(LEASE_MS / 1000 + 0.1)
        await eventually(lambda: record(d, sid)["holder"] == second, what="reacquired")
        after = record(d, sid)
        assert after["generation"] == 2 and after["expires_at"] == before["expires_at"]
        assert after["lost_holders"] == [first]
        await d.signal(run_id, "go")
        assert await claim(d, first) == []
        lease = (await claim_some(d, second, clock))[0]
        assert lease["step_id"] == "infer" and lease["session"]["generation"] == 2
        kinds = [(e["type"], e.get("worker_id")) for e in
                 events(d, run_id, "session_acquired", "session_lost")]
        assert kinds == [("session_acquired", first), ("session_lost", first),
                         ("session_acquired", second)]


async def test_reacquire_never_fails_the_run_with_session_lost(tmp_path: Path) -> None:
    async with daemon(tmp_path) as (d, clock):
        first = await register(d, flow("s3", reacquire="never"), "a100")
        await register(d, flow("s3", reacquire="never"), "a100")
        run_id, _ = await d.start_run("s3", {})
        lease = (await claim_some(d, first, clock))[0]
        await finish(d, lease)
        clock.advance(LEASE_MS / 1000 + 0.1)
        await eventually(lambda: d.status(run_id)["status"] == "failed", what="failed")
        assert d.status(run_id)["error"]["reason"] == "session_lost"


async def test_max_concurrent_bounds_a_session_for_each(tmp_path: Path) -> None:
    async with daemon(tmp_path) as (d, clock):
        holder = await register(d, flow("s4", max_concurrent=2), "a100")
        run_id, _ = await d.start_run("s4", {})
        await finish(d, (await claim_some(d, holder, clock))[0])
        await d.signal(run_id, "go")
        await finish(d, (await claim_some(d, holder, clock))[0])
        peak, done = 0, 0
        held: list[dict[str, Any]] = []
        with anyio.fail_after(10):
            while done < 5:
                held += await claim(d, holder, 10)
                peak = max(peak, len(held))
                assert len(held) <= 2
                if held:
                    await finish(d, held.pop(0))
                    done += 1
                else:
                    await anyio.sleep(0.002)
        assert peak == 2
        await eventually(lambda: d.status(run_id)["status"] == "completed", what="completed")


async def test_a_graceful_close_hands_the_session_over_at_once(tmp_path: Path) -> None:
    async with daemon(tmp_path) as (d, clock):
        first = await register(d, flow("s5"), "a100", max_sessions=1)
        _run_id, _ = await d.start_run("s5", {})
        lease = (await claim_some(d, first, clock))[0]
        sid = lease["session"]["session_id"]
        await finish(d, lease)
        second = await register(d, flow("s5"), "a100")
        await d.session_close(sid, first)  # no clock moves: no lease expiry involved
        await eventually(lambda: record(d, sid)["holder"] == second, what="handed over")
        with pytest.raises(Fenced):
            await d.session_renew(sid, first)
        # The first worker's only slot is free again: a second run's session may use it.
        assert not [k for k, _ in d.storage.scan(IDX_WS_HOLDER)
                    if k.startswith(first.encode())]


async def test_killing_a_session_actor_rebuilds_it_from_storage(tmp_path: Path) -> None:
    async with daemon(tmp_path) as (d, clock):
        holder = await register(d, flow("s6"), "a100")
        run_id, _ = await d.start_run("s6", {})
        lease = (await claim_some(d, holder, clock))[0]
        sid = lease["session"]["session_id"]
        path = f"/sessions/{sid}"
        paths = [n.statistics.path for n in d.system.tree().walk()]
        assert path in paths  # listed with the tree (`stepd actors`)
        before = record(d, sid)
        await d.kill(path)
        await eventually(lambda: d.system.find(path) is not None and d.system.find(path).alive,
                         what="restarted")
        await finish(d, lease)
        assert record(d, sid) == before
        answer = await d.session_renew(sid, holder)  # the rebuilt actor serves the holder
        assert answer["generation"] == 1
        await d.signal(run_id, "go")
        lease = (await claim_some(d, holder, clock))[0]
        assert lease["session"]["generation"] == 1
        assert len(events(d, run_id, "session_acquired")) == 1
        # Its timer was re-armed from the record: without renewals the holder is lost.
        clock.advance(LEASE_MS / 1000 + 0.1)
        await eventually(lambda: record(d, sid)["status"] == "pending", what="holder lost")


async def test_a_workers_max_sessions_is_never_exceeded(tmp_path: Path) -> None:
    async with daemon(tmp_path) as (d, clock):
        holder = await register(d, flow("s7"), "a100", max_sessions=1)
        runs = [(await d.start_run("s7", {"i": i}))[0] for i in range(2)]
        lease = (await claim_some(d, holder, clock))[0]
        clock.advance(1.0)
        await anyio.sleep(0.01)
        assert await claim(d, holder, 5) == []  # the other run's session has no slot
        waiting = next(r for r in runs if r != lease["run_id"])
        assert d.status(waiting)["status"] == "running"
        await finish(d, lease)
        await d.cancel(lease["run_id"])  # its run ends: the session closes, the slot frees
        got = (await claim_some(d, holder, clock))[0]
        assert got["run_id"] == waiting


async def test_a_session_definition_names_the_bad_field(tmp_path: Path) -> None:
    async with daemon(tmp_path) as (d, _):
        bad = flow("s8")
        bad["sessions"]["gpu"]["reacquire"] = "sometimes"
        with pytest.raises(Invalid) as exc:
            await d.register_worker(definitions=[bad])
        assert exc.value.field == "definitions[0].sessions.gpu.reacquire"
        bad = flow("s8")
        bad["steps"][0]["session"] = "tpu"
        with pytest.raises(Invalid) as exc:
            await d.register_worker(definitions=[bad])
        assert exc.value.field == "definitions[0].steps[0].session"
        bad = flow("s8")
        bad["steps"][2]["local"] = True  # local: runs where `go` ran, not on the holder
        with pytest.raises(Invalid) as exc:
            await d.register_worker(definitions=[bad])
        assert exc.value.field == "definitions[0].steps[2].session"


async def test_a_daemon_restart_grants_the_holder_a_full_lease(tmp_path: Path) -> None:
    clock = ManualClock(wall_ms=1_700_000_000_000)
    config = DaemonConfig(lease_ttl_ms=60_000, heartbeat_ms=20_000, recovery_window_ms=5_000)
    async with Daemon.open(str(tmp_path / "data"), clock=clock, config=config) as d:
        holder = await register(d, flow("s9"), "a100")
        await d.start_run("s9", {})
        lease = (await claim_some(d, holder, clock))[0]
        sid = lease["session"]["session_id"]
        await finish(d, lease)
        before = record(d, sid)
    clock.advance(LEASE_MS / 1000 + 1.0)  # the daemon was down longer than lease_ms
    async with Daemon.open(str(tmp_path / "data"), clock=clock, config=config) as d:
        await eventually(lambda: record(d, sid)["lease_until"] > before["lease_until"],
                         what="a fresh lease")
        answer = await d.session_renew(sid, holder)  # still the holder: it may renew
        assert answer["generation"] == 1
        assert record(d, sid)["expires_at"] == before["expires_at"]


@pytest.mark.parametrize("declaration", [
    {"protocol_version": "1.17"},
    {"protocol_version": "1.20", "capabilities": [],
     "manifest": {cap: {"status": "rejected"} for cap in ("local_steps", "sessions", "sticky")}},
])
async def test_renew_and_close_go_through_the_capability_gate(
        tmp_path: Path, declaration: dict[str, Any]) -> None:
    async with daemon(tmp_path) as (d, clock):
        holder = await register(d, flow("s10"), "a100")
        await d.start_run("s10", {})
        lease = (await claim_some(d, holder, clock))[0]
        sid = lease["session"]["session_id"]
        before = record(d, sid)
        answer = await d.register_worker(definitions=[flow("s10")], **declaration)
        plain = str(answer["worker_id"])
        for call in (d.session_renew, d.session_close):
            with pytest.raises(Invalid) as exc:
                await call(sid, plain)
            assert exc.value.field == "session_id"
        assert record(d, sid) == before  # refused: nothing touched
        # The holder re-registers without the capability: the gate judges what it says now.
        await d.register_worker(definitions=[flow("s10")], worker_id=holder, **declaration)
        with pytest.raises(Invalid):
            await d.session_renew(sid, holder)
        assert record(d, sid) == before


async def test_the_sdk_worker_declares_sessions_in_its_full_manifest(tmp_path: Path) -> None:
    """The SDK registers as 1.20 with all three capabilities declared; ``sessions``
    supported (with its resources and max_sessions) only when max_sessions > 0."""
    import stepd

    holder = stepd.Worker("http://127.0.0.1:1", resources={"gpu": "a100"}, max_sessions=2,
                          local_steps=True)
    plain = stepd.Worker("http://127.0.0.1:1")
    async with daemon(tmp_path) as (d, clock):
        stored: dict[stepd.Worker, Any] = {}
        for w in (holder, plain):
            body = w._register_body()
            assert body["protocol_version"] == "1.20"
            body["definitions"] = [flow("s11")]
            wid = str((await d.register_worker(**body))["worker_id"])
            stored[w] = d.storage.get(store.WORKERS, wid)
        mine = stored[holder]
        assert mine["capabilities"] == ["local_steps", "sessions"]
        assert mine["manifest"] == {
            "local_steps": {"status": "supported"},
            "sessions": {"status": "supported", "resources": {"gpu": "a100"}, "max_sessions": 2},
            "sticky": {"status": "rejected"}}
        assert stored[plain]["capabilities"] == []
        assert stored[plain]["manifest"]["sessions"] == {"status": "rejected"}
        await d.start_run("s11", {})
        lease = (await claim_some(d, mine["worker_id"], clock))[0]  # it may hold the session
        assert lease["session"]["generation"] == 1
    with pytest.raises(stepd.Invalid) as exc:
        stepd.Worker("http://127.0.0.1:1", max_sessions=1, protocol_version="1.17")
    assert exc.value.field == "protocol_version"


async def test_retention_deletes_a_pruned_runs_session_records(tmp_path: Path) -> None:
    async with daemon(tmp_path) as (d, clock):
        holder = await register(d, flow("s12"), "a100")
        run_id, _ = await d.start_run("s12", {})
        kept, _ = await d.start_run("s12", {"other": True})
        lease = (await claim_some(d, holder, clock))[0]
        sid = lease["session"]["session_id"]
        await finish(d, lease)
        await d.cancel(lease["run_id"])
        await eventually(lambda: record(d, sid)["status"] == "closed", what="closed")
        clock.advance(1.0)
        assert (await d.prune_runs(clock.time_ms()))["deleted"] == 1
        assert d.storage.get(store.WORK_SESSIONS, sid) is None
        other = kept if lease["run_id"] == run_id else run_id
        assert d.storage.get(store.RUNS, other) is not None  # the live run keeps its own


async def test_the_workers_api_lists_the_sessions_each_worker_holds(tmp_path: Path) -> None:
    async with daemon(tmp_path) as (d, clock):
        first = await register(d, flow("s10"), "a100", max_sessions=1)
        run_id, _ = await d.start_run("s10", {})
        lease = (await claim_some(d, first, clock))[0]
        sid = lease["session"]["session_id"]
        await finish(d, lease)
        rec = record(d, sid)
        clock.advance(1.0)

        async def held_by() -> dict[str, list[dict[str, Any]]]:
            return {w["worker_id"]: w["sessions"] for w in await d.workers()}

        assert (await held_by())[first] == [{
            "session_id": sid, "run_id": run_id, "name": "gpu", "status": "held",
            "generation": 1, "since": rec["held_since"], "lease_until": rec["lease_until"],
            "expires_at": rec["expires_at"],
            "ttl_remaining_ms": rec["expires_at"] - clock.time_ms()}]
        assert rec["created_at"] <= rec["held_since"] <= rec["lease_until"] <= rec["expires_at"]
        second = await register(d, flow("s10"), "a100")
        await d.session_close(sid, first)
        await eventually(lambda: record(d, sid)["holder"] == second, what="handed over")
        now = await held_by()
        assert now[first] == []
        [moved] = now[second]
        assert moved["generation"] == 2 and moved["since"] == record(d, sid)["held_since"]
        assert moved["expires_at"] == rec["expires_at"]  # the TTL moved with it, unchanged


async def test_a_lost_holders_step_in_progress_ends_by_its_own_lease(tmp_path: Path) -> None:
    """docs/affinity.md "Holder loss": the session moves, the attempt already running on
    the old holder is not cut short: its lease (TTL 60 s here, longer than the session's
    lease_ms) stays its authority; its completion is accepted once, the new holder never
    gets a copy of it, and the session's next step goes to the new holder."""
    async with daemon(tmp_path) as (d, clock):
        first = await register(d, flow("s11"), "a100")
        run_id, _ = await d.start_run("s11", {})
        lease = (await claim_some(d, first, clock))[0]
        sid = lease["session"]["session_id"]
        await d.lease_call(lease["lease_id"], Op.STARTED, {})
        second = await register(d, flow("s11"), "a100")
        clock.advance(LEASE_MS / 1000 + 0.1)  # the session lease lapses; the step's does not
        await eventually(lambda: record(d, sid)["holder"] == second, what="reacquired")
        assert await claim(d, second) == []  # load is still the first holder's attempt
        await d.lease_call(lease["lease_id"], Op.COMPLETE, {"output": "from first"})
        await eventually(lambda: d.status(run_id)["status"] == "waiting", what="waits for go")
        await d.signal(run_id, "go")
        nxt = (await claim_some(d, second, clock))[0]
        assert nxt["step_id"] == "infer" and nxt["steps"]["load"] == "from first"
        # (An offer is journaled behind the lease it hands out.)
        await eventually(lambda: [(e["step_id"], e["worker_id"]) for e in events(
            d, run_id, "step_offered")] == [("load", first), ("infer", second)], what="offers")
