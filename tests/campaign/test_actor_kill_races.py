"""Campaign: the smallest cases of what the actor-kill campaign found (test_actor_kills.py).

Each test is one race between a kill (``POST /v1/api/actors/kill``) and the
work an actor has in hand, repeated ``max(3, STEPD_CAMPAIGN_ACTOR_KILLS // 10)``
times on a fresh daemon with default timings, and checked by counts only:

* ``test_a_complete_racing_a_kill_is_answered_by_what_it_did[runs|leases]``:
  one SDK-less worker holds 40 started leases (a one-step workflow); it sends
  the 40 ``complete`` calls at once while the test kills the run actor (or the
  lease actor) of each (the first 5 completes wait for their kill's answer, so
  some kills land on a machine fast enough to finish the rest first). Each ``complete`` is sent once, so its answer must say
  what became of it: 200 only if the journal holds its ``step_completed``, a
  409 only if it does not (a 503 asks for the call again: either way). A 409
  (``already_applied``, ``run_terminal``, ``fenced``) for a completion that
  landed tells the worker its work was refused, or was an earlier call's,
  when this very call landed (PROTOCOL.md "The four rejections"); a 200 for
  one that did not land loses it.
* ``test_a_runs_kill_leaves_push_sessions_running``: a WebSocket worker with
  no credit, runs queued for it, and 40 ``complete`` calls of another worker
  in flight as ``/runs`` is killed (5-20 ms after them); right after the kill
  the WebSocket grants credit. The daemon must not log an unhandled
  exception, and the socket must stay open and get its leases.
* ``test_an_offer_made_just_before_a_kill_is_not_made_again[/runs|/registry]``:
  worker A claims the one step of a fresh run (the offer is written behind,
  docs/leases.md) and the test kills ``/runs`` (or ``/registry``, whose
  restart restarts ``/runs`` too) at once; then worker B claims that run. The
  daemon did not die, so A's offer is not lost: B must get nothing, never the
  same attempt again (PROTOCOL.md "Horizontal scaling": each attempt is handed
  to exactly one worker; "fence grows with each attempt"), and the journal
  must name A's lease. Then A completes its lease (sent again on 503, bounded)
  and must be answered 200.
* ``test_registry_kills_do_not_make_a_supervisor_give_up``: three raw-HTTP
  workers work through queued runs while ``/registry`` is killed 40 times,
  one every 50 ms. Kills are not counted against restart intensity
  (actors/_supervisor.py); no supervisor may give up ("escalates to its
  parent") because of them.
"""

from __future__ import annotations

import functools
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.exceptions import ConnectionClosed

from tests.reliability.conftest import kill9, start_daemon, stop_daemon
from tests.transport.conftest import DaemonProcess, Worker, WsWorker, ws_connect

from ._common import log_findings
from .conftest import campaign_int

ROUNDS = max(3, campaign_int("STEPD_CAMPAIGN_ACTOR_KILLS") // 10)
LEASES = 40
DEFS = [{"name": "race", "steps": [{"id": "t", "kind": "task", "body": "t"}]}]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120 + 20 * ROUNDS)]


def hold_started(d: DaemonProcess, worker: Worker, n: int) -> list[dict[str, Any]]:
    with d.client() as c:
        for i in range(n):
            assert c.post("/v1/api/runs", json={"workflow": "race", "input": i}).status_code == 201
    held: list[dict[str, Any]] = []
    deadline = time.monotonic() + 20
    while len(held) < n and time.monotonic() < deadline:
        held += worker.claim(max=n - len(held), wait_ms=1000)
    assert len(held) == n
    for lease in held:
        assert worker.call(lease["lease_id"], "started", {}).status_code == 200
    return held


def complete_all_while(d: DaemonProcess, held: list[dict[str, Any]], kill_paths: list[str], *,
                       delay: float = 0.0, then: Callable[[], None] | None = None,
                       lead: int = 0,
                       ) -> tuple[dict[str, tuple[int, str | None]], int]:
    """Every lease's ``complete`` at once (one thread each) while the paths are killed.

    The kills start ``delay`` seconds after the completes; ``then`` runs right after them.
    The first ``lead`` leases' completes wait for the answers to the first ``lead`` kills:
    on a fast machine every other complete can land before its kill arrives (the kill
    then finds no actor, 404), and a race the daemon always wins tests nothing. Those
    completes race the killed actors' restart instead.
    """
    answers: dict[str, tuple[int, str | None]] = {}
    go = threading.Barrier(len(held) + 1, timeout=30)
    lead_killed = threading.Event()

    def complete(index: int, lease: dict[str, Any]) -> None:
        with d.client() as c:
            go.wait()
            if index < lead:
                lead_killed.wait(30)
            r = c.post(f"/v1/api/steps/{lease['lease_id']}/complete",
                       json={"output": lease["lease_id"]})
            reason = r.json().get("reason") if r.status_code == 409 else None
            answers[lease["lease_id"]] = (r.status_code, reason)

    threads = [threading.Thread(target=complete, args=(i, lease), daemon=True)
               for i, lease in enumerate(held)]
    for t in threads:
        t.start()
    kills = 0
    with d.client() as c:
        go.wait()
        time.sleep(delay)
        for i, path in enumerate(kill_paths):
            if i == lead:
                lead_killed.set()
            kills += c.post("/v1/api/actors/kill", json={"path": path}).status_code == 200
        lead_killed.set()
    if then is not None:
        then()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    return answers, kills


