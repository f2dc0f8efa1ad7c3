"""The worker WebSocket under stress: concurrent frames, a peer that goes silent.

* Frames of one connection are answered concurrently: a slow ``complete``
  (the engine call delayed on purpose) does not hold up a heartbeat of
  another lease sent after it.
* A peer that stops answering pings is closed after ``ws_ping_interval`` +
  ``ws_ping_timeout`` (here 200 + 200 ms), and the credit its session had
  parked goes back: the next run is offered to a worker that is still there.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import msgpack
import pytest
from websockets.client import ClientProtocol
from websockets.frames import Frame, Opcode
from websockets.uri import parse_uri

from stepd.sansio.lease import Op

from .conftest import (
    DaemonProcess,
    InProcDaemon,
    Worker,
    WsWorker,
    start_daemon,
    start_run,
    task_def,
    unique,
)


def test_a_slow_complete_does_not_hold_up_other_frames(inproc: InProcDaemon) -> None:
    from websockets.sync.client import connect

    engine = inproc.daemon.daemon
    original = engine.lease_call

    async def slow(lease_id: str, op: Op, body: Any = None, *, caller: str | None = None) -> Any:
        if op is Op.COMPLETE:
            await anyio.sleep(0.8)
        return await original(lease_id, op, body, caller=caller)

    name = unique()
    ws_url = inproc.url.replace("http://", "ws://") + "/v1/api/workers/connect"
    with inproc.client() as http, connect(ws_url, subprotocols=["stepd.v1.msgpack"],  # type: ignore[list-item]
                                          proxy=None, open_timeout=5) as conn:
        w = WsWorker(conn)
        w.request("register", definitions=[task_def(name, "a")])
        w.send({"op": "credit", "n": 2})
        for _ in range(2):
            start_run(http, name)
        a = w.wait_for("lease")["lease"]["lease_id"]
        b = w.wait_for("lease")["lease"]["lease_id"]
        w.request("started", lease_id=a)
        w.request("started", lease_id=b)
        inproc.run(setattr, engine, "lease_call", slow)
        try:
            w.send({"op": "complete", "id": 100, "lease_id": a, "output": 1})
            w.send({"op": "heartbeat", "id": 101, "lease_id": b})
            first = w.recv_raw(5)  # sent second, answered first: not queued behind it
            assert first["id"] == 101 and first["op"] == "ok"
            second = w.recv_raw(5)
            assert second == {"op": "ok", "id": 100}
        finally:
            inproc.run(delattr, engine, "lease_call")  # back to the class's method


@pytest.fixture
def pinging(tmp_path: Path) -> Iterator[DaemonProcess]:
    d = start_daemon(tmp_path / "data", "--ws-ping-interval-ms", "200",
                     "--ws-ping-timeout-ms", "200")
    yield d
    assert d.stop() == 0, d.stderr()
    d.assert_quiet_log()


class SilentPeer:
    """A WebSocket client built on websockets' sans-I/O protocol that can stop answering."""

    def __init__(self, d: DaemonProcess) -> None:
        url = parse_uri(d.ws_url)
        self.sock = socket.create_connection((url.host, url.port), timeout=5)
        self.proto = ClientProtocol(url, subprotocols=["stepd.v1.msgpack"])  # type: ignore[list-item]
        self.proto.send_request(self.proto.connect())
        self._flush()
        while self.proto.handshake_exc is None and self.proto.state.name == "CONNECTING":
            self.proto.receive_data(self.sock.recv(65536))
        assert self.proto.handshake_exc is None, self.proto.handshake_exc
        self.proto.events_received()  # the handshake response

    def _flush(self) -> None:
        for data in self.proto.data_to_send():
            if data:
                self.sock.sendall(data)

    def send(self, frame: dict[str, Any]) -> None:
        self.proto.send_binary(msgpack.packb(frame, use_bin_type=True))
        self._flush()

    def recv(self) -> dict[str, Any]:
        while True:
            for event in self.proto.events_received():
                if isinstance(event, Frame) and event.opcode is Opcode.BINARY:
                    return dict(msgpack.unpackb(event.data, raw=False))
            self._flush()  # pongs
            self.proto.receive_data(self.sock.recv(65536))


def test_a_silent_peer_is_closed_and_its_credit_returned(pinging: DaemonProcess) -> None:
    name = unique()
    peer = SilentPeer(pinging)
    try:
        peer.send({"op": "register", "id": 1, "definitions": [task_def(name, "a")]})
        worker_id = peer.recv()["worker_id"]
        peer.send({"op": "credit", "n": 3})
        peer.send({"op": "heartbeat", "id": 2, "lease_id": "l_0NOSUCHLEASE"})
        assert peer.recv()["status"] == 404  # frames are read in order: the credit is parked
        # From now on the peer reads nothing and answers no ping.
        with pinging.client() as http:
            deadline = time.monotonic() + 5
            while True:
                workers = http.get("/v1/api/workers").json()["workers"]
                me = next(x for x in workers if x["worker_id"] == worker_id)
                if not me["connected"]:
                    break
                assert time.monotonic() < deadline, "the silent peer was never closed"
                time.sleep(0.05)
            other = Worker(http, [task_def(name, "a")])
            run_id = start_run(http, name)
            assert other.claim_one(run_id=run_id, wait_ms=1000)["run_id"] == run_id
    finally:
        peer.sock.close()
