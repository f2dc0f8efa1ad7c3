"""Campaign: every kind of daemon actor killed under load (anchors A1).

The kinds are read from ``GET /v1/api/actors`` of a daemon under load: every
actor's ``kind`` (``registry``, ``run`` at ``/runs/<id>``, ``lease`` at
``/leases/<id>``, ``timers``, ``recovery``...), and the supervisors by path
(``/runs``, ``/leases``; the root ``/`` cannot be killed). The test checks
that list against the kinds it knows (`KINDS`), so a new kind fails it until
it is added here.

Per kind, one test (``test_kill_actor_kind[<kind>]``): a fresh ``stepd
serve`` (``--lease-ttl-ms 3000 --heartbeat-ms 500 --recovery-window-ms
1000``), two SDK worker processes (`_worker_proc`, ``camp-ak``: a task, a
``for_each`` of four items, an at-most-once task, a task; one worker over the
WebSocket, one over HTTP), an SDK-less worker over raw HTTP serving the same
workflow and judging every answer it gets, and a client keeping 16 runs in
flight. Then ``STEPD_CAMPAIGN_ACTOR_KILLS`` kills of that kind through ``POST
/v1/api/actors/kill``, one every 25-75 ms (seeded; the pace of
examples/chaos.py), each at an actor of that kind picked at random from the
current tree (a run or lease actor: any live one). A kill answered 404 (the
actor is being restarted, or its run just ended) does not count; the next try
comes after the next gap.

Then the load stops, every run must end, and:

* the daemon is still serving, and every actor of the tree is ``running``
  with the five static children of the root in place;
* every run ``completed`` with the right result;
* the raw worker got no answer a worker call may not get: no 409
  ``already_applied`` to a call sent once (nothing earlier of that lease was
  sent, so nothing earlier could have landed), no status but 200, 404, 409,
  and 503 (sent again); and each 409 it got is the one the journal calls
  for (its own completion: ``already_applied``; recovered, or a later attempt
  of its slot offered: ``fenced``; else the run over: ``run_terminal``);
  and every lease it was handed is named by a ``step_offered`` of the journal,
  and no other lease holds the same attempt (same slot, same fence);
* the at-most-once step ran its body at most once per run (files written and
  fsynced by the workers before the effect), and the run kept that attempt;
* journals consistent: dense sequence numbers, one ``step_completed`` per
  slot, one terminal event, last;
* the daemon logs no unhandled exception, no supervisor giving up
  (escalating) and no other ERROR, and exits 0 on SIGTERM. Actors that crash
  because another one was killed (a run actor that finds ``/leases``
  restarting) are logged as crashes with their traceback and restarted: they
  are counted in the summary (``actor-crashes``), not failed.

The kills are not slowed down to spare the supervisors' restart intensity
(actors/daemon/tree.py: ``ROOT_INTENSITY``, ``CHILD_INTENSITY``): the summary
reports the kills, the most kills within 10 s, and the restarts the tree
counted; if the daemon stops, the line says after how many kills, and the
test fails.
"""

from __future__ import annotations

import queue
import random
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.reliability.conftest import kill9, start_daemon, stop_daemon

from ._common import (
    TERMINAL,
    TERMINAL_EVENTS,
    Ambiguous,
    Answer,
    HttpLink,
    Threads,
    WorkerProcess,
    body_files,
    journal,
    journal_problems,
    log_findings,
    wait_runs,
)
from ._worker_proc import ak, ak_result
from .conftest import campaign_int, campaign_seed

KILLS = campaign_int("STEPD_CAMPAIGN_ACTOR_KILLS")
DAEMON_ARGS = ("--lease-ttl-ms", "3000", "--heartbeat-ms", "500", "--recovery-window-ms", "1000",
               "--max-request-ms", "2000")
#: kind (as the test names it) -> how to find its actors in the tree
KINDS = ("registry", "run", "lease", "session", "timers", "recovery", "/runs", "/leases",
         "/sessions", "/schedules", "retention")
STATIC = ["/sessions", "/registry", "/runs", "/leases", "/timers", "/schedules", "/recovery",
          "/retention"]
GAP_S = (0.025, 0.075)
BACKLOG = 16
MAX_TRIES = 60  # kill attempts per counted kill, at most (404s while restarting)
FINAL_DEADLINE_S = 120.0
PERIOD_S = 10.0  # the dynamic supervisors' intensity period (actors/daemon/tree.py)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240 + KILLS)]