@pytest.mark.parametrize("target", ["runs", "leases"])
def test_a_complete_racing_a_kill_is_answered_by_what_it_did(target: str, tmp_path: Path,
                                                             summary: Any) -> None:
    t0 = time.monotonic()
    answers_seen: Counter[str] = Counter()
    contradictions: list[Any] = []
    kills = 0
    d = start_daemon(tmp_path / "data", "--max-request-ms", "5000")
    try:
        with d.client() as c:
            worker = Worker(c, DEFS)
            for _ in range(ROUNDS):
                held = hold_started(d, worker, LEASES)
                paths = [f"/runs/{x['run_id']}" if target == "runs" else f"/leases/{x['lease_id']}"
                         for x in held]
                answers, k = complete_all_while(d, held, paths, lead=LEASES // 8)
                kills += k
                for lease in held:
                    events = c.get(f"/v1/api/runs/{lease['run_id']}/journal").json()["events"]
                    landed = any(e["type"] == "step_completed"
                                 and e.get("lease_id") == lease["lease_id"] for e in events)
                    status, reason = answers[lease["lease_id"]]
                    label = str(status) if reason is None else f"409 {reason}"
                    answers_seen[f"{label} ({'landed' if landed else 'not landed'})"] += 1
                    # 503 says "not now, send it again": either way is fine (ambiguous).
                    if (status == 200 and not landed) or (status == 409 and landed) \
                            or status not in (200, 409, 503):
                        contradictions.append((lease["lease_id"], label, landed,
                                               [e["type"] for e in events]))
        status = stop_daemon(d)
    finally:
        if d.proc.poll() is None:
            kill9(d)
    line = (f"kill-race target={target} rounds={ROUNDS} completes={ROUNDS * LEASES} kills={kills} "
            f"answers={dict(sorted(answers_seen.items()))} contradictions={len(contradictions)} "
            f"elapsed={time.monotonic() - t0:.1f}s")
    summary(line)
    assert kills > 0, line
    assert not contradictions, f"answers that contradict the journal: {contradictions[:3]}"
    assert status == 0


def test_a_runs_kill_leaves_push_sessions_running(tmp_path: Path, summary: Any) -> None:
    t0 = time.monotonic()
    unhandled: list[str] = []
    closed = 0
    pushed = 0
    for round_no in range(ROUNDS):
        d = start_daemon(tmp_path / f"data{round_no}", "--max-request-ms", "5000")
        try:
            with d.client() as c, ws_connect(d) as conn:
                a = Worker(c, DEFS)
                held = hold_started(d, a, LEASES)
                b = WsWorker(conn)
                assert b.request("register", definitions=DEFS)["op"] == "registered"
                for i in range(4):  # queued for B, which has no credit yet
                    c.post("/v1/api/runs", json={"workflow": "race", "input": 100 + i})
                complete_all_while(d, held, ["/runs"], delay=0.005 * (1 + round_no % 4),
                                   then=functools.partial(b.send, {"op": "credit", "n": 4}))
                try:
                    for _ in range(4):
                        pushed += b.wait_for("lease", timeout=10)["op"] == "lease"
                except (ConnectionClosed, TimeoutError):  # the socket died, or no lease came
                    closed += 1
            status = stop_daemon(d)
            assert status == 0
        finally:
            if d.proc.poll() is None:
                kill9(d)
        unhandled += log_findings(d.stderr())["unhandled"]
    line = (f"kill-race-push rounds={ROUNDS} leases-pushed-after={pushed}/{4 * ROUNDS} "
            f"sockets-lost-or-starved={closed} daemon-unhandled={len(unhandled)} "
            f"elapsed={time.monotonic() - t0:.1f}s")
    summary(line)
    assert not unhandled, unhandled[:3]
    assert closed == 0, line


@pytest.mark.parametrize("target", ["/runs", "/registry"])
def test_an_offer_made_just_before_a_kill_is_not_made_again(target: str, tmp_path: Path,
                                                            summary: Any) -> None:
    t0 = time.monotonic()
    runs = 5 * ROUNDS
    handed_twice: list[Any] = []
    unjournaled: list[str] = []
    a_answers: Counter[str] = Counter()
    d = start_daemon(tmp_path / "data", "--lease-ttl-ms", "30000", "--max-request-ms", "5000")
    try:
        with d.client(timeout=30.0) as c:
            a = Worker(c, DEFS, name="A")
            b = Worker(c, DEFS, name="B")
            for i in range(runs):
                r = c.post("/v1/api/runs", json={"workflow": "race", "input": i})
                run_id = r.json()["run_id"]
                (la,) = a.claim(run_id=run_id, wait_ms=2000)
                assert c.post("/v1/api/actors/kill", json={"path": target}).status_code == 200
                lb = b.claim(run_id=run_id, wait_ms=300)
                if lb:
                    handed_twice.append((run_id, la["lease_id"], la["fence"],
                                         lb[0]["lease_id"], lb[0]["fence"]))
                    b.call(lb[0]["lease_id"], "started", {})
                    b.call(lb[0]["lease_id"], "complete", {"output": "B"})
                for _ in range(10):  # 503: "being recovered; retry"
                    answer = a.call(la["lease_id"], "complete", {"output": "A"})
                    if answer.status_code != 503:
                        break
                reason = answer.json().get("reason") if answer.status_code == 409 else ""
                a_answers[f"{answer.status_code} {reason}".strip()] += 1
                events = c.get(f"/v1/api/runs/{run_id}/journal").json()["events"]
                if not any(e["type"] == "step_offered" and e.get("lease_id") == la["lease_id"]
                           for e in events):
                    unjournaled.append(la["lease_id"])
        status = stop_daemon(d)
    finally:
        if d.proc.poll() is None:
            kill9(d)
    line = (f"kill-race-reoffer target={target} runs={runs} same-attempt-handed-twice="
            f"{len(handed_twice)} first-lease-not-in-journal={len(unjournaled)} "
            f"first-holder-complete={dict(a_answers)} elapsed={time.monotonic() - t0:.1f}s")
    summary(line)
    assert not handed_twice, f"(run, A's lease, fence, B's lease, fence): {handed_twice[:3]}"
    assert not unjournaled, unjournaled[:3]
    assert a_answers == Counter({"200": runs}), line
    assert status == 0


def test_registry_kills_do_not_make_a_supervisor_give_up(tmp_path: Path, summary: Any) -> None:
    t0 = time.monotonic()
    kills = 0
    completed = 0
    d = start_daemon(tmp_path / "data", "--max-request-ms", "5000")
    stop = threading.Event()
    lock = threading.Lock()

    def work() -> None:
        nonlocal completed
        with d.client() as c:
            w = Worker(c, DEFS)
            while not stop.is_set():
                try:
                    for lease in w.claim(max=8, wait_ms=200):
                        w.call(lease["lease_id"], "started", {})
                        if w.call(lease["lease_id"], "complete", {"output": 1}).status_code == 200:
                            with lock:
                                completed += 1
                except (AssertionError, OSError, ValueError, httpx.HTTPError):
                    time.sleep(0.01)  # a claim answered 503 while the registry restarts

    threads = [threading.Thread(target=work, daemon=True) for _ in range(3)]
    try:
        with d.client() as c:
            Worker(c, DEFS)
            for i in range(100 * ROUNDS):
                c.post("/v1/api/runs", json={"workflow": "race", "input": i})
            for t in threads:
                t.start()
            for _ in range(40 * ROUNDS // 3):
                time.sleep(0.05)
                r = c.post("/v1/api/actors/kill", json={"path": "/registry"})
                kills += r.status_code == 200
        stop.set()
        for t in threads:
            t.join(15)
        status = stop_daemon(d)
    finally:
        stop.set()
        if d.proc.poll() is None:
            kill9(d)
    found = log_findings(d.stderr())
    line = (f"kill-race-registry registry-kills={kills} completed={completed} "
            f"escalations={len(found['escalations'])} actor-crashes={len(found['crashes'])} "
            f"unhandled={len(found['unhandled'])} elapsed={time.monotonic() - t0:.1f}s")
    summary(line)
    assert kills > 0 and completed > 0, line
    assert not found["escalations"], found["escalations"][:3] + found["crashes"][:3]
    assert not found["unhandled"], found["unhandled"][:3]
    assert status == 0
