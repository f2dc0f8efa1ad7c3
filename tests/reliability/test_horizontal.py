"""Four workers racing over the network; a paused worker is fenced (anchors L1).

One ``stepd serve`` subprocess on 127.0.0.1, four SDK-less workers: two over
HTTP long-poll (`claim`), two over the WebSocket (msgpack frames, `credit`
and pushed leases), following PROTOCOL.md only.

* ``test_four_workers_complete_each_attempt_once``: the four workers wait
  for work, then four runs of a ``for_each`` over 25 items each (100 item
  attempts, then a task that sums the items' outputs) are started, and the
  workers race for the same slots. Now and then a worker sends its
  ``complete`` twice (a retry after a lost answer): the second must get 409
  ``already_applied``. Checked: no lease handed to two workers, no lease
  accepted twice, one accepted completion per (run, step, item), and each
  journal holds exactly the accepted completions, once each, in the order the
  run's result shows.
* ``test_a_paused_worker_is_fenced``: worker A (half its leases over HTTP,
  half over the WebSocket) claims the only step of 24 runs, calls
  ``started`` and then stops heartbeating, holding the leases past the TTL.
  Each step is recovered and re-leased (attempt 2, higher fence) to worker B
  (HTTP and WebSocket too). A then comes back: for half the runs before B
  completes, for the other half after. Every late ``complete`` and
  ``heartbeat`` of A must get 409 ``fenced``, every ``complete`` of B 200, and
  each run records exactly one completion, B's.

Fault model: worker pauses (no heartbeat) and duplicate sends; the daemon and
the network stay up. Each test prints a summary line; an empty history fails.
"""

from __future__ import annotations

import functools
import random
import statistics
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.transport.conftest import Worker, WsWorker, ws_connect

from .conftest import DaemonProcess, seed_from_env, start_daemon, stop_daemon

pytestmark = pytest.mark.slow

TTL_MS = 1500
DAEMON_ARGS = ("--lease-ttl-ms", str(TTL_MS), "--heartbeat-ms", "500",
               "--recovery-window-ms", "300", "--max-request-ms", "2000")
RUNS = 4
ITEMS = 25
DUPLICATE_RATE = 0.2
STALE = 24  # leases worker A holds past their TTL (half HTTP, half WebSocket)
DEADLINE_S = 30.0
MODES = ("before", "after", "together")

Call = Callable[[str, dict[str, Any]], tuple[str, Any]]  # op, body -> ("ok"|"conflict"|"error", x)


@pytest.fixture(scope="module")
def d(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    daemon = start_daemon(tmp_path_factory.mktemp("horizontal") / "data", *DAEMON_ARGS)
    try:
        yield daemon
    finally:
        status = stop_daemon(daemon)
    assert status == 0, daemon.stderr()
    daemon.assert_quiet_log()


def http_call(worker: Worker) -> Callable[[str], Call]:
    def bind(lease_id: str) -> Call:
        def call(op: str, body: dict[str, Any]) -> tuple[str, Any]:
            r = worker.call(lease_id, op, body)
            if r.status_code == 200:
                return "ok", r.json()
            if r.status_code == 409:
                return "conflict", r.json()["reason"]
            return "error", f"{r.status_code} {r.text[:200]}"
        return call
    return bind


def ws_call(ws: WsWorker) -> Callable[[str], Call]:
    def bind(lease_id: str) -> Call:
        def call(op: str, body: dict[str, Any]) -> tuple[str, Any]:
            answer = ws.request(op, lease_id=lease_id, **body)
            if answer["op"] == "ok":
                return "ok", answer
            if answer["op"] == "conflict":
                return "conflict", answer["reason"]
            return "error", answer
        return call
    return bind


class Threads:
    """Client threads whose exceptions fail the test (bounded joins)."""

    def __init__(self) -> None:
        self.threads: list[threading.Thread] = []
        self.errors: list[BaseException] = []

    def start(self, name: str, fn: Callable[[], None]) -> None:
        def run() -> None:
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001 - handed to the test below
                self.errors.append(exc)

        t = threading.Thread(target=run, name=name, daemon=True)
        self.threads.append(t)
        t.start()

    def join(self) -> None:
        for t in self.threads:
            t.join(15)
        assert not [t.name for t in self.threads if t.is_alive()], "a worker thread did not stop"
        if self.errors:
            raise self.errors[0]


# --------------------------------------------------------------------------- the race


def race_definition(name: str) -> dict[str, Any]:
    return {"name": name, "steps": [
        {"id": "fan", "kind": "for_each", "items": "${input.items}", "body": "double",
         "into": "results", "input": {"x": "${item}", "i": "${item_index}"},
         "retry": {"max_attempts": 10, "initial_backoff_ms": 0}},
        {"id": "total", "kind": "task", "body": "total", "input": "${steps.fan}"},
    ]}


@dataclass
class RaceHistory:
    lock: threading.Lock = field(default_factory=threading.Lock)
    offered: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    accepted: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))  # lease -> workers
    slots: dict[tuple[str, str, Any], list[str]] = field(
        default_factory=lambda: defaultdict(list))  # (run, step, item) -> accepted leases
    outputs: dict[str, Any] = field(default_factory=dict)  # lease -> output accepted
    refused: Counter[str] = field(default_factory=Counter)  # "op:reason"
    duplicates_sent: int = 0
    duplicates_refused: int = 0
    errors: list[str] = field(default_factory=list)
    by_worker: Counter[str] = field(default_factory=Counter)


