"""The worker WebSocket against a real daemon, with the ``websockets`` client (PROTOCOL.md "WebSocket transport").

Register over both subprotocols, credit and pushed leases, ids echoed, the
answer frames (ok / conflict / error), cancel pushed when a run is cancelled,
a reconnect with the same ``worker_id`` keeping its lease, the session's
unoffered slots returned when a connection ends, and 1009 for an oversized
message.
"""

from __future__ import annotations

import time
from typing import Any

import msgpack
import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus

from .conftest import (
    DaemonProcess,
    Worker,
    WsWorker,
    start_run,
    task_def,
    unique,
    wait_result,
    ws_connect,
)

SUBPROTOCOLS = ["stepd.v1.msgpack", "stepd.v1.json"]


@pytest.mark.parametrize("subprotocol", SUBPROTOCOLS)
def test_register_credit_push_and_answer(daemon: DaemonProcess, subprotocol: str) -> None:
    name = unique()
    with ws_connect(daemon, subprotocol=subprotocol) as conn, daemon.client() as http:
        assert conn.subprotocol == subprotocol
        w = WsWorker(conn)
        reg = w.request("register", name="ws-worker", concurrency=4,
                        definitions=[task_def(name, "a", "b")])
        assert reg["op"] == "registered" and reg["id"] == 1
        assert reg["worker_id"].startswith("w_") and reg["lease_ttl_ms"] == 30_000
        assert reg["heartbeat_ms"] == 10_000 and reg["definitions"][0]["name"] == name
        w.send({"op": "credit", "n": 2})
        run_id = start_run(http, name, {"x": 1})
        lease = w.wait_for("lease")["lease"]
        assert lease["run_id"] == run_id and lease["step_id"] == "a"
        assert lease["input"] == {"x": 1}
        ok = w.request("started", lease_id=lease["lease_id"])
        assert ok == {"op": "ok", "id": 2}
        ok = w.request("heartbeat", lease_id=lease["lease_id"], progress=0.5)
        assert ok == {"op": "ok", "id": 3, "lease_ttl_ms": 30_000}
        ok = w.request("complete", lease_id=lease["lease_id"], output={"a": 1},
                       state_patch={"k": "v"})
        assert ok == {"op": "ok", "id": 4}
        second = w.wait_for("lease")["lease"]  # the second credit: pushed as it became runnable
        assert second["step_id"] == "b" and second["steps"] == {"a": {"a": 1}}
        w.request("started", lease_id=second["lease_id"])
        w.request("complete", lease_id=second["lease_id"], output="done")
        assert wait_result(http, run_id)["result"] == "done"
        journal = http.get(f"/v1/api/runs/{run_id}/journal").json()["events"]
        offered = [e for e in journal if e["type"] == "step_offered"]
        assert {e["worker_id"] for e in offered} == {reg["worker_id"]}


@pytest.mark.parametrize("delivery", ["at_least_once", "at_most_once"])
def test_frames_of_one_lease_are_applied_in_the_order_they_arrive(
        daemon: DaemonProcess, delivery: str) -> None:
    """`started`, `heartbeat` and `complete` sent back to back, unanswered: no not_started.

    at_most_once makes the daemon persist `started` (a synced commit) before
    it answers, so a `complete` handled beside it would find it not started.
    The answers come back in order too.
    """
    name = unique()
    with ws_connect(daemon) as conn, daemon.client() as http:
        w = WsWorker(conn)
        w.request("register", definitions=[task_def(name, "a", "b", delivery=delivery)])
        w.send({"op": "credit", "n": 2})
        run_id = start_run(http, name)
        for step, output in (("a", 1), ("b", "done")):
            lease = w.wait_for("lease")["lease"]
            assert lease["step_id"] == step
            ids = [w.next_id + 1, w.next_id + 2, w.next_id + 3]
            w.next_id += 3
            w.send({"op": "started", "id": ids[0], "lease_id": lease["lease_id"]})
            w.send({"op": "heartbeat", "id": ids[1], "lease_id": lease["lease_id"]})
            w.send({"op": "complete", "id": ids[2], "lease_id": lease["lease_id"],
                    "output": output})
            answers: list[dict[str, Any]] = []
            others: list[dict[str, Any]] = []
            while len(answers) < 3:  # bounded by recv's timeout
                frame = w.recv()
                (answers if frame.get("id") in ids else others).append(frame)
            w.pending.extend(others)  # the next lease, if it came first
            assert [(f["op"], f["id"]) for f in answers] == [("ok", i) for i in ids], answers
        assert wait_result(http, run_id)["result"] == "done"


