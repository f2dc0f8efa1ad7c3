"""The floor: what this machine's stack costs per step with no orchestration at all.

Run: ``python -m bench.floor [--rounds 3] [--steps 20000] [--workflows 5000]`` (about 25 s a round)

PEERS.md's targets ask for 5,000 steps/s over the WebSocket and 0.25 ms per
step embedded. Before arguing about which part of stepd to redesign, this
measures what the same stack does when it does *nothing* but carry a step:

* **WebSocket floor**: a bare ASGI app under uvicorn, configured as
  ``stepd serve`` is (uvloop, httptools, websockets-sansio, msgpack frames),
  in its own process. Per step it does what the daemon's transport must do
  at the least: receive ``started`` and ``complete`` frames (msgpack-decoded),
  answer each with ``ok``, and push the next ``lease`` frame (a map shaped as
  PROTOCOL.md's Lease). No storage, no actors, no task per frame, no credit
  frames (the next lease is pushed on ``complete``). The client (this
  process, ``websockets``) keeps 128 leases in flight, as B's worker does, and
  sends ``complete`` right behind ``started``.
* **HTTP floor, per workflow**: the same server answers ``POST /runs`` and
  ``GET /runs/{id}/result`` at once (JSON bodies as the daemon's); the client
  does one of each per workflow, 32 at a time, as B's client does.
* **Durable hand-over floor** (embedded A's): one synced LMDB commit per
  step, done on a writer thread and awaited from the event loop (the least a
  sequential durable step needs: its completion committed before the next
  step is offered), beside the same commit in a plain loop.
* **stepd**, in the same run: B over the WebSocket (``seq(3)`` x 1000,
  ``bench._workloads.workload_b``) and the daemon's CPU per step.

Rounds are interleaved (floor, stepd, floor, ...) and figures are medians;
CPU is each process's own (``/proc``), so the client's cost does not count
against the server's. The output is one JSON line per measurement and a
short table; bench/README.md "The floor" reads it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import queue
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import lmdb
import msgpack  # type: ignore[import-untyped]  # no stubs published

from bench._procs import Child, cpu_seconds
from bench._setups import network
from bench._workloads import warm_up, workload_b
from bench.engine import synced_commit_baseline

SUBPROTOCOL = "stepd.v1.msgpack"
IN_FLIGHT = 128
STARTS_IN_FLIGHT = 32


def lease_frame(n: int) -> dict[str, Any]:
    """A lease frame shaped as PROTOCOL.md's Lease, sized as B's (seq(3), small state)."""
    run = f"r_01JFLOOR{n // 3:017d}"
    return {"op": "lease", "lease": {
        "lease_id": f"l_01JFLOOR{n:017d}", "fence": 1, "run_id": run,
        "workflow": "seq3", "version": "seq3.v1", "definition_hash": "4c7a" * 16,
        "step_id": f"s{n % 3}", "body": "add", "attempt": 1, "item_index": None,
        "delivery": "at_least_once", "input": {"i": n % 3}, "steps": {},
        "state": {"acc": n % 3}, "correlation": {}, "idempotency_key": f"{run}/s{n % 3}",
        "trace_id": "0" * 32, "span_id": "0" * 16, "lease_ttl_ms": 30000, "timeout_ms": 60000}}


# --------------------------------------------------------------------------- the server


async def _ws(receive: Any, send: Any) -> None:
    packb, unpackb = msgpack.packb, msgpack.unpackb
    message = await receive()
    if message["type"] != "websocket.connect":
        return
    await send({"type": "websocket.accept", "subprotocol": SUBPROTOCOL})
    pushed = 0
    while True:
        message = await receive()
        if message["type"] == "websocket.disconnect":
            return
        frame = unpackb(message["bytes"], raw=False, strict_map_key=True)
        op = frame["op"]
        if op == "bye":  # the server closes: the client's close handshake would wait 10 s
            await send({"type": "websocket.close", "code": 1000})
            return
        if op == "credit":
            for _ in range(frame["n"]):
                await send({"type": "websocket.send", "bytes": packb(lease_frame(pushed))})
                pushed += 1
        elif op == "started":
            await send({"type": "websocket.send", "bytes": packb({"op": "ok", "id": frame["id"]})})
        elif op == "complete":
            await send({"type": "websocket.send", "bytes": packb({"op": "ok", "id": frame["id"]})})
            await send({"type": "websocket.send", "bytes": packb(lease_frame(pushed))})
            pushed += 1


async def _http(scope: dict[str, Any], receive: Any, send: Any) -> None:
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body", False):
            break
    if scope["method"] == "POST":
        json.loads(body)
        status, answer = 201, {"run_id": "r_01JFLOOR" + "0" * 17, "created": True}
    else:
        status, answer = 200, {"run_id": scope["path"].split("/")[2], "status": "completed",
                               "result": 3, "error": None}
    data = json.dumps(answer, separators=(",", ":")).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "websocket":
        await _ws(receive, send)
    elif scope["type"] == "http":
        await _http(scope, receive, send)


def serve() -> None:
    """The floor server (``python -m bench.floor serve``): uvicorn configured as ``stepd serve``."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)  # connections wait in the backlog until uvicorn accepts
    config = uvicorn.Config(app, http="httptools", ws="websockets-sansio", lifespan="off",
                            log_config=None, loop="uvloop", access_log=False)
    server = uvicorn.Server(config)
    print(f"floor listening on http://127.0.0.1:{sock.getsockname()[1]}", flush=True)
    server.run(sockets=[sock])