class Racer:
    def __init__(self, name: str, history: RaceHistory, rng: random.Random) -> None:
        self.name = name
        self.h = history
        self.rng = rng

    def handle(self, lease: dict[str, Any], call: Call) -> None:
        lease_id = lease["lease_id"]
        with self.h.lock:
            self.h.offered[lease_id].append(self.name)
        kind, x = call("started", {})
        if kind != "ok":
            self._refused("started", kind, x)
            return
        time.sleep(self.rng.random() * 0.003)  # jitter: vary who gets which slot
        if lease["body"] == "double":
            out: dict[str, Any] = {"v": 2 * lease["input"]["x"], "i": lease["input"]["i"]}
        else:
            out = {"v": sum(o["v"] for o in lease["input"])}
        out.update(lease_id=lease_id, worker=self.name)
        kind, x = call("complete", {"output": out})
        if kind != "ok":
            self._refused("complete", kind, x)
            return
        with self.h.lock:
            self.h.accepted[lease_id].append(self.name)
            self.h.slots[(lease["run_id"], lease["step_id"], lease["item_index"])].append(lease_id)
            self.h.outputs[lease_id] = out
            self.h.by_worker[self.name] += 1
        if self.rng.random() < DUPLICATE_RATE:  # the answer "got lost": send it again
            kind, x = call("complete", {"output": out})
            with self.h.lock:
                self.h.duplicates_sent += 1
                if (kind, x) == ("conflict", "already_applied"):
                    self.h.duplicates_refused += 1
                elif kind == "ok":
                    self.h.accepted[lease_id].append(self.name)
                else:
                    self.h.errors.append(f"duplicate complete {lease_id}: {kind} {x}")

    def _refused(self, op: str, kind: str, x: Any) -> None:
        with self.h.lock:
            if kind == "conflict":
                self.h.refused[f"{op}:{x}"] += 1
            else:
                self.h.errors.append(f"{self.name} {op}: {kind} {x}")