def test_conflict_and_error_frames(daemon: DaemonProcess) -> None:
    name = unique()
    with ws_connect(daemon, subprotocol="stepd.v1.json") as conn, daemon.client() as http:
        w = WsWorker(conn)
        w.request("register", definitions=[task_def(name, "a", "b")])
        w.send({"op": "credit", "n": 1})
        start_run(http, name)
        lease = w.wait_for("lease")["lease"]["lease_id"]
        w.request("started", lease_id=lease)
        assert w.request("complete", lease_id=lease, output=1)["op"] == "ok"
        again = w.request("complete", lease_id=lease, output=1)
        assert again["op"] == "conflict" and again["reason"] == "already_applied"
        assert again["id"] == w.next_id and again["message"]
        bad = w.request("complete", lease_id=lease, outptu=1)
        assert bad == {"op": "error", "id": w.next_id, "status": 400,
                       "message": bad["message"], "field": "outptu"}
        missing = w.request("heartbeat", lease_id="l_01JDV5Z8Q3X4M6N7P8R9S0T1U2")
        assert missing["op"] == "error" and missing["status"] == 404
        no_lease = w.request("heartbeat")
        assert no_lease["status"] == 400 and no_lease["field"] == "lease_id"
        unknown = w.request("dance")
        assert unknown["op"] == "error" and unknown["field"] == "op"
        w.send({"op": "heartbeat", "lease_id": lease})  # no id: the answer cannot echo one
        assert w.wait_for("error")["field"] == "id"
        w.send({"op": "credit", "n": 0})
        assert w.wait_for("error")["field"] == "n"
        conn.send("{not json")
        assert w.wait_for("error")["status"] == 400
        conn.send(b"\x00binary on a json connection")
        assert w.wait_for("error")["status"] == 400
        # The connection is still fine after all that.
        assert w.request("heartbeat", lease_id=lease)["op"] == "conflict"


def test_credit_before_register_is_an_error(daemon: DaemonProcess) -> None:
    with ws_connect(daemon) as conn:
        w = WsWorker(conn)
        w.send({"op": "credit", "n": 1, "id": 9})
        err = w.wait_for("error")
        assert err["id"] == 9 and err["status"] == 400
        conn.send(msgpack.packb([1, 2, 3]))
        assert w.wait_for("error")["status"] == 400


def test_cancel_is_pushed_when_the_run_is_cancelled(daemon: DaemonProcess) -> None:
    name = unique()
    with ws_connect(daemon) as conn, daemon.client() as http:
        w = WsWorker(conn)
        w.request("register", definitions=[task_def(name, "a")])
        w.send({"op": "credit", "n": 1})
        run_id = start_run(http, name)
        lease = w.wait_for("lease")["lease"]["lease_id"]
        w.request("started", lease_id=lease)
        assert http.post(f"/v1/api/runs/{run_id}/cancel").status_code == 200
        cancel = w.wait_for("cancel")
        assert cancel == {"op": "cancel", "lease_id": lease, "reason": "run_terminal"}
        hb = w.request("heartbeat", lease_id=lease)
        assert hb["op"] == "conflict" and hb["reason"] == "run_terminal"


def test_a_reconnected_worker_keeps_its_lease(daemon: DaemonProcess) -> None:
    name = unique()
    with daemon.client() as http:
        with ws_connect(daemon) as conn:
            w = WsWorker(conn)
            worker_id = w.request("register", definitions=[task_def(name, "a")])["worker_id"]
            w.send({"op": "credit", "n": 1})
            run_id = start_run(http, name)
            lease = w.wait_for("lease")["lease"]["lease_id"]
            assert w.request("started", lease_id=lease)["op"] == "ok"
        # The first connection is gone; the lease is the worker's, not the connection's.
        with ws_connect(daemon, subprotocol="stepd.v1.json") as conn:
            w = WsWorker(conn)
            reg = w.request("register", worker_id=worker_id, definitions=[task_def(name, "a")])
            assert reg["worker_id"] == worker_id
            assert w.request("heartbeat", lease_id=lease)["op"] == "ok"
            assert w.request("complete", lease_id=lease, output="after")["op"] == "ok"
        assert wait_result(http, run_id)["result"] == "after"


