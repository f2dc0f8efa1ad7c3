"""The daemon in this process (`stepd.daemon.Daemon` in a thread): the in-process adapter,
long-polls ended by a client disconnect, and the drain seen from inside.

`stepd.transport.inprocess.InProcess` must see exactly what HTTP callers see:
the same validation and errors (raised, not status codes), the same audit
entries, and copies of every value crossing it.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from stepd.actors.daemon import SignalRefused
from stepd.sansio.errors import AlreadyApplied, Invalid, NotFound, RunTerminal, Unavailable
from stepd.transport.inprocess import InProcess
from stepd.transport.protocol import NO_BODY, Operation, error_reply

from .conftest import InProcDaemon, task_def, unique


def _nothing(txn: Any) -> None:
    """A write that writes nothing: awaiting it commits the deferred writes queued before it."""


def _in(inproc: InProcDaemon, fn: Callable[[InProcess], Awaitable[Any]]) -> Any:
    """Run ``fn(InProcess(protocol))`` on the daemon's event loop."""

    async def go() -> Any:
        return await fn(InProcess(inproc.daemon.protocol))

    return inproc.run(go)


def _raises(inproc: InProcDaemon, fn: Callable[[InProcess], Awaitable[Any]]) -> BaseException:
    async def go() -> BaseException:
        try:
            await fn(InProcess(inproc.daemon.protocol))
        except Exception as exc:  # noqa: BLE001 - returned to the test to look at
            return exc
        raise AssertionError("no error")

    return inproc.run(go)  # type: ignore[no-any-return]


def test_in_process_calls_see_what_http_sees(inproc: InProcDaemon) -> None:
    name = unique()
    reg = _in(inproc, lambda c: c.register({"definitions": [task_def(name, "a", "b")]}))
    wid = reg["worker_id"]
    body = {"workflow": name, "input": {"items": [1, 2]}}
    started = _in(inproc, lambda c: c.start_run(body))
    assert started["created"] is True
    run_id = started["run_id"]
    body["input"]["items"].append(3)  # the caller's dict is not the engine's
    leases = _in(inproc, lambda c: c.claim({"worker_id": wid, "wait_ms": 1000}))["leases"]
    lease = leases[0]
    assert lease["input"] == {"items": [1, 2]}
    lease["input"]["items"].clear()  # nor is the answer
    assert _in(inproc, lambda c: c.get_run(run_id))["input"] == {"items": [1, 2]}
    lid = lease["lease_id"]
    assert _in(inproc, lambda c: c.started(lid)) == {}
    assert _in(inproc, lambda c: c.heartbeat(lid, {"progress": 1})) == {"lease_ttl_ms": 30_000}
    assert _in(inproc, lambda c: c.complete(lid, {"output": 1})) == {}
    # The same refusals, raised.
    exc = _raises(inproc, lambda c: c.complete(lid, {"output": 1}))
    assert isinstance(exc, AlreadyApplied) and error_reply(exc).status == 409
    exc = _raises(inproc, lambda c: c.complete(lid, {"outptu": 1}))
    assert isinstance(exc, Invalid) and exc.field == "outptu"
    exc = _raises(inproc, lambda c: c.start_run({"workflow": name}))
    assert isinstance(exc, Invalid) and exc.field == "input"
    exc = _raises(inproc, lambda c: c.get_run("r_NOSUCHRUN"))
    assert isinstance(exc, NotFound)
    exc = _raises(inproc, lambda c: c.register({"definitions": [{"name": "x"}]}))
    assert isinstance(exc, Invalid) and exc.field == "definitions[0].steps"
    exc = _raises(inproc, lambda c: c.start_run({"workflow": name, "input": float("nan")}))
    assert isinstance(exc, Invalid)  # not JSON, as over HTTP
    assert _in(inproc, lambda c: c.cancel(run_id)) == {}
    exc = _raises(inproc, lambda c: c.cancel(run_id))
    assert isinstance(exc, RunTerminal)
    page = _in(inproc, lambda c: c.list_runs(workflow=name, limit=5))
    assert [r["run_id"] for r in page["runs"]] == [run_id]
    events = _in(inproc, lambda c: c.journal(run_id, limit=2))["events"]
    assert len(events) == 2
    assert _in(inproc, lambda c: c.result(run_id, wait_ms=0))["status"] == "cancelled"
    # Audited as over HTTP (no key: key_id null), worker calls not.
    entries: list[dict[str, Any]] = []
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        entries = _in(inproc, lambda c: c.audit(limit=1000))["entries"]
        if any(e["action"] == "runs.result" and e["target"] == run_id for e in entries):
            break
        time.sleep(0.02)
    mine = [e for e in entries if e["target"] == run_id]
    assert {e["action"] for e in mine} >= {"runs.start", "runs.read", "runs.cancel",
                                           "runs.journal", "runs.result"}
    start = next(e for e in mine if e["action"] == "runs.start")
    assert start["key_id"] is None and start["status"] == 201 and start["scope"] == "execute"