def test_four_workers_complete_each_attempt_once(d: DaemonProcess, summary: Any) -> None:
    seed = seed_from_env(20261129)
    t0 = time.monotonic()
    name = f"race-{uuid.uuid4().hex[:8]}"
    defs = [race_definition(name)]
    history = RaceHistory()
    stop = threading.Event()
    ready = threading.Barrier(5, timeout=15)
    threads = Threads()

    def http_racer(index: int) -> None:
        racer = Racer(f"http-{index}", history, random.Random(seed + index))
        with d.client() as client:
            worker = Worker(client, defs, name=racer.name, concurrency=4)
            bind = http_call(worker)
            ready.wait()
            while not stop.is_set():
                for lease in worker.claim(max=4, wait_ms=300):
                    racer.handle(lease, bind(lease["lease_id"]))

    def ws_racer(index: int) -> None:
        racer = Racer(f"ws-{index}", history, random.Random(seed + 10 + index))
        with ws_connect(d) as conn:
            ws = WsWorker(conn)
            reg = ws.request("register", name=racer.name, concurrency=4, definitions=defs)
            assert reg["op"] == "registered", reg
            bind = ws_call(ws)
            ws.send({"op": "credit", "n": 4})
            ready.wait()
            while not stop.is_set():
                try:
                    frame = ws.wait_for("lease", timeout=0.3)
                except TimeoutError:
                    continue
                racer.handle(frame["lease"], bind(frame["lease"]["lease_id"]))
                ws.send({"op": "credit", "n": 1})

    for i in range(2):
        threads.start(f"http-{i}", functools.partial(http_racer, i))
        threads.start(f"ws-{i}", functools.partial(ws_racer, i))
    items = {r: [r * 1000 + k for k in range(ITEMS)] for r in range(RUNS)}
    results: dict[str, dict[str, Any]] = {}
    runs: dict[str, list[int]] = {}
    try:
        ready.wait()  # every worker registered and waiting for work
        with d.client() as client:
            for r in range(RUNS):
                resp = client.post("/v1/api/runs", json={"workflow": name,
                                                         "input": {"items": items[r]}})
                assert resp.status_code == 201, resp.text
                runs[resp.json()["run_id"]] = items[r]
            deadline = time.monotonic() + DEADLINE_S
            for run_id in runs:
                while time.monotonic() < deadline:
                    body = client.get(f"/v1/api/runs/{run_id}/result",
                                      params={"wait_ms": 1000}).json()
                    if body["status"] != "running":
                        break
                results[run_id] = body
            stop.set()
            threads.join()
            journals = {run_id: client.get(f"/v1/api/runs/{run_id}/journal").json()["events"]
                        for run_id in runs}
            states = {run_id: client.get(f"/v1/api/runs/{run_id}").json()["state"]
                      for run_id in runs}
    finally:
        stop.set()
        threads.join()

    # ------------------------------------------------------------------ check
    handed_twice = [lid for lid, ws in history.offered.items() if len(ws) > 1]
    accepted_twice = [lid for lid, ws in history.accepted.items() if len(ws) > 1]
    slot_twice = [k for k, leases in history.slots.items() if len(leases) > 1]
    journal_twice = []
    not_journaled = []
    journal_not_accepted = []
    wrong: list[Any] = []
    journaled: set[str] = set()
    for run_id, events in journals.items():
        # An attempt's completion names its lease; the for_each step's own
        # completion (all items in) names none, and must appear once too.
        done = [e for e in events if e["type"] == "step_completed" and "lease_id" in e]
        steps_done = Counter(e["step_id"] for e in events
                             if e["type"] == "step_completed" and "lease_id" not in e)
        per_slot = Counter((e["step_id"], e.get("item_index")) for e in done)
        journal_twice += [(run_id, k) for k, c in per_slot.items() if c > 1]
        if steps_done != Counter({"fan": 1}):
            wrong.append((run_id, "for_each step completions", steps_done))
        journaled |= {e["lease_id"] for e in done}
        journal_not_accepted += [e["lease_id"] for e in done if e["lease_id"] not in history.accepted]
        want = [2 * x for x in runs[run_id]]
        kept = states[run_id].get("results") or []
        if ([o.get("v") for o in kept] != want
                or [o.get("i") for o in kept] != list(range(ITEMS))
                or results[run_id].get("status") != "completed"
                or (results[run_id].get("result") or {}).get("v") != sum(want)):
            wrong.append((run_id, results[run_id]))
        for o in kept:  # the output the run kept is the one its lease's worker had accepted
            if history.outputs.get(o.get("lease_id")) != o:
                wrong.append((run_id, "kept output differs from the accepted one", o))
    not_journaled = [lid for lid in history.accepted if lid not in journaled]
    accepted = sum(len(ws) for ws in history.accepted.values())
    line = (
        f"H-race seed={seed} workers=4 (http 2, ws 2) runs={RUNS} items={RUNS * ITEMS} "
        f"leases={len(history.offered)} accepted={accepted} "
        f"by-worker={dict(sorted(history.by_worker.items()))} "
        f"duplicates-sent={history.duplicates_sent} (refused already_applied "
        f"{history.duplicates_refused}) handed-twice={len(handed_twice)} "
        f"accepted-twice={len(accepted_twice)} slot-twice={len(slot_twice)} "
        f"journal-twice={len(journal_twice)} lost={len(not_journaled)} "
        f"unexpected={len(journal_not_accepted)} refused={dict(history.refused)} "
        f"elapsed={time.monotonic() - t0:.1f}s"
    )
    summary(line)
    assert accepted > 0, "empty history: " + line
    assert not history.errors, history.errors[:5]
    assert not handed_twice, handed_twice[:5]
    assert not accepted_twice, accepted_twice[:5]
    assert not slot_twice, slot_twice[:5]
    assert not journal_twice, journal_twice[:5]
    assert not not_journaled, not_journaled[:5]
    assert not journal_not_accepted, journal_not_accepted[:5]
    assert not wrong, wrong[:3]
    assert history.duplicates_refused == history.duplicates_sent
    assert len(history.slots) == RUNS * (ITEMS + 1)  # every item and every total, once
    assert sum(1 for c in history.by_worker.values() if c) >= 2, "no race: one worker did it all"


