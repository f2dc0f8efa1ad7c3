"""A shutdown's `abort` reaching an HTTP request in flight through its task
(`Drain.task_tracking`: no cancel scope per request under stepd's uvicorn
protocol): the request is answered a whole 503 and the daemon stops cleanly;
a request that finished first keeps its answer.

A real daemon (`stepd.daemon.Server`) on 127.0.0.1, its storage writer held by
a write that waits on a gate, so that a start is in flight when the grace
period runs out.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import anyio
import anyio.from_thread
import httpx

from stepd.transport._drain import Drain

from .conftest import serve_in_process, task_def, unique


def test_an_aborted_request_is_answered_a_whole_503_and_the_daemon_stops(tmp_path: Path) -> None:
    from stepd.daemon import ServeConfig, Server

    daemon = Server(ServeConfig(data=str(tmp_path / "data"), port=0, max_request_ms=20_000),
                    announce=lambda line: None)
    holding, gate = threading.Event(), threading.Event()

    def held(txn: Any) -> None:
        holding.set()
        gate.wait(10)

    with anyio.from_thread.start_blocking_portal("asyncio") as portal:
        future, _ = portal.start_task(daemon.run)
        assert daemon.url is not None and daemon.protocol is not None
        protocol = daemon.protocol
        try:
            with httpx.Client(base_url=daemon.url, trust_env=False, timeout=15) as http:
                name = unique()
                http.post("/v1/api/workers/register",
                          json={"definitions": [task_def(name, "a")]}).raise_for_status()
                finished = http.post("/v1/api/runs", json={"workflow": name, "input": 1})
                assert finished.status_code == 201
                storage = protocol.daemon.storage

                def on_thread() -> None:  # held on the loop, it would hold the loop itself
                    storage.commit_on_loop = False

                portal.call(on_thread)
                writing: Future[Any] = portal.start_task_soon(storage.write, held)
                assert holding.wait(10), "the writer is held"
                answers: list[httpx.Response] = []

                def start() -> None:
                    with httpx.Client(base_url=daemon.url, trust_env=False, timeout=15) as c:
                        answers.append(c.post("/v1/api/runs", json={"workflow": name, "input": 2}))

                starter = threading.Thread(target=start)
                starter.start()
                for _ in range(500):  # bounded: the start is in flight behind the held writer
                    if portal.call(lambda: protocol.inflight) == 1:
                        break
                    threading.Event().wait(0.01)
                assert portal.call(lambda: protocol.inflight) == 1

                async def drain() -> bool:
                    return await protocol.drain(0.05)

                assert portal.call(drain) is False  # the grace ran out: aborted
                starter.join(15)
                (answer,) = answers
                assert answer.status_code == 503
                assert answer.json()["error"] == "unavailable"  # the whole body, parsed
                assert answer.headers["connection"] == "close"
                assert portal.call(lambda: protocol.inflight) == 0
        finally:
            gate.set()
        writing.result(timeout=10)
        portal.call(daemon.request_stop)
        assert future.result(timeout=15) == 0


async def _tracked_call(swallow: bool) -> tuple[bool, int, bool]:
    """A call in `task_tracking` that `abort` cancels while it waits: whether the
    block caught the cancel, the task's cancel requests left, and whether a wait
    after the block (where the answer is sent) still completes."""
    drain = Drain()
    waiting = asyncio.Event()

    async def call() -> tuple[bool, int, bool]:
        with drain.task_tracking() as tracked:
            waiting.set()
            try:
                await asyncio.Event().wait()  # until cancelled (the test bounds it)
            except asyncio.CancelledError:
                if not swallow:
                    raise
        task = asyncio.current_task()
        assert task is not None
        await asyncio.sleep(0)  # the answer's write: not cancelled
        return tracked.cancelled_caught, task.cancelling(), drain.inflight == 0

    task = asyncio.ensure_future(call())
    await waiting.wait()
    drain.abort()
    return await asyncio.wait_for(task, 5)


def test_an_abort_is_caught_by_its_block_and_never_reaches_past_it() -> None:
    assert asyncio.run(_tracked_call(swallow=False)) == (True, 0, True)


def test_a_cancel_the_call_swallowed_leaves_no_request_behind() -> None:
    assert asyncio.run(_tracked_call(swallow=True)) == (False, 0, True)


def test_a_cancel_of_the_request_from_elsewhere_is_not_swallowed() -> None:
    async def go() -> bool:
        drain = Drain()
        waiting = asyncio.Event()

        async def call() -> None:
            with drain.task_tracking():
                waiting.set()
                await asyncio.Event().wait()  # until cancelled (the test bounds it)

        task = asyncio.ensure_future(call())
        await waiting.wait()
        task.cancel()  # the server's, say
        drain.abort()  # and the drain's
        try:
            await asyncio.wait_for(task, 5)
        except asyncio.CancelledError:
            return task.cancelled() and drain.inflight == 0
        return False

    assert asyncio.run(go()) is True


def test_the_drain_ends_held_long_polls_through_their_tasks_with_503(tmp_path: Path) -> None:
    """A claim and a result long-poll held over HTTP end at once when the drain begins:
    503 ``unavailable``, the connection kept (it is the drain's answer, not an abort's),
    and nothing left counted in flight. Under stepd's uvicorn protocol they are ended
    through their tasks (`Drain.task_tracking` with ``poll``), not a cancel scope."""
    with contextlib.contextmanager(serve_in_process)(tmp_path / "data",
                                                     max_request_ms=20_000) as served:
        portal, url = served.portal, served.url
        protocol = served.daemon.protocol
        assert protocol is not None
        with httpx.Client(base_url=url, trust_env=False, timeout=15) as http:
            name = unique()
            wid = http.post("/v1/api/workers/register", json={
                "definitions": [task_def(name, "a")]}).json()["worker_id"]
            # A run of another workflow: nobody claims it, its result waits.
            other = unique()
            http.post("/v1/api/workers/register",
                      json={"definitions": [task_def(other, "b")]}).raise_for_status()
            run_id = http.post("/v1/api/runs", json={"workflow": other, "input": 1}).json()["run_id"]
            answers: dict[str, httpx.Response] = {}

            def claim() -> None:
                with httpx.Client(base_url=url, trust_env=False, timeout=15) as c:
                    answers["claim"] = c.post("/v1/api/steps/claim",
                                              json={"worker_id": wid, "wait_ms": 15_000})

            def result() -> None:
                with httpx.Client(base_url=url, trust_env=False, timeout=15) as c:
                    answers["result"] = c.get(f"/v1/api/runs/{run_id}/result",
                                              params={"wait_ms": 15_000})

            threads = [threading.Thread(target=claim), threading.Thread(target=result)]
            for t in threads:
                t.start()
            for _ in range(500):  # bounded: both long-polls are held
                if portal.call(lambda: protocol.inflight) == 2:
                    break
                threading.Event().wait(0.01)
            assert portal.call(lambda: protocol.inflight) == 2
            assert portal.call(lambda: len(protocol._task_polls)) == 2
            portal.call(protocol.begin_drain)
            for t in threads:
                t.join(10)
            assert sorted(answers) == ["claim", "result"]
            for answer in answers.values():
                assert answer.status_code == 503
                assert answer.json()["error"] == "unavailable"
                assert answer.headers.get("connection") != "close"
            assert portal.call(lambda: protocol.inflight) == 0
            assert portal.call(lambda: len(protocol._task_polls)) == 0