# --------------------------------------------------------------------------- the clients


async def ws_floor(url: str, steps: int) -> float:
    """Seconds for `steps` steps at IN_FLIGHT leases in flight over one WebSocket."""
    from websockets.asyncio.client import connect
    from websockets.typing import Subprotocol

    packb, unpackb = msgpack.packb, msgpack.unpackb
    async with connect(url.replace("http", "ws") + "/ws", subprotocols=[Subprotocol(SUBPROTOCOL)],
                       max_size=None, compression=None) as ws:
        await ws.send(packb({"op": "credit", "n": IN_FLIGHT}))
        done = 0
        next_id = 0
        t0 = time.perf_counter()
        while done < steps:
            frame = unpackb(await ws.recv(), raw=False)
            if frame["op"] == "lease":
                lease_id = frame["lease"]["lease_id"]
                await ws.send(packb({"op": "started", "id": next_id, "lease_id": lease_id}))
                await ws.send(packb({"op": "complete", "id": next_id + 1, "lease_id": lease_id,
                                     "output": 1, "state_patch": {"acc": 1}}))
                next_id += 2
            elif frame["op"] == "ok" and frame["id"] % 2 == 1:
                done += 1
        took = time.perf_counter() - t0
        await ws.send(packb({"op": "bye"}))
        async for _ in ws:  # the leases still in flight, then the server's close
            pass
    return took


async def http_floor(url: str, workflows: int) -> float:
    """Seconds for `workflows` start + result pairs, STARTS_IN_FLIGHT at once."""
    from bench._http import LeanHttp

    client = LeanHttp(url, STARTS_IN_FLIGHT)
    sem = asyncio.Semaphore(STARTS_IN_FLIGHT)

    async def one(i: int) -> None:
        async with sem:
            body = {"workflow": "seq3", "input": {}, "idempotency_key": f"floor-{i}"}
            run = await client.request("POST", "/runs", body)
            answer = await client.request("GET", f"/runs/{run['run_id']}/result?wait_ms=30000")
            if answer["result"] != 3:
                raise SystemExit(f"floor: a wrong result {answer!r}")

    try:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(workflows)))
        return time.perf_counter() - t0
    finally:
        await client.aclose()


def commit_floor(tmp: Path, tag: str, steps: int) -> tuple[float, float]:
    """Median ms of a synced commit: in a plain loop (`python -m bench`'s own baseline),
    and handed to a writer thread and awaited from the event loop."""
    plain = synced_commit_baseline(tmp / f"commit-plain-{tag}", steps)
    env = lmdb.open(str(tmp / f"commit-handed-{tag}"), map_size=64 << 20, sync=True)
    value = b"x" * 200  # as the baseline's

    # The writer thread and the loop hand each other one commit at a time, as a
    # sequential step does: a request in, the loop woken by call_soon_threadsafe.
    async def handed() -> list[float]:
        loop = asyncio.get_running_loop()
        inbox: queue.SimpleQueue[tuple[int, asyncio.Future[None]] | None] = queue.SimpleQueue()

        def writer() -> None:
            while (item := inbox.get()) is not None:
                i, fut = item
                with env.begin(write=True) as txn:
                    txn.put(i.to_bytes(8, "big"), value)
                loop.call_soon_threadsafe(fut.set_result, None)

        thread = threading.Thread(target=writer, name="floor-writer")
        thread.start()
        took = []
        try:
            for i in range(steps):
                fut: asyncio.Future[None] = loop.create_future()
                t = time.perf_counter()
                inbox.put((i, fut))
                await fut
                took.append(time.perf_counter() - t)
        finally:
            inbox.put(None)
            thread.join()
        return took

    over = asyncio.run(handed())
    env.close()
    return plain * 1000, statistics.median(over) * 1000