# --------------------------------------------------------------------------- L1: fencing


def fence_definition(name: str) -> dict[str, Any]:
    return {"name": name, "steps": [{"id": "t", "kind": "task", "body": "t",
                                     "retry": {"max_attempts": 5, "initial_backoff_ms": 0}}]}


@dataclass
class Held:
    lease: dict[str, Any]
    call: Call
    transport: str
    at: float  # when the lease reached the worker (monotonic)


def _collect(http: Worker, ws: WsWorker, n_http: int, n_ws: int, deadline: float) -> list[Held]:
    """``n_ws`` pushed and ``n_http`` claimed leases, each ``started`` once all are in."""
    held: list[Held] = []
    bind_http, bind_ws = http_call(http), ws_call(ws)
    got_http = got_ws = 0
    while (got_http < n_http or got_ws < n_ws) and time.monotonic() < deadline:
        if got_ws < n_ws:
            try:
                frame = ws.wait_for("lease", timeout=0.05)
            except TimeoutError:
                pass
            else:
                lease = frame["lease"]
                held.append(Held(lease, bind_ws(lease["lease_id"]), "ws", time.monotonic()))
                got_ws += 1
        if got_http < n_http:
            for lease in http.claim(max=n_http - got_http, wait_ms=50):
                held.append(Held(lease, bind_http(lease["lease_id"]), "http", time.monotonic()))
                got_http += 1
    assert (got_http, got_ws) == (n_http, n_ws), "leases not offered in time"
    for h in held:
        kind, x = h.call("started", {})
        assert kind == "ok", (h.lease, x)
    return held