def kind_of(node: dict[str, Any]) -> str:
    return node["path"] if node["kind"] == "Supervisor" else str(node["kind"])


def walk(node: dict[str, Any]) -> list[dict[str, Any]]:
    out = [node]
    for child in node.get("children") or []:
        out += walk(child)
    return out


class Starter:
    """Keeps ``BACKLOG`` runs of ``camp-ak`` in flight until ``no_new_runs``."""

    def __init__(self, url: str, stop: threading.Event) -> None:
        self.url = url
        self.stop = stop
        self.no_new_runs = threading.Event()
        self.runs: dict[str, int] = {}
        self.open: list[str] = []
        self.errors: list[str] = []
        self.unavailable = 0

    def run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=10.0, trust_env=False) as client:
            n = 0
            while not self.stop.is_set():
                try:
                    still = []
                    for run_id in self.open:
                        r = client.get(f"/v1/api/runs/{run_id}")
                        if r.status_code != 200 or r.json()["status"] not in TERMINAL:
                            still.append(run_id)
                    self.open = still
                    while len(self.open) < BACKLOG and not self.no_new_runs.is_set():
                        r = client.post("/v1/api/runs", json={
                            "workflow": "camp-ak", "input": {"n": n}, "idempotency_key": f"ak-{n}"})
                        if r.status_code in (422, 503):  # not registered yet / restarting
                            self.unavailable += r.status_code == 503
                            break
                        if r.status_code not in (200, 201):
                            self.errors.append(f"start: {r.status_code} {r.text[:200]}")
                            break
                        if r.json()["run_id"] not in self.runs:
                            self.runs[r.json()["run_id"]] = n
                            self.open.append(r.json()["run_id"])
                        n += 1
                except httpx.TransportError as exc:
                    self.errors.append(f"transport: {exc!r}")
                    if len(self.errors) > 20:
                        return
                time.sleep(0.1)


def expected_reason(lease: dict[str, Any], events: list[dict[str, Any]]) -> str:
    """The 409 a call on ``lease`` should have got, from what the journal says happened.

    PROTOCOL.md "The four rejections", first applicable: its own completion or
    failure landed (``already_applied``); it was recovered or timed out, a
    later attempt of its slot was offered, or another lease completed its slot
    (``fenced``); the run is over
    (``run_terminal``). (``not_started`` cannot apply: the raw worker always
    sends ``started`` first.) ``ok`` if none applies.
    """
    lid, slot = lease["lease_id"], (lease["step_id"], lease["item_index"])
    mine = [e for e in events if e.get("lease_id") == lid]
    if any(e["type"] in ("step_completed", "step_failed") and e.get("error_class") != "lost"
           and e.get("error_class") != "timeout" for e in mine):
        return "already_applied"
    same_slot = [e for e in events if (e.get("step_id"), e.get("item_index")) == slot]
    if any(e["type"] == "step_recovered" for e in mine) or any(
            e["type"] == "step_offered" and e["fence"] > lease["fence"] for e in same_slot) or any(
            e["type"] == "step_completed" and e.get("lease_id") not in (None, lid)
            for e in same_slot):
        return "fenced"
    if any(e["type"] in TERMINAL_EVENTS for e in events):
        return "run_terminal"
    return "ok"