def test_cancel_follows_the_worker_to_its_new_connection(daemon: DaemonProcess) -> None:
    name = unique()
    with daemon.client() as http, ws_connect(daemon) as first:
        w1 = WsWorker(first)
        worker_id = w1.request("register", definitions=[task_def(name, "a")])["worker_id"]
        w1.send({"op": "credit", "n": 1})
        run_id = start_run(http, name)
        lease = w1.wait_for("lease")["lease"]["lease_id"]
        with ws_connect(daemon) as second:
            w2 = WsWorker(second)
            w2.request("register", worker_id=worker_id, definitions=[task_def(name, "a")])
            first.close()  # the old connection ends after the new one registered
            http.post(f"/v1/api/runs/{run_id}/cancel")
            assert w2.wait_for("cancel")["lease_id"] == lease


def test_a_closed_session_returns_its_slots(daemon: DaemonProcess) -> None:
    name = unique()
    with daemon.client() as http:
        with ws_connect(daemon) as conn:
            w = WsWorker(conn)
            worker_id = w.request("register", definitions=[task_def(name, "a")])["worker_id"]
            w.send({"op": "credit", "n": 5})
            # Frames are read in order: once this is answered, the credit is parked.
            assert w.request("heartbeat", lease_id="l_0NOSUCHLEASE")["status"] == 404
        # The connection ended with 5 credits parked: a run started now must go to
        # a worker that is still there.
        deadline = time.monotonic() + 5
        while any(x["connected"] for x in http.get("/v1/api/workers").json()["workers"]
                  if x["worker_id"] == worker_id):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        other = Worker(http, [task_def(name, "a")])
        run_id = start_run(http, name)
        assert other.claim_one(run_id=run_id, wait_ms=1500)["run_id"] == run_id


def test_an_oversized_message_is_closed_with_1009(daemon: DaemonProcess) -> None:
    with ws_connect(daemon, subprotocol="stepd.v1.json") as conn:  # limit: 64 KiB + 4 KiB
        conn.send('{"op": "register", "id": 1, "name": "' + "x" * 100_000 + '"}')
        with pytest.raises(ConnectionClosed) as info:
            for _ in range(10):
                conn.recv(timeout=5)
        assert info.value.rcvd is not None and info.value.rcvd.code == 1009


def test_the_handshake_needs_a_known_subprotocol(daemon: DaemonProcess) -> None:
    from websockets.sync.client import connect

    url = daemon.ws_url
    with pytest.raises(InvalidStatus) as info:
        connect(url, proxy=None, open_timeout=5)
    assert info.value.response.status_code == 400
    with pytest.raises(InvalidStatus):
        connect(url, subprotocols=["stepd.v2"], proxy=None, open_timeout=5)  # type: ignore[list-item]
    with connect(url, subprotocols=["stepd.v1.json", "stepd.v1.msgpack"],  # type: ignore[list-item]
                 proxy=None, open_timeout=5) as conn:
        assert conn.subprotocol == "stepd.v1.msgpack"  # the daemon prefers msgpack


@pytest.mark.parametrize("subprotocol", SUBPROTOCOLS)
def test_the_complete_is_answered_before_the_next_lease_is_pushed(
        daemon: DaemonProcess, subprotocol: str) -> None:
    """The next step is offered inside the `complete`'s own call (the run's turn), yet
    the worker reads the `ok` first, then the lease, as a client that takes the next
    frame for its answer expects (transport/_ws_calls.py `_HELD`)."""
    name = unique()
    with ws_connect(daemon, subprotocol=subprotocol) as conn, daemon.client() as http:
        w = WsWorker(conn)
        w.request("register", definitions=[task_def(name, "a", "b", "c")])
        w.send({"op": "credit", "n": 1})
        run_id = start_run(http, name)
        lease = w.wait_for("lease")["lease"]
        for step, following in (("a", "b"), ("b", "c")):
            assert lease["step_id"] == step
            w.send({"op": "credit", "n": 1})
            w.send({"op": "complete", "id": 100, "lease_id": lease["lease_id"],
                    "output": step, "started": True})
            answer = w.recv_raw(10)
            assert answer == {"op": "ok", "id": 100}, answer
            nxt = w.recv_raw(10)
            assert nxt["op"] == "lease" and nxt["lease"]["step_id"] == following, nxt
            lease = nxt["lease"]
        w.request("complete", lease_id=lease["lease_id"], output="done", started=True)
        assert wait_result(http, run_id)["result"] == "done"