def test_a_lease_call_in_one_frame_answers_exactly_as_handle(inproc: InProcDaemon) -> None:
    """`Protocol.handle_lease` (the WebSocket's lease calls) is `handle` for those rows in
    one frame: every refusal and every answer the same, for the same calls."""
    name = unique()
    wid = _in(inproc, lambda c: c.register({"definitions": [task_def(name, "a", "b")]}))[
        "worker_id"]
    _in(inproc, lambda c: c.start_run({"workflow": name, "input": None}))
    lease = _in(inproc, lambda c: c.claim({"worker_id": wid, "wait_ms": 1000}))["leases"][0]
    lid = lease["lease_id"]
    protocol = inproc.daemon.protocol

    async def both(op: Operation, target: str, body: Any, worker_id: str | None
                   ) -> tuple[Any, Any]:
        principal = protocol.authorize(op, None)
        slow = await protocol.handle(op, principal, target=target,
                                     body=copy.deepcopy(body), worker_id=worker_id)
        fast = await protocol.handle_lease(op, target, copy.deepcopy(body), worker_id)
        return (slow.status, slow.body), (fast.status, fast.body)

    def same(op: Operation, target: str, body: Any, worker_id: str | None = None) -> int:
        slow, fast = inproc.run(both, op, target, body, worker_id)
        assert fast == slow
        return int(fast[0])

    # Refusals before the lease is looked at: a malformed id, a body that fails its
    # schema, one of another type; then an unknown lease, and another worker's.
    assert same(Operation.COMPLETE, "not a lease id", {"output": 1}) == 404
    assert same(Operation.COMPLETE, lid, {"outptu": 1}) == 400
    assert same(Operation.FAIL, lid, {"error_class": 7}) == 400
    assert same(Operation.HEARTBEAT, lid, [1]) == 400
    assert same(Operation.STARTED, lid, {}, "w_nobody") == 404
    assert same(Operation.HEARTBEAT, "l_" + "0" * 26, {}) == 404
    assert same(Operation.STARTED, lid, NO_BODY) == 400  # a body is a map (as over HTTP)
    # Answers: a heartbeat (answered both times, it changes nothing durable).
    assert same(Operation.HEARTBEAT, lid, {"progress": 1}, wid) == 200
    # The complete lands once (the fast way); then both refuse it alike (409).
    done = inproc.run(protocol.handle_lease, Operation.COMPLETE, lid, {"output": 1}, wid)
    assert (done.status, done.body) == (200, {})
    assert same(Operation.COMPLETE, lid, {"output": 1}, wid) == 409
    assert same(Operation.FAIL, lid, {"error": {"class": "retryable", "message": "m"}}, wid) == 409


def test_signal_refusal_carries_the_budget_in_process(inproc: InProcDaemon) -> None:
    name = unique()
    _in(inproc, lambda c: c.register({"definitions": [{
        "name": name, "budgets": {"max_state_bytes": 64},
        "steps": [{"id": "w", "kind": "wait", "event": "go", "into": "go"}]}]}))
    run_id = _in(inproc, lambda c: c.start_run({"workflow": name, "input": None}))["run_id"]
    exc = _raises(inproc, lambda c: c.signal(run_id, {"name": "go", "payload": "x" * 500}))
    assert isinstance(exc, SignalRefused) and exc.budget == "max_state_bytes"
    assert error_reply(exc).body["budget"] == "max_state_bytes"