class RawWorker:
    """An SDK-less worker beside the SDK ones, serving ``camp-ak`` over raw HTTP, judging answers.

    One lease at a time: ``started``, the body (the at-most-once one writes its
    file first, like `_worker_proc`), ``complete``. A 503 or a lost answer is
    ambiguous: the same call is sent again (then 409 ``already_applied`` may
    mean the first one landed). What it holds against the daemon:
    ``already_applied`` to a call of which no earlier one was sent (PROTOCOL.md:
    "an earlier complete/fail of this same lease did arrive"), and any status
    a worker call may not get (not 200, 404, 409 or 503).
    """

    def __init__(self, url: str, bodies: Path, stop: threading.Event) -> None:
        self.link = HttpLink(url, timeout=10.0)
        self.bodies = bodies
        self.stop = stop
        self.answers: Counter[str] = Counter()
        self.wrong: list[str] = []
        self.completed = 0
        self.refused: list[tuple[dict[str, Any], str, str]] = []  # lease, op, reason: judged later
        self.leases: list[dict[str, Any]] = []  # every lease it was handed

    def run(self) -> None:
        try:
            for _ in range(100):
                try:
                    if self.link.register({"name": "ak-raw", "concurrency": 1,
                                           "definitions": [ak.to_json()]}).kind == "ok":
                        break
                except Ambiguous:
                    time.sleep(0.05)
            while not self.stop.is_set():
                try:
                    leases = self.link.leases(max=1, wait_ms=300)
                except Ambiguous:
                    time.sleep(0.05)
                    continue
                for lease in leases:
                    self.serve(lease)
        finally:
            self.link.close()

    def send(self, op: str, lease: dict[str, Any], body: dict[str, Any]) -> str:
        """The call, sent again while ambiguous (bounded); returns the final answer's label."""
        sent_before = False
        for _ in range(100):
            try:
                answer = self.link.call(op, lease["lease_id"], body)
            except Ambiguous:
                answer = Answer("error", "no answer")
            label = answer.label
            if answer.kind == "error" and ("503" in str(answer.detail)
                                           or answer.detail == "no answer"):
                sent_before = True
                time.sleep(0.02)
                continue
            self.answers[f"{op}:{label}{' (resent)' if sent_before else ''}"] += 1
            if answer.kind == "conflict" and not (label == "already_applied" and sent_before):
                self.refused.append((lease, op, label))
            if label == "already_applied" and (op == "started" or not sent_before):
                self.wrong.append(
                    f"{op} {lease['lease_id']}: already_applied, no earlier {op} was sent")
            elif answer.kind == "error":
                self.wrong.append(f"{op} {lease['lease_id']}: {answer.detail}")
            return label
        self.wrong.append(f"{op} {lease['lease_id']}: 503 a hundred times")
        return "unavailable"

    def serve(self, lease: dict[str, Any]) -> None:
        self.leases.append(lease)
        if self.send("started", lease, {}) != "ok":
            return
        body, inp, steps = lease["body"], lease["input"], lease["steps"]
        patch: dict[str, Any] = {}
        if body == "ak_prep":
            n = int(inp["n"])
            out: Any = {"n": n}
            patch = {"items": [n + k for k in range(4)]}
        elif body == "ak_square":
            out = int(inp) * int(inp)
        elif body == "ak_effect":
            name = "__".join(str(lease[k]) for k in ("run_id", "step_id", "item_index", "lease_id"))
            (self.bodies / name).write_text("raw\n")  # (the SDK's fsync matters for its kills only)
            out = {"v": 10 * int(steps["ak_prep"]["n"]), "lease_id": lease["lease_id"]}
            (self.bodies / f"{name}.done").touch()
        else:
            out = int(steps["ak_prep"]["n"]) + sum(int(v) for v in steps["ak_square"]) \
                + int(steps["ak_effect"]["v"])
        answer = self.send("complete", lease, {"output": out, "state_patch": patch})
        if answer in ("ok", "already_applied"):
            self.completed += 1


def tree(client: httpx.Client) -> dict[str, Any]:
    r = client.get("/v1/api/actors")
    assert r.status_code == 200, r.text
    return dict(r.json()["tree"])