def test_a_paused_worker_is_fenced(d: DaemonProcess, summary: Any) -> None:
    t0 = time.monotonic()
    name = f"fence-{uuid.uuid4().hex[:8]}"
    defs = [fence_definition(name)]
    half = STALE // 2
    with d.client() as client, ws_connect(d) as a_conn, ws_connect(d) as b_conn:
        # Worker A: half its leases over HTTP, half over the WebSocket.
        a_http = Worker(client, defs, name="paused-http")
        a_ws = WsWorker(a_conn)
        assert a_ws.request("register", name="paused-ws", definitions=defs)["op"] == "registered"
        a_ws.send({"op": "credit", "n": half})
        runs = []
        for k in range(STALE):
            r = client.post("/v1/api/runs", json={"workflow": name, "input": {"k": k}})
            assert r.status_code == 201, r.text
            runs.append(r.json()["run_id"])
        paused = _collect(a_http, a_ws, half, half, time.monotonic() + 10)
        assert sorted(h.lease["run_id"] for h in paused) == sorted(runs)
        paused_at = time.monotonic()  # A's last word on these leases: `started`
        # ... and from now on A is silent: no heartbeat. B joins only now, so it can
        # be offered nothing but the attempts recovered from A.
        b_http = Worker(client, defs, name="winner-http")
        b_ws = WsWorker(b_conn)
        assert b_ws.request("register", name="winner-ws", definitions=defs)["op"] == "registered"
        b_ws.send({"op": "credit", "n": half})
        winners = _collect(b_http, b_ws, half, half, time.monotonic() + 10 + TTL_MS / 1000)
        relet_s = sorted(w.at - paused_at for w in winners)

        of_run = {h.lease["run_id"]: h for h in paused}
        outcome: Counter[str] = Counter()
        modes: Counter[str] = Counter()
        bad: list[Any] = []
        for i, b in enumerate(sorted(winners, key=lambda w: runs.index(w.lease["run_id"]))):
            a = of_run[b.lease["run_id"]]
            if not (b.lease["attempt"] == a.lease["attempt"] + 1 and b.lease["fence"] > a.lease["fence"]):
                bad.append(("not a later attempt", a.lease, b.lease))
            # A comes back before B completes, after, or at the same moment.
            mode = MODES[i % len(MODES)]
            a_out = {"by": "A", "lease_id": a.lease["lease_id"]}
            b_out = {"by": "B", "lease_id": b.lease["lease_id"]}
            answers: dict[str, tuple[str, Any]] = {}
            if mode == "before":
                answers["a_complete"] = a.call("complete", {"output": a_out})
                answers["b_complete"] = b.call("complete", {"output": b_out})
            elif mode == "after":
                answers["b_complete"] = b.call("complete", {"output": b_out})
                answers["a_complete"] = a.call("complete", {"output": a_out})
            else:
                go = threading.Barrier(2, timeout=5)

                def a_late(a: Held = a, out: dict[str, Any] = a_out,
                           go: threading.Barrier = go,
                           answers: dict[str, tuple[str, Any]] = answers) -> None:
                    go.wait()
                    answers["a_complete"] = a.call("complete", {"output": out})

                t = threading.Thread(target=a_late, daemon=True)
                t.start()
                go.wait()
                answers["b_complete"] = b.call("complete", {"output": b_out})
                t.join(10)
                assert "a_complete" in answers, "the late complete got no answer"
            modes[mode] += 1
            answers["a_heartbeat"] = a.call("heartbeat", {})
            answers["a_fail"] = a.call("fail", {"error": {"class": "fatal", "message": "late"}})
            for what, got in answers.items():
                want = ("ok", None) if what == "b_complete" else ("conflict", "fenced")
                got_short = (got[0], None if got[0] == "ok" else got[1])
                outcome[f"{what}:{got_short[1] or got_short[0]}"] += 1
                if got_short != want:
                    bad.append((b.lease["run_id"], what, mode, a.transport, b.transport, got))
        cancels = sum(1 for f in a_ws.pending if f.get("op") == "cancel")
        results = {}
        journals = {}
        for run_id in runs:
            results[run_id] = client.get(f"/v1/api/runs/{run_id}/result",
                                         params={"wait_ms": 1000}).json()
            journals[run_id] = client.get(f"/v1/api/runs/{run_id}/journal").json()["events"]

    recorded_once = 0
    for run_id in runs:
        a, b = of_run[run_id], next(w for w in winners if w.lease["run_id"] == run_id)
        events = journals[run_id]
        done = [e["lease_id"] for e in events if e["type"] == "step_completed"]
        types = [e["type"] for e in events]
        if done == [b.lease["lease_id"]]:
            recorded_once += 1
        else:
            bad.append((run_id, "step_completed leases", done))
        if "step_orphaned" not in types or "step_recovered" not in types:
            bad.append((run_id, "no orphaned/recovered in the journal", types))
        if results[run_id] != {"run_id": run_id, "status": "completed", "error": None,
                               "result": {"by": "B", "lease_id": b.lease["lease_id"]}}:
            bad.append((run_id, "result", results[run_id]))
    stale_accepted = outcome["a_complete:ok"]
    line = (
        f"L1 stale-leases={STALE} (http {half}, ws {half}) "
        f"late-complete-fenced={outcome['a_complete:fenced']}/{STALE} "
        f"(late {modes['before']} before the winner's, {modes['after']} after, "
        f"{modes['together']} at once) "
        f"late-heartbeat-fenced={outcome['a_heartbeat:fenced']}/{STALE} "
        f"late-fail-fenced={outcome['a_fail:fenced']}/{STALE} stale-accepted={stale_accepted} "
        f"winner-accepted={outcome['b_complete:ok']}/{STALE} recorded-once={recorded_once}/{STALE} "
        f"cancel-pushed-to-A(ws)={cancels} re-leased-after-pause "
        f"p50={statistics.median(relet_s):.2f}s max={relet_s[-1]:.2f}s (ttl {TTL_MS / 1000:.1f}s) "
        f"elapsed={time.monotonic() - t0:.1f}s"
    )
    summary(line)
    assert outcome["b_complete:ok"] > 0, "empty history: " + line
    assert not bad, bad[:5]
    assert stale_accepted == 0
    assert recorded_once == STALE
    # Nobody took a lease back before its TTL ran out.
    assert relet_s[0] >= TTL_MS / 1000 * 0.9, relet_s