def test_a_claim_abandoned_by_its_client_leaves_no_waiter_and_loses_no_slot(
        inproc: InProcDaemon) -> None:
    name = unique()
    with inproc.client() as http:
        wid = http.post("/v1/api/workers/register",
                        json={"definitions": [task_def(name, "a")]}).json()["worker_id"]
        engine = inproc.daemon.daemon
        for _ in range(3):
            with inproc.client() as impatient, pytest.raises(httpx.ReadTimeout):
                impatient.post("/v1/api/steps/claim", json={"worker_id": wid, "wait_ms": 10_000},
                               timeout=0.2)
        deadline = time.monotonic() + 5
        while inproc.run(engine.registry_stats).waiting_claims:
            assert time.monotonic() < deadline, "the abandoned claims are still parked"
            time.sleep(0.01)
        run_id = http.post("/v1/api/runs", json={"workflow": name, "input": 1}).json()["run_id"]
        r = http.post("/v1/api/steps/claim", json={"worker_id": wid, "wait_ms": 2000})
        assert [x["run_id"] for x in r.json()["leases"]] == [run_id]


def test_the_drain_refuses_new_calls_with_503(tmp_path: Path) -> None:
    from stepd.daemon import ServeConfig, Server

    daemon = Server(ServeConfig(data=str(tmp_path / "data"), port=0, max_request_ms=5000),
                    announce=lambda line: None)
    with anyio.from_thread.start_blocking_portal("asyncio") as portal:
        future, _ = portal.start_task(daemon.run)
        assert daemon.url is not None and daemon.protocol is not None
        protocol = daemon.protocol
        with httpx.Client(base_url=daemon.url, trust_env=False, timeout=10) as http:
            name = unique()
            wid = http.post("/v1/api/workers/register",
                            json={"definitions": [task_def(name, "a")]}).json()["worker_id"]
            portal.call(protocol.begin_drain)
            for method, path, body in (("GET", "/healthz", None), ("GET", "/metrics", None),
                                       ("POST", "/v1/api/steps/claim", {"worker_id": wid}),
                                       ("POST", "/v1/api/runs", {"workflow": name, "input": 1})):
                r = http.request(method, path, json=body)
                assert r.status_code == 503 and r.json()["error"] == "unavailable", path

            async def in_process() -> BaseException:
                try:
                    await InProcess(protocol).workers()
                except Unavailable as exc:
                    return exc
                raise AssertionError("served while draining")

            assert isinstance(portal.call(in_process), Unavailable)
        portal.call(daemon.request_stop)
        assert future.result(timeout=15) == 0


async def test_the_protocol_runs_on_either_backend(tmp_path: Path) -> None:
    """Protocol and InProcess use anyio only: the embedded daemon may run on asyncio or trio."""
    from stepd.actors.daemon import Daemon
    from stepd.transport.protocol import Protocol

    async with Daemon.open(str(tmp_path / "data")) as engine:
        protocol = Protocol(engine)
        client = InProcess(protocol)
        name = unique()
        wid = (await client.register({"definitions": [task_def(name, "a")]}))["worker_id"]
        run_id = (await client.start_run({"workflow": name, "input": 3}))["run_id"]
        (lease,) = (await client.claim({"worker_id": wid, "wait_ms": 1000}))["leases"]
        await client.started(lease["lease_id"])
        await client.complete(lease["lease_id"], {"output": lease["input"] * 2})
        result = await client.result(run_id, wait_ms=5000)
        assert result == {"run_id": run_id, "status": "completed", "result": 6, "error": None}
        text = await protocol.render_metrics()
        assert 'stepd_runs{status="completed"} 1' in text
        assert await protocol.drain(1.0) is True
        with pytest.raises(Unavailable):
            await client.get_run(run_id)


async def test_the_drain_and_the_abort_end_in_process_calls_with_503(tmp_path: Path) -> None:
    """On either backend (asyncio tracks a call through its task, trio through a cancel
    scope: transport/inprocess.py): a held result ends with `Unavailable` when the
    daemon drains, and a start waiting for its commit when the grace period ends."""
    from stepd.actors.daemon import Daemon
    from stepd.transport.protocol import Protocol

    from ..daemon.helpers import eventually, writer_held

    async with Daemon.open(str(tmp_path / "data")) as engine:
        protocol = Protocol(engine)
        client = InProcess(protocol)
        name = unique()
        await client.register({"definitions": [task_def(name, "a")]})
        run_id = (await client.start_run({"workflow": name, "input": 3}))["run_id"]
        ended: list[BaseException] = []

        async def ends_unavailable(call: Awaitable[Any]) -> None:
            try:
                await call
            except Unavailable as exc:
                ended.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(ends_unavailable, client.result(run_id, wait_ms=30_000))
            await eventually(lambda: protocol.inflight == 1, what="the result held")
            protocol.begin_drain()
        assert [str(e) for e in ended] == ["the daemon is shutting down"]
        assert protocol.inflight == 0

    async with Daemon.open(str(tmp_path / "data2")) as engine:
        protocol = Protocol(engine)
        client = InProcess(protocol)
        await client.register({"definitions": [task_def(name, "a")]})
        async with writer_held(engine), anyio.create_task_group() as tg:
            tg.start_soon(ends_unavailable, client.start_run({"workflow": name, "input": 4}))
            await eventually(lambda: protocol.inflight == 1, what="the start waiting")
            protocol.abort()
        assert len(ended) == 2 and isinstance(ended[1], Unavailable)
        assert protocol.inflight == 0