# --------------------------------------------------------------------------- the run


async def stepd_b(tmp: Path, tag: str, workflows: int, warm: bool = True) -> dict[str, Any]:
    async with network("websocket", tmp / f"data-{tag}", tmp, tag=tag) as s:
        if warm:
            await warm_up(s)
        b, _ = await workload_b(s, workflows)
    steps = b["workflows"] * b["steps_per_wf"]
    return {"steps_per_s": b["steps_per_s"], "daemon_cpu_us_per_step":
            round(b["cpu_s"]["daemon"] / steps * 1e6, 1), "daemon_cpu_s": b["cpu_s"]["daemon"]}


async def floor_round(tmp: Path, tag: str, steps: int, workflows: int) -> dict[str, Any]:
    server = Child(f"floor-{tag}", [sys.executable, "-m", "bench.floor", "serve"], tmp)
    try:
        url = server.wait_line(r"floor listening on (http://\S+)", 30).group(1)
        await ws_floor(url, min(300, steps))  # warm-up: connections, imports, caches
        cpu0 = cpu_seconds(server.pid)
        took = await ws_floor(url, steps)
        cpu1 = cpu_seconds(server.pid)
        await http_floor(url, 50)
        cpu2 = cpu_seconds(server.pid)
        took_http = await http_floor(url, workflows)
        cpu3 = cpu_seconds(server.pid)
    finally:
        server.stop()
    return {"ws_steps_per_s": round(steps / took, 1),
            "ws_server_cpu_us_per_step": round((cpu1 - cpu0) / steps * 1e6, 1),
            "http_workflows_per_s": round(workflows / took_http, 1),
            "http_server_cpu_us_per_workflow": round((cpu3 - cpu2) / workflows * 1e6, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", nargs="?", choices=["serve"], help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=3)
    # Many more than B's: /proc counts CPU in 10 ms ticks, and the floor is fast.
    parser.add_argument("--steps", type=int, default=20000, help="WebSocket floor steps")
    parser.add_argument("--workflows", type=int, default=5000, help="HTTP floor workflows")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: one small round (figures too coarse to read)")
    args = parser.parse_args()
    if args.command == "serve":
        serve()
        return
    import uvloop

    b_workflows = 1000
    if args.quick:
        args.rounds, args.steps, args.workflows, b_workflows = 1, 500, 100, 50
    rows: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="stepd-floor-") as raw:
        tmp = Path(raw)
        for r in range(args.rounds):
            floor = uvloop.run(floor_round(tmp, str(r), args.steps, args.workflows))
            plain, handed = commit_floor(tmp, str(r), 50 if args.quick else 500)
            floor.update({"commit_ms_plain": round(plain, 3), "commit_ms_handed": round(handed, 3)})
            ours = uvloop.run(stepd_b(tmp, str(r), b_workflows, not args.quick))
            print(json.dumps({"round": r, "floor": floor, "stepd_ws_b": ours}), flush=True)
            for k, v in floor.items():
                rows.setdefault(k, []).append(v)
            for k, v in ours.items():
                rows.setdefault("stepd_" + k, []).append(v)
    med = {k: statistics.median(v) for k, v in rows.items()}
    per_wf_share = med["http_server_cpu_us_per_workflow"] / 3
    floor_step = med["ws_server_cpu_us_per_step"] + per_wf_share
    print(json.dumps({"medians": med}), flush=True)
    print(f"""
medians of {args.rounds} interleaved rounds
  WebSocket floor: {med['ws_steps_per_s']:,.0f} steps/s, server CPU {med['ws_server_cpu_us_per_step']:.0f} us/step
  HTTP floor: {med['http_workflows_per_s']:,.0f} start+result pairs/s, server CPU {med['http_server_cpu_us_per_workflow']:.0f} us/workflow
  floor for B (seq(3)): {floor_step:.0f} us of server CPU per step = at most {1e6 / floor_step:,.0f} steps/s on one core
  stepd B over WebSocket: {med['stepd_steps_per_s']:,.0f} steps/s, daemon CPU {med['stepd_daemon_cpu_us_per_step']:.0f} us/step ({med['stepd_daemon_cpu_us_per_step'] / floor_step:.1f}x the floor)
  5,000 steps/s leaves 200 us/step: {200 - floor_step:.0f} us beside the floor for everything stepd does
  synced commit: {med['commit_ms_plain']:.3f} ms in a plain loop, {med['commit_ms_handed']:.3f} ms handed to a thread and awaited
  embedded A's 0.25 ms leaves {250 - med['commit_ms_handed'] * 1000:.0f} us beside the handed commit""")


if __name__ == "__main__":
    main()