@pytest.mark.parametrize("kind", KINDS)
def test_kill_actor_kind(kind: str, tmp_path: Path, summary: Any) -> None:
    seed = campaign_seed() + KINDS.index(kind)
    rng = random.Random(seed)
    t0 = time.monotonic()
    bodies = tmp_path / "bodies"
    bodies.mkdir()
    logs = tmp_path / "logs"
    logs.mkdir()
    lines: queue.Queue[tuple[WorkerProcess, str | None]] = queue.Queue()
    d = start_daemon(tmp_path / "data", *DAEMON_ARGS)
    procs: list[WorkerProcess] = []
    stop = threading.Event()
    threads = Threads()
    starter = Starter(d.url, stop)
    raw = RawWorker(d.url, bodies, stop)
    kills = refused = 0
    kill_times: list[float] = []
    seen_kinds: set[str] = set()
    stopped_after: str | None = None
    results: dict[str, dict[str, Any]] = {}
    journals: dict[str, list[dict[str, Any]]] = {}
    final_tree: dict[str, Any] = {}
    restarts = Counter[str]()
    daemon_status: int | None = None
    worker_status: list[int] = []
    try:
        procs = [WorkerProcess(f"ak-{t}", d.url, "ak", bodies, logs, lines, transport=t,
                               concurrency=8) for t in ("websocket", "http")]
        deadline = time.monotonic() + 60
        while not all(p.ready for p in procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(p.ready for p in procs), [p.stderr()[-2000:] for p in procs]
        threads.start("ak-raw", raw.run)
        threads.start("ak-starter", starter.run)
        with d.client(timeout=10.0) as client:
            # Under load: the tree holds run and lease actors.
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                nodes = walk(tree(client))
                seen_kinds |= {kind_of(node) for node in nodes if node["path"] != "/"}
                if {"run", "lease"} <= seen_kinds:
                    break
                time.sleep(0.05)
            unknown = seen_kinds - set(KINDS)
            assert not unknown, f"actor kinds this test does not know: {unknown}"
            kill_start = time.monotonic()
            for _ in range(KILLS * MAX_TRIES):
                if kills >= KILLS:
                    break
                time.sleep(rng.uniform(*GAP_S))
                try:
                    nodes = walk(tree(client))
                except httpx.TransportError:
                    if d.proc.poll() is not None:
                        stopped_after = f"{kills} kills ({d.proc.returncode})"
                        break
                    raise
                targets = [node["path"] for node in nodes
                           if node["path"] != "/" and kind_of(node) == kind]
                if not targets:
                    refused += 1
                    continue
                try:
                    r = client.post("/v1/api/actors/kill", json={"path": rng.choice(targets)})
                except httpx.TransportError:
                    if d.proc.poll() is not None:
                        stopped_after = f"{kills} kills ({d.proc.returncode})"
                        break
                    raise
                if r.status_code == 200:
                    kills += 1
                    kill_times.append(time.monotonic())
                elif r.status_code == 404:
                    refused += 1
                else:
                    raise AssertionError(f"kill answered {r.status_code} {r.text[:300]}")
            kill_s = time.monotonic() - kill_start
            if stopped_after is None and d.proc.poll() is not None:
                stopped_after = f"{kills} kills ({d.proc.returncode})"
            if stopped_after is None:
                starter.no_new_runs.set()
                deadline = time.monotonic() + FINAL_DEADLINE_S
                while starter.open and time.monotonic() < deadline:
                    time.sleep(0.2)
                stop.set()
                threads.join()
                run_ids = list(starter.runs)
                results = wait_runs(client, run_ids, deadline)
                # Every run a raw lease names, too: a start whose answer was lost (a
                # transport error) still made a run the raw worker may have served.
                journals = {run_id: journal(client, run_id)
                            for run_id in {*run_ids, *(lease["run_id"] for lease in raw.leases)}}
                final_tree = tree(client)
                for node in walk(final_tree):
                    key = node["path"] if node["path"] in ["/", *STATIC] else kind_of(node)
                    restarts[key] += node["restarts"]
        stop.set()
        worker_status = [p.stop() for p in procs]
        if d.proc.poll() is None:
            daemon_status = stop_daemon(d)
    finally:
        stop.set()
        for p in procs:
            if p.proc.poll() is None:
                p.kill9()
        threads.join()
        if d.proc.poll() is None:
            kill9(d)

    # ------------------------------------------------------------------ check
    window = max((sum(1 for t in kill_times if s <= t < s + PERIOD_S) for s in kill_times),
                 default=0)
    wrong: list[Any] = []
    journal_bad: list[str] = []
    for run_id, n in starter.runs.items():
        body = results.get(run_id, {})
        if body.get("status") != "completed" or body.get("result") != ak_result(n):
            wrong.append((run_id, n, body))
        journal_bad += journal_problems(run_id, journals.get(run_id, []), body.get("status"))
    files = body_files(bodies)
    amo_twice = {s: ls for s, ls in files.items() if s[1] == "ak_effect" and len(ls) > 1}
    kept_other = []
    for run_id, events in journals.items():
        for e in events:
            if e["type"] == "step_completed" and e.get("step_id") == "ak_effect":
                ran = [lid for lid, _ in files.get((run_id, "ak_effect", "None"), [])]
                if ran != [e["lease_id"]]:
                    kept_other.append((run_id, e["lease_id"], ran))
    wrong_reason = []
    for lease, op, got in raw.refused:
        want = expected_reason(lease, journals.get(lease["run_id"], []))
        if want != got:
            wrong_reason.append(f"{op} {lease['lease_id']} ({lease['step_id']}/"
                                f"{lease['item_index']} fence {lease['fence']}): got {got}, "
                                f"the journal says {want}")
    # Every lease handed out is an attempt the journal names (PROTOCOL.md "Horizontal
    # scaling": "Every attempt journals the worker_id and name that took it"), and no
    # other lease holds the same attempt of the same slot (same fence).
    unjournaled, handed_twice = [], []
    for lease in raw.leases:
        slot = (lease["step_id"], lease["item_index"])
        offers = [e for e in journals.get(lease["run_id"], []) if e["type"] == "step_offered"
                  and (e["step_id"], e.get("item_index")) == slot]
        if not any(e["lease_id"] == lease["lease_id"] for e in offers):
            unjournaled.append(lease["lease_id"])
        twins = [e["lease_id"] for e in offers
                 if e["fence"] == lease["fence"] and e["lease_id"] != lease["lease_id"]]
        if twins:
            handed_twice.append((lease["lease_id"], twins))
    tree_bad = []
    if final_tree:
        nodes = walk(final_tree)
        tree_bad = [node["path"] for node in nodes if node["state"] != "running"]
        if [c["path"] for c in final_tree["children"]] != STATIC:
            tree_bad.append(f"root children {[c['path'] for c in final_tree['children']]}")
    alo_twice = sum(1 for s, ls in files.items() if s[1] != "ak_effect" and len(ls) > 1)
    logged = log_findings(d.stderr())
    line = (
        f"campaign-actor-kills kind={kind} seed={seed} kills={kills} (404 while restarting or gone "
        f"{refused}) in {kill_s:.1f}s max-kills-in-{PERIOD_S:.0f}s={window} "
        f"daemon-stopped={stopped_after or 'no'} restarts={dict(restarts)} "
        f"runs={len(starter.runs)} "
        f"completed={len(starter.runs) - len(wrong)} wrong-runs={len(wrong)} "
        f"amo-ran-twice={len(amo_twice)} amo-kept-other={len(kept_other)} "
        f"alo-reexecuted={alo_twice} "
        f"journal-violations={len(journal_bad)} tree-not-running={len(tree_bad)} "
        f"raw-worker: completed={raw.completed} wrong-answers={len(raw.wrong)} "
        f"wrong-409-reason={len(wrong_reason)} leases-not-in-journal={len(unjournaled)} "
        f"same-attempt-handed-twice={len(handed_twice)} "
        f"{dict(sorted(raw.answers.items()))} "
        f"daemon-log: unhandled={len(logged['unhandled'])} "
        f"escalations={len(logged['escalations'])} "
        f"actor-crashes={len(logged['crashes'])} errors={len(logged['errors'])} "
        f"start-503={starter.unavailable} kinds-seen={sorted(seen_kinds)} "
        f"elapsed={time.monotonic() - t0:.1f}s"
    )
    summary(line)
    assert stopped_after is None, (
        f"the daemon stopped after {stopped_after} of {kind}: {line}\n{d.stderr()[-4000:]}")
    assert kills >= KILLS, line
    assert not threads.errors, threads.errors[0]
    assert not wrong, f"{len(wrong)} runs not completed right: {wrong[:3]}"
    assert not raw.wrong, raw.wrong[:5]
    assert not wrong_reason, wrong_reason[:5]
    assert not unjournaled, f"leases handed out that the journal does not name: {unjournaled[:5]}"
    assert not handed_twice, f"one attempt handed to two leases (same fence): {handed_twice[:5]}"
    assert not amo_twice, list(amo_twice.items())[:5]
    assert not kept_other, kept_other[:5]
    assert not journal_bad, journal_bad[:5]
    assert not tree_bad, tree_bad
    assert not starter.errors, starter.errors[:5]
    # An actor crashing because another was killed is reported (actor-crashes), not
    # failed: supervision restarts it from storage. An unhandled exception, or a
    # supervisor giving up, is a failure.
    assert not logged["unhandled"], logged["unhandled"][:3]
    assert not logged["escalations"], logged["escalations"][:3]
    assert not logged["errors"], logged["errors"][:3]
    assert daemon_status == 0
    assert worker_status == [0, 0], [p.stderr()[-2000:] for p in procs]