def test_a_start_and_its_audit_entry_commit_together(inproc: InProcDaemon) -> None:
    """One synced commit per start: its audit entry is written in the start's transaction.

    A re-found idempotency key is still audited (status 200, the original run);
    a refused start (unknown workflow) is audited with its status.
    """
    name = unique()
    _in(inproc, lambda c: c.register({"definitions": [task_def(name, "a")]}))
    storage = inproc.daemon.daemon.storage
    key = f"{name}:once"

    async def start_counting() -> tuple[dict[str, Any], int]:
        await storage.write(_nothing)  # commits whatever an earlier test left queued behind
        before = storage.statistics().commits
        answer = await InProcess(inproc.daemon.protocol).start_run(
            {"workflow": name, "input": None, "idempotency_key": key})
        return answer, storage.statistics().commits - before

    first, commits = inproc.run(start_counting)
    assert first["created"] is True and commits == 1
    again = _in(inproc, lambda c: c.start_run(
        {"workflow": name, "input": None, "idempotency_key": key}))
    assert again == {"run_id": first["run_id"], "created": False}
    refused = _raises(inproc, lambda c: c.start_run({"workflow": f"{name}-nope", "input": None}))
    assert type(refused).__name__ == "Unprocessable"

    def entries() -> list[dict[str, Any]]:
        page = _in(inproc, lambda c: c.audit(limit=1000))["entries"]
        return [e for e in page if e["action"] == "runs.start"]

    deadline = time.monotonic() + 5  # the refusal's entry is written behind (deferred)
    while not any(e["status"] == 422 for e in entries()) and time.monotonic() < deadline:
        time.sleep(0.02)
    mine = [(e["status"], e["target"]) for e in entries() if e["target"] == first["run_id"]]
    assert sorted(mine) == [(200, first["run_id"]), (201, first["run_id"])]
    assert any(e["status"] == 422 for e in entries())


def test_a_signal_and_a_cancel_commit_with_their_audit_entries(inproc: InProcDaemon) -> None:
    """Signal and cancel: one synced commit each, their audit entry inside it.

    A signal refused over budget writes nothing but its entry (409); a cancel
    of a finished run is refused (409 run_terminal) and audited as such.
    """
    name = unique()
    _in(inproc, lambda c: c.register({"definitions": [{
        "name": name, "budgets": {"max_state_bytes": 64},
        "steps": [{"id": "w", "kind": "wait", "event": "go", "into": "go"},
                  {"id": "w2", "kind": "wait", "event": "again", "into": "again"}]}]}))
    run_id = _in(inproc, lambda c: c.start_run({"workflow": name, "input": None}))["run_id"]
    storage = inproc.daemon.daemon.storage

    def counted(fn: Callable[[InProcess], Awaitable[Any]]) -> int:
        async def go() -> int:
            await storage.write(_nothing)  # commits whatever was left queued behind
            before = storage.statistics().commits
            await fn(InProcess(inproc.daemon.protocol))
            return storage.statistics().commits - before
        return int(inproc.run(go))

    assert counted(lambda c: c.signal(run_id, {"name": "go", "payload": "x"})) == 1
    refused = _raises(inproc, lambda c: c.signal(run_id, {"name": "again", "payload": "y" * 500}))
    assert isinstance(refused, SignalRefused)
    assert counted(lambda c: c.cancel(run_id)) == 1
    terminal = _raises(inproc, lambda c: c.cancel(run_id))
    assert isinstance(terminal, RunTerminal)

    page = _in(inproc, lambda c: c.audit(limit=1000))["entries"]
    mine = sorted((e["action"], e["status"]) for e in page if e["target"] == run_id)
    assert mine == sorted([("runs.start", 201), ("runs.signal", 200), ("runs.signal", 409),
                           ("runs.cancel", 200), ("runs.cancel", 409)])
