"""Campaign: worker processes SIGKILLed while at-most-once bodies run (anchors L3).

One ``stepd serve`` with short timings (``--lease-ttl-ms 800 --heartbeat-ms
200 --recovery-window-ms 200``, so each kill is recovered in about a second)
and five worker processes of the Python SDK (`tests.campaign._worker_proc`,
three over the WebSocket, two over HTTP long-poll, 3 bodies at once each),
serving ``camp-wk``: ``prep`` (at-least-once) -> ``effect`` (at-most-once,
0.2-0.5 s) -> ``fx``, a ``for_each`` of two at-most-once items (0.2-0.5 s
each) -> ``total``. A client keeps 12 runs in flight.

Each body counts itself, durably, on the worker's side: a file per attempt,
created and fsynced (with its directory) before the body's effect, then a
``.done`` file after it (see `_worker_proc`). When a worker announces that an
at-most-once body started, the test SIGKILLs that worker by its PID half the
time (the fifth worker never: runs it serves end and their results are checked),
after 0-150 ms, reaps it and starts a new one in its place. A kill
counts for the figure when the body it interrupted had not finished (no
``.done``). ``STEPD_CAMPAIGN_WORKER_KILLS`` such kills, then the runs left
finish and the workers stop (SIGTERM).

Checks (PROTOCOL.md "Expiry and recovery"):

* every at-most-once slot ran its body at most once (the files);
* every run ends either ``completed`` with the right result, or ``failed``
  with ``lease_lost`` at an at-most-once step whose attempt the journal shows
  ``step_started`` and ``step_failed`` with class ``lost``; nothing else;
* a completed at-most-once slot was completed by the one lease whose body ran;
* journals consistent (dense sequence numbers, one ``step_completed`` per
  slot, terminal event last); no daemon traceback; the daemon exits 0.
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
    Threads,
    WorkerProcess,
    body_files,
    journal,
    journal_problems,
    wait_runs,
)
from ._worker_proc import wk_result
from .conftest import campaign_int, campaign_seed

KILLS = campaign_int("STEPD_CAMPAIGN_WORKER_KILLS")
DAEMON_ARGS = ("--lease-ttl-ms", "800", "--heartbeat-ms", "200", "--recovery-window-ms", "200",
               "--max-request-ms", "2000")
TRANSPORTS = ("websocket", "http", "websocket", "http", "websocket")
SURVIVOR = 4  # the last worker is never killed: some runs complete, and their results are checked
CONCURRENCY = 3
BACKLOG = 12
KILL_P = 0.5
KILL_DELAY_S = (0.0, 0.15)
AMO_STEPS = ("effect", "fx")
WAIT_LINE_S = 60.0  # no line from any worker for this long: something is stuck
FINAL_DEADLINE_S = 120.0

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300 + 3 * KILLS)]


class Starter:
    """Keeps ``BACKLOG`` runs of ``camp-wk`` in flight (bounded loop, stops on ``stop``)."""

    def __init__(self, url: str, stop: threading.Event) -> None:
        self.url = url
        self.stop = stop
        self.no_new_runs = threading.Event()
        self.runs: dict[str, int] = {}  # run id -> n
        self.open: list[str] = []
        self.errors: list[str] = []

    def run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=10.0, trust_env=False) as client:
            n = 0
            while not self.stop.is_set():
                still = []
                for run_id in self.open:
                    r = client.get(f"/v1/api/runs/{run_id}")
                    if r.status_code != 200 or r.json()["status"] not in TERMINAL:
                        still.append(run_id)
                self.open = still
                while len(self.open) < BACKLOG and not self.no_new_runs.is_set():
                    r = client.post("/v1/api/runs", json={"workflow": "camp-wk", "input": {"n": n}})
                    if r.status_code == 422:  # no worker registered yet
                        break
                    if r.status_code != 201:
                        self.errors.append(f"start: {r.status_code} {r.text[:200]}")
                        break
                    self.runs[r.json()["run_id"]] = n
                    self.open.append(r.json()["run_id"])
                    n += 1
                time.sleep(0.2)


def test_worker_sigkill_mid_at_most_once_body(tmp_path: Path, summary: Any) -> None:
    seed = campaign_seed()
    rng = random.Random(seed)
    t0 = time.monotonic()
    bodies = tmp_path / "bodies"
    bodies.mkdir()
    logs = tmp_path / "logs"
    logs.mkdir()
    lines: queue.Queue[tuple[WorkerProcess, str | None]] = queue.Queue()
    d = start_daemon(tmp_path / "data", *DAEMON_ARGS)
    procs: list[WorkerProcess] = []
    slots: list[WorkerProcess] = []
    stop = threading.Event()
    threads = Threads()
    starter = Starter(d.url, stop)
    kills = mid_body = spawned = 0
    worker_errors: list[str] = []
    daemon_status: int | None = None

    def spawn(i: int) -> WorkerProcess:
        nonlocal spawned
        spawned += 1
        p = WorkerProcess(f"wk-{i}-{spawned}", d.url, "wk", bodies, logs, lines,
                          transport=TRANSPORTS[i], concurrency=CONCURRENCY)
        procs.append(p)
        return p

    try:
        slots = [spawn(i) for i in range(len(TRANSPORTS))]
        threads.start("wk-starter", starter.run)
        last_line = time.monotonic()
        while mid_body < KILLS:
            try:
                p, line = lines.get(timeout=1.0)
            except queue.Empty:
                assert time.monotonic() - last_line < WAIT_LINE_S, "no worker output for a minute"
                continue
            last_line = time.monotonic()
            if line is None:
                # A worker that died without being killed (it could not start, or
                # crashed) stops the test here, with its log: nothing below would tell.
                assert p.killed, f"{p.name} exited {p.proc.wait(10)}:\n{p.stderr()[-3000:]}"
                continue
            if not line.startswith("body at_most_once ") or p.killed or p not in slots \
                    or slots.index(p) == SURVIVOR:
                continue
            if rng.random() >= KILL_P:
                continue
            time.sleep(rng.uniform(*KILL_DELAY_S))
            p.kill9()
            kills += 1
            path = Path(line.split(" ", 2)[2])
            if not path.with_name(path.name + ".done").exists():
                mid_body += 1
            i = slots.index(p)
            slots[i] = spawn(i)
        kill_done = time.monotonic()
        starter.no_new_runs.set()
        deadline = time.monotonic() + FINAL_DEADLINE_S
        while starter.open and time.monotonic() < deadline:
            time.sleep(0.2)
        stop.set()
        alive = threads.join()
        assert not alive, alive
        with d.client(timeout=30.0) as client:
            run_ids = list(starter.runs)
            results = wait_runs(client, run_ids, deadline)
            journals = {run_id: journal(client, run_id) for run_id in run_ids}
        for p in slots:
            if p.proc.poll() is None and p.stop() != 0:
                worker_errors.append(f"{p.name} exited {p.proc.returncode} on SIGTERM:\n"
                                     f"{p.stderr()[-2000:]}")
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
    files = body_files(bodies)
    amo_slots = {s: ls for s, ls in files.items() if s[1] in AMO_STEPS}
    amo_twice = {s: ls for s, ls in amo_slots.items() if len(ls) > 1}
    alo_twice = sum(1 for s, ls in files.items() if s[1] not in AMO_STEPS and len(ls) > 1)
    cut = sum(1 for ls in amo_slots.values() for _, finished in ls if not finished)
    outcome: Counter[str] = Counter()
    wrong: list[Any] = []
    journal_bad: list[str] = []
    kept_other: list[Any] = []
    recovered = 0
    for run_id, n in starter.runs.items():
        events = journals[run_id]
        body = results[run_id]
        journal_bad += journal_problems(run_id, events, body.get("status"))
        recovered += sum(1 for e in events if e["type"] == "step_recovered")
        for e in events:
            if e["type"] == "step_completed" and e.get("step_id") in AMO_STEPS and "lease_id" in e:
                slot = (run_id, e["step_id"], str(e.get("item_index")))
                ran = [lid for lid, _ in files.get(slot, [])]
                if ran != [e["lease_id"]]:
                    kept_other.append((slot, e["lease_id"], ran))
        if body.get("status") == "completed" and body.get("result") == wk_result(n):
            outcome["completed"] += 1
            continue
        error = body.get("error") or {}
        lost = [e for e in events if e["type"] == "step_failed" and e.get("error_class") == "lost"]
        started = {(e["step_id"], e.get("item_index"), e.get("fence")) for e in events
                   if e["type"] == "step_started"}
        if body.get("status") == "failed" and error.get("reason") == "lease_lost" \
                and error.get("step_id") in AMO_STEPS and lost \
                and all((e["step_id"], e.get("item_index"), e.get("fence")) in started
                        for e in lost):
            outcome["failed-lost"] += 1
            continue
        wrong.append((run_id, n, body))
    line = (
        f"campaign-worker-kills seed={seed} kills={kills} mid-amo-body={mid_body} "
        f"workers-started={spawned} runs={len(starter.runs)} {dict(outcome)} "
        f"wrong-runs={len(wrong)} "
        f"amo-slots={len(amo_slots)} amo-bodies={sum(len(ls) for ls in amo_slots.values())} "
        f"amo-bodies-cut={cut} amo-ran-twice={len(amo_twice)} amo-kept-other={len(kept_other)} "
        f"alo-reexecuted={alo_twice} recovered-attempts={recovered} "
        f"journal-violations={len(journal_bad)} kill-phase={kill_done - t0:.1f}s "
        f"elapsed={time.monotonic() - t0:.1f}s"
    )
    summary(line)
    assert not threads.errors, threads.errors[0]
    assert mid_body >= KILLS, line
    assert not amo_twice, f"at-most-once bodies ran twice: {list(amo_twice.items())[:5]}"
    assert not kept_other, kept_other[:5]
    assert not wrong, f"{len(wrong)} runs did not end completed or failed lost: {wrong[:3]}"
    assert not journal_bad, journal_bad[:5]
    assert not starter.errors, starter.errors[:5]
    assert not worker_errors, worker_errors[0]
    assert "Traceback" not in d.stderr(), d.stderr()[-3000:]
    assert daemon_status == 0
