"""Frames that arrive together are applied together (issue 13 item 5, "batching where it is free").

A worker that sends N ``complete`` frames in one write (its bodies finished in
the same turn) gets them applied in one dispatcher turn: their writes join ONE
synced commit, and their N answers leave in ONE socket write. Counted, not
timed: the storage's commit counter and the daemon protocol's count of socket
writes (`transport._uvicorn.WebSocketProtocol.data_writes`), on a real daemon
with real uvicorn on 127.0.0.1 and a raw socket client.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio.from_thread
import httpx
import msgpack
import pytest

from stepd.actors import _ref as actors_ref
from stepd.channels._wsproto import open_socket
from stepd.transport._uvicorn import WebSocketProtocol
from stepd.transport.websocket import WorkerConnection

from .conftest import InProcDaemon, serve_in_process, task_def, unique
from .test_ws_backpressure import RawWs

N = 16


@pytest.fixture
def no_fairness_yield(monkeypatch: pytest.MonkeyPatch) -> None:
    """The actor runtime yields to the loop once in `CHECKPOINT_EVERY` (64) asks, for
    fairness; a batch that such a yield falls in is applied in two turns (two
    commits, two writes). Pushed out of the way so the count is exact; the
    test without it bounds the split."""
    monkeypatch.setattr(actors_ref, "CHECKPOINT_EVERY", 1 << 30)


def _nothing(txn: Any) -> None:
    """A write that writes nothing: awaiting it commits the deferred writes queued before it."""


class _Watch:
    """The commit count at each socket write of one connection (read on the daemon's loop).

    It wraps the connection's real `send_frames` (which still writes): the
    count is taken as the answers leave, so deferred writes that follow the
    batch (its effects, written behind) cannot blur it.
    """

    def __init__(self, inproc: InProcDaemon, worker_id: str) -> None:
        self.writes: list[tuple[int, int]] = []  # (commits so far, frames in the write)
        self.commits = 0

        async def install() -> None:
            protocol = inproc.daemon.protocol
            storage = protocol.daemon.storage
            await storage.write(_nothing)  # settled: what was written behind is committed
            conns = [c for c in protocol._connections
                     if isinstance(c, WorkerConnection) and c.worker_id == worker_id]
            assert len(conns) == 1, conns
            wire = conns[0]._wire
            assert isinstance(wire, WebSocketProtocol), "stepd serve reads frames in its protocol"
            send_frames = wire.send_frames

            def watched(frames: list[bytes | str]) -> None:
                self.writes.append((storage.statistics().commits, len(frames)))
                send_frames(frames)

            wire.send_frames = watched  # type: ignore[method-assign]
            self.commits = storage.statistics().commits

        inproc.run(install)


def _leases(ws: RawWs, http: httpx.Client, name: str, n: int) -> list[dict[str, Any]]:
    for i in range(n):
        r = http.post("/v1/api/runs", json={"workflow": name, "input": {"i": i}})
        assert r.status_code == 201, r.text
    leases = []
    for _ in range(n):
        frame = ws.recv()
        assert frame["op"] == "lease", frame
        leases.append(frame["lease"])
    return leases


def _send_together(inproc: InProcDaemon, op: str) -> tuple[_Watch, list[dict[str, Any]]]:
    """Register, take N leases, send N `op` frames in one write; the watch and the answers."""
    name = unique()
    ws = RawWs(inproc.url)
    try:
        answer = ws.request({"op": "register", "id": 1, "definitions": [task_def(name, "a")]})
        assert answer["op"] == "registered", answer
        worker_id = answer["worker_id"]
        ws.send({"op": "credit", "n": N})
        with inproc.client() as http:
            leases = _leases(ws, http, name, N)
            body: dict[str, Any] = {"output": {"ok": True}} if op == "complete" else {}
            frames = b"".join(
                RawWs.frame(msgpack.packb({"op": op, "id": 100 + i, "lease_id": lease["lease_id"],
                                           **body}, use_bin_type=True))
                for i, lease in enumerate(leases))
            watch = _Watch(inproc, worker_id)
            ws.sock.sendall(frames)  # N frames, one write: they arrive together
            answers = [ws.recv() for _ in range(N)]
    finally:
        ws.close()
    assert sorted(a["id"] for a in answers) == list(range(100, 100 + N))
    assert all(a["op"] == "ok" for a in answers), answers
    return watch, answers


@pytest.mark.usefixtures("no_fairness_yield")
@pytest.mark.parametrize("op", ["complete", "heartbeat"])
def test_frames_sent_together_share_one_commit_and_one_socket_write(inproc: InProcDaemon,
                                                                     op: str) -> None:
    watch, _ = _send_together(inproc, op)
    writes = watch.writes
    print(f"{N} {op} frames sent together: {writes[0][0] - watch.commits} commit(s) before "
          f"the answers, {len(writes)} socket write(s) carrying {[n for _, n in writes]} frames")
    assert [n for _, n in writes] == [N], "the answers of one batch leave in one socket write"
    if op == "complete":
        assert writes[0][0] - watch.commits == 1, "the writes of one batch join one commit"
    else:
        assert writes[0][0] - watch.commits == 0, "a heartbeat is answered from memory"


def test_a_fairness_yield_splits_a_batch_in_two_at_most(inproc: InProcDaemon) -> None:
    """With the actor runtime's yield left in: at most two turns per batch of N."""
    for _ in range(3):
        watch, _ = _send_together(inproc, "complete")
        assert sum(n for _, n in watch.writes) == N
        assert len(watch.writes) <= 2, watch.writes
        assert watch.writes[-1][0] - watch.commits <= 2, watch.writes


def test_a_register_holds_back_the_frames_behind_it(inproc: InProcDaemon) -> None:
    """register, credit and a call in one write: applied in order (the credit finds the session)."""
    name = unique()
    ws = RawWs(inproc.url)
    try:
        ws.sock.sendall(
            RawWs.frame(msgpack.packb({"op": "register", "id": 1,
                                       "definitions": [task_def(name, "a")]}))
            + RawWs.frame(msgpack.packb({"op": "credit", "id": 2, "n": 1}))
            + RawWs.frame(msgpack.packb({"op": "heartbeat", "id": 3, "lease_id": "l_none"})))
        answers = [ws.recv() for _ in range(3)]
    finally:
        ws.close()
    assert [a["op"] for a in answers] == ["registered", "ok", "error"], answers
    assert [a["id"] for a in answers] == [1, 2, 3]
    assert answers[2]["status"] == 404


def test_the_worker_sends_the_frames_of_one_turn_in_one_write(inproc: InProcDaemon) -> None:
    """The worker's lean socket: N frames sent in one loop iteration (bodies that finished
    in the same turn) leave in ONE socket write, and the N answers, which the daemon
    sends in one write, are all handled in one ``data_received``."""

    async def go() -> tuple[int, int, list[dict[str, Any]]]:
        sock = await open_socket(inproc.url, None, subprotocol="stepd.v1.msgpack",
                                 max_size=1 << 20, path="/v1/api/workers/connect")
        answers: list[dict[str, Any]] = []
        all_in = asyncio.get_running_loop().create_future()

        def on_message(payload: bytes, binary: bool) -> None:
            answers.append(msgpack.unpackb(payload))
            if len(answers) == N and not all_in.done():
                all_in.set_result(None)

        sock.on_message = on_message
        try:
            writes, received = sock.writes, sock.received
            for i in range(N):
                sock.send(msgpack.packb({"op": "heartbeat", "id": i, "lease_id": f"l_{i}"}))
            await asyncio.wait_for(all_in, 10)
            return sock.writes - writes, sock.received - received, answers
        finally:
            sock.close(1000, "")
            sock.abort()

    with anyio.from_thread.start_blocking_portal("asyncio") as portal:
        writes, reads, answers = portal.call(go)
    assert sorted(a["id"] for a in answers) == list(range(N))
    assert all(a["op"] == "error" and a["status"] == 404 for a in answers), answers
    assert writes == 1, "the frames of one turn leave in one socket write"
    assert reads == 1, "the daemon's answers to one batch arrive (and are handled) together"


@pytest.fixture(scope="module")
def stock_uvicorn(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcDaemon]:
    """The daemon's app under uvicorn's own sans-I/O WebSocket protocol (as under any
    ASGI server): no `stepd.wire` extension, so frames come through ASGI ``receive``."""
    from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

    import stepd.daemon

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(stepd.daemon, "WebSocketProtocol", WebSocketsSansIOProtocol)
        yield from serve_in_process(Path(tmp_path_factory.mktemp("stock")) / "data")


def test_under_another_asgi_server_frames_come_through_receive(stock_uvicorn: InProcDaemon,
                                                              ) -> None:
    """The same frames and answers when the app reads through ASGI ``receive``."""
    test_a_register_holds_back_the_frames_behind_it(stock_uvicorn)
    name = unique()
    ws = RawWs(stock_uvicorn.url)
    try:
        answer = ws.request({"op": "register", "id": 1, "definitions": [task_def(name, "a")]})
        worker_id = answer["worker_id"]

        def wire() -> object:
            conns = [c for c in stock_uvicorn.daemon.protocol._connections
                     if isinstance(c, WorkerConnection) and c.worker_id == worker_id]
            return conns[0]._wire

        assert stock_uvicorn.run(wire) is None
        ws.send({"op": "credit", "n": 4})
        with stock_uvicorn.client() as http:
            leases = _leases(ws, http, name, 4)
        ws.sock.sendall(b"".join(
            RawWs.frame(msgpack.packb({"op": "complete", "id": 10 + i,
                                       "lease_id": lease["lease_id"], "output": i}))
            for i, lease in enumerate(leases)))
        answers = [ws.recv() for _ in range(4)]
    finally:
        ws.close()
    assert sorted(a["id"] for a in answers) == [10, 11, 12, 13]
    assert all(a["op"] == "ok" for a in answers), answers
