"""D1: completions the daemon acknowledged survive SIGKILL (research/anchors-reliability.md).

One data directory for the whole test. Each round starts ``python -m stepd
serve`` on a free port of 127.0.0.1; four raw-HTTP workers (PROTOCOL.md:
register, claim, started, complete, the 409s by reason) and one client
starting ``seq(n)`` runs (one idempotency key per run) work against it; after
a random 0.3-1.5 s (in every other round, right as the next completion is
acknowledged) the test SIGKILLs the daemon by its PID, reaps it and starts the
next round on the same directory. After the kills a last daemon lets every run
finish, and the history is checked against what the daemon kept.

``seq(n)`` is n task steps ``s0..s{n-1}``; step k gets ``{"i": k, "prev":
steps.s{k-1}.acc}`` and outputs ``{"acc": prev + i, "lease_id": <its lease>}``,
also patched into the run state under its step id. So the run's result is
``acc = n(n-1)/2`` only if every step's accepted output fed the next one, and
``state[step]`` names the lease whose completion the run kept.

The history (Jepsen's queue checker, adapted):

* acknowledged: ``complete`` answered 200. Each must be in the run's journal (a
  ``step_completed`` with that lease id) and be the output the run kept
  (``state[step] == output``): an accepted completion is the step's output and
  nothing may supersede it. One missing is *lost*.
* ambiguous: a ``complete`` that got no answer (the connection died with the
  daemon). The worker keeps the lease and tries again on the next daemon, as a
  real worker would: 200 makes it acknowledged; 409 ``already_applied`` says
  the first one landed; any other answer says it did not (409 ``fenced`` or
  ``run_terminal``, or 404: the offer of that lease is written behind and may
  die with the daemon, docs/leases.md "Offers are written behind"). Those
  answers are checked against the journal: a contradiction fails the test.
  The journal says which of the ambiguous ones landed (``recovered``) and
  which did not (``not landed``).
* duplicated: a step (slot) with two ``step_completed`` in one journal.
* unexpected: a ``step_completed`` for a lease no worker completed, or
  ``already_applied`` for a lease whose complete was never sent before.

Every run must end ``completed`` with the right result, every idempotency key
must name exactly one run, no daemon may log a traceback, and an empty history
(acknowledged == 0) fails.

Knobs (environment): ``STEPD_RELIABILITY_SEED`` (kill schedule and run sizes),
``STEPD_RELIABILITY_KILLS`` (default 8: four timed kills and four right behind an
acknowledgement are enough to prove the rule in the default suite; the campaign,
tests/campaign/test_daemon_sigkill.py, runs it at 10 (reduced, CI) and 50 kills).

Fault model and limits: SIGKILL of the daemon process only. A SIGKILL lets the
kernel write out the page cache, so this test cannot see a missing fsync
(research/anchors-reliability.md §1.1: that needs a power-loss layer, test D2).
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from .conftest import (
    Current,
    DaemonProcess,
    env_int,
    kill9,
    seed_from_env,
    start_daemon,
    stop_daemon,
)

pytestmark = pytest.mark.slow

KILLS = env_int("STEPD_RELIABILITY_KILLS", 8)
WORKERS = 4
SIZES = range(3, 9)  # seq(3) .. seq(8)
DAEMON_ARGS = ("--lease-ttl-ms", "1000", "--heartbeat-ms", "300",
               "--recovery-window-ms", "300", "--max-request-ms", "1000",
               "--shutdown-grace-ms", "2000")
ROUND_S = (0.3, 1.5)
BACKLOG = 16  # runs started and not yet seen finishing: keeps every round under load
MAX_RUNS = 3000  # a bound only
CLAIM_WAIT_MS = 300
FINAL_DEADLINE_S = 45.0
CLIENT_TIMEOUT_S = 5.0


def seq_definition(n: int) -> dict[str, Any]:
    steps = []
    for k in range(n):
        prev: Any = 0 if k == 0 else f"${{steps.s{k - 1}.acc}}"
        steps.append({"id": f"s{k}", "kind": "task", "body": "add",
                      "input": {"i": k, "prev": prev},
                      # Every kill can cost a held lease one attempt (PROTOCOL.md
                      # "Expiry and recovery"): the budget must outlast the kills.
                      "retry": {"max_attempts": 1000, "initial_backoff_ms": 0}})
    return {"name": f"seq{n}", "steps": steps}


DEFINITIONS = [seq_definition(n) for n in SIZES]


@dataclass
class History:
    """Everything the clients saw, under one lock."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    acked: dict[str, tuple[str, str, Any]] = field(default_factory=dict)  # lease -> run, step, out
    ambiguous: dict[str, tuple[str, str, Any]] = field(default_factory=dict)
    said_applied: set[str] = field(default_factory=set)  # ambiguous, then 409 already_applied
    said_rejected: set[str] = field(default_factory=set)  # ambiguous, then another 409/404
    complete_calls: int = 0
    conflicts: Counter[str] = field(default_factory=Counter)  # "op:reason"
    lease_unknown: int = 0  # 404 for a lease a claim handed out
    unexpected: list[str] = field(default_factory=list)
    bad_status: list[str] = field(default_factory=list)
    ack_event: threading.Event = field(default_factory=threading.Event)
    runs: dict[str, tuple[int, str]] = field(default_factory=dict)  # key -> n, run_id
    start_dedup: int = 0  # a retried start answered "created": false
    retried_acked: int = 0  # an unanswered complete, sent again, answered 200
    finished: set[str] = field(default_factory=set)  # runs whose last step a worker saw land

    def note(self, what: str, r: httpx.Response) -> None:
        with self.lock:
            self.bad_status.append(f"{what} -> {r.status_code} {r.text[:300]}")


class CrashWorker:
    """One SDK-less worker thread over raw HTTP (PROTOCOL.md "Worker calls")."""

    def __init__(self, index: int, current: Current, history: History, stop: threading.Event):
        self.name = f"crash-w{index}"
        self.current = current
        self.h = history
        self.stop = stop
        self.worker_id: str | None = None
        self.lease: dict[str, Any] | None = None
        self.started = False
        self.complete_sent = False  # a complete of self.lease went out and got no answer

    def run(self) -> None:
        gen_seen = 0
        client: httpx.Client | None = None
        try:
            while not self.stop.is_set():
                url, gen = self.current.get()
                if url is None:
                    continue
                if gen != gen_seen:
                    if client is not None:
                        client.close()
                    client = httpx.Client(base_url=url, timeout=CLIENT_TIMEOUT_S, trust_env=False)
                    if not self._register(client):
                        time.sleep(0.01)
                        continue
                    gen_seen = gen
                assert client is not None
                try:
                    self._step(client)
                except httpx.TransportError:
                    time.sleep(0.01)  # the daemon is gone (or going): wait for the next one
        finally:
            if client is not None:
                client.close()

    def _register(self, client: httpx.Client) -> bool:
        body: dict[str, Any] = {"name": self.name, "concurrency": 1, "definitions": DEFINITIONS}
        if self.worker_id is not None:
            body["worker_id"] = self.worker_id  # a lease belongs to the worker: keep holding it
        try:
            r = client.post("/v1/api/workers/register", json=body)
        except httpx.TransportError:
            return False
        if r.status_code != 200:
            self.h.note("register", r)
            return False
        self.worker_id = r.json()["worker_id"]
        return True

    def _drop(self) -> None:
        self.lease, self.started, self.complete_sent = None, False, False

    def _conflict(self, op: str, r: httpx.Response) -> str | None:
        """The 409 reason, or None after noting a status no worker call may get."""
        if r.status_code == 404:
            with self.h.lock:
                self.h.lease_unknown += 1
            return "not_found"
        if r.status_code != 409:
            self.h.note(op, r)
            return None
        reason = str(r.json().get("reason"))
        with self.h.lock:
            self.h.conflicts[f"{op}:{reason}"] += 1
        return reason

    def _step(self, client: httpx.Client) -> None:
        if self.lease is None:
            r = client.post("/v1/api/steps/claim", json={
                "worker_id": self.worker_id, "max": 1, "wait_ms": CLAIM_WAIT_MS})
            if r.status_code != 200:
                self.h.note("claim", r)
                time.sleep(0.05)
                return
            leases = r.json()["leases"]
            if not leases:
                return
            self.lease = leases[0]
        lease = self.lease
        lease_id = lease["lease_id"]
        if not self.started:  # (a lease whose complete went out unanswered is started)
            r = client.post(f"/v1/api/steps/{lease_id}/started", json={})
            if r.status_code == 200:
                self.started = True
            else:
                if self._conflict("started", r) == "already_applied":
                    with self.h.lock:
                        self.h.unexpected.append(f"started {lease_id}: already_applied, never completed")
                self._drop()
                return
        out = {"acc": lease["input"]["prev"] + lease["input"]["i"], "lease_id": lease_id}
        record = (lease["run_id"], lease["step_id"], out)
        retry = self.complete_sent
        with self.h.lock:
            self.h.complete_calls += 1
            self.h.ambiguous[lease_id] = record  # until an answer comes back
        self.complete_sent = True
        r = client.post(f"/v1/api/steps/{lease_id}/complete",
                        json={"output": out, "state_patch": {lease["step_id"]: out}})
        reason = None if r.status_code == 200 else self._conflict("complete", r)
        last = lease["step_id"] == f"s{int(lease['workflow'][3:]) - 1}"
        with self.h.lock:
            if last and (r.status_code == 200 or reason == "already_applied"):
                self.h.finished.add(lease["run_id"])
            if r.status_code == 200:
                del self.h.ambiguous[lease_id]
                self.h.acked[lease_id] = record
                self.h.retried_acked += retry
            elif retry:  # an answer about the earlier, unanswered complete
                (self.h.said_applied if reason == "already_applied"
                 else self.h.said_rejected).add(lease_id)
            else:  # a clear refusal of the only complete sent: not ambiguous
                del self.h.ambiguous[lease_id]
                if reason == "already_applied":
                    self.h.unexpected.append(f"complete {lease_id}: already_applied on first send")
        if r.status_code == 200:
            self.h.ack_event.set()
        self._drop()


class Starter:
    """Starts ``seq(n)`` runs with one idempotency key each; retries unanswered starts."""

    def __init__(self, current: Current, history: History, stop: threading.Event,
                 rng: random.Random):
        self.current = current
        self.h = history
        self.stop = stop
        self.no_new_runs = threading.Event()
        self.sizes = [rng.choice(SIZES) for _ in range(MAX_RUNS)]
        self.pending: list[int] = []  # run numbers whose start got no answer
        self.next_run = 0

    def _open(self) -> int:
        with self.h.lock:
            return len(self.h.runs) + len(self.pending) - len(self.h.finished)

    def idle(self) -> bool:
        return self.no_new_runs.is_set() and not self.pending

    def run(self) -> None:
        gen_seen = 0
        client: httpx.Client | None = None
        try:
            while not self.stop.is_set():
                url, gen = self.current.get()
                if url is None:
                    continue
                if gen != gen_seen:
                    if client is not None:
                        client.close()
                    client = httpx.Client(base_url=url, timeout=CLIENT_TIMEOUT_S, trust_env=False)
                    gen_seen = gen
                assert client is not None
                if self.pending:
                    number = self.pending.pop(0)
                elif not self.no_new_runs.is_set() and self.next_run < MAX_RUNS \
                        and self._open() < BACKLOG:
                    number = self.next_run
                    self.next_run += 1
                else:
                    time.sleep(0.005)
                    continue
                self._start(client, number)
        finally:
            if client is not None:
                client.close()

    def _start(self, client: httpx.Client, number: int) -> None:
        n = self.sizes[number]
        key = f"crash-run-{number}"
        try:
            r = client.post("/v1/api/runs", json={"workflow": f"seq{n}", "input": None,
                                                  "idempotency_key": key})
        except httpx.TransportError:
            self.pending.append(number)  # ambiguous: the same key again on the next daemon
            time.sleep(0.01)
            return
        if r.status_code in (200, 201):
            with self.h.lock:
                self.h.runs[key] = (n, r.json()["run_id"])
                if r.status_code == 200:
                    self.h.start_dedup += 1
        else:
            if r.status_code != 422:  # 422: no worker registered seq(n) yet on a new directory
                self.h.note("start", r)
            self.pending.append(number)
            time.sleep(0.02)


def _wait_runs(client: httpx.Client, runs: dict[str, tuple[int, str]],
               deadline: float) -> dict[str, dict[str, Any]]:
    """Long-poll every run's result until it is terminal or the deadline passes."""
    results: dict[str, dict[str, Any]] = {}
    todo = [run_id for _, run_id in runs.values()]
    while todo and time.monotonic() < deadline:
        run_id = todo[0]
        r = client.get(f"/v1/api/runs/{run_id}/result", params={"wait_ms": 800})
        assert r.status_code == 200, r.text
        body = r.json()
        if body["status"] in ("completed", "failed", "cancelled", "timed_out"):
            results[run_id] = body
            todo.pop(0)
    for run_id in todo:
        results[run_id] = client.get(f"/v1/api/runs/{run_id}/result").json()
    return results


def _all_runs(client: httpx.Client) -> list[str]:
    ids: list[str] = []
    for n in SIZES:
        cursor: str | None = None
        for _ in range(100):
            params: dict[str, Any] = {"workflow": f"seq{n}", "limit": 1000}
            if cursor:
                params["cursor"] = cursor
            page = client.get("/v1/api/runs", params=params).json()
            ids += [run["run_id"] for run in page["runs"]]
            cursor = page["next_cursor"]
            if cursor is None:
                break
    return ids


def test_acknowledged_completions_survive_sigkill(tmp_path: Path, summary: Any) -> None:
    seed = seed_from_env(20261129)
    rng = random.Random(seed)
    data = tmp_path / "data"
    t0 = time.monotonic()
    current = Current()
    history = History()
    stop = threading.Event()
    starter = Starter(current, history, stop, rng)
    workers = [CrashWorker(i, current, history, stop) for i in range(WORKERS)]
    threads = [threading.Thread(target=w.run, name=w.name, daemon=True) for w in workers]
    threads.append(threading.Thread(target=starter.run, name="crash-starter", daemon=True))
    for t in threads:
        t.start()
    tracebacks: list[str] = []
    kills = kills_on_ack = 0
    d: DaemonProcess | None = None
    try:
        for round_no in range(KILLS):
            d = start_daemon(data, *DAEMON_ARGS)
            current.publish(d.url)
            time.sleep(rng.uniform(*ROUND_S))
            if round_no % 2:  # kill right behind an acknowledgement
                history.ack_event.clear()
                if history.ack_event.wait(2.0):
                    kills_on_ack += 1
            kill9(d)
            kills += 1
            current.publish(None)
            if "Traceback" in d.stderr():
                tracebacks.append(f"round {round_no}:\n{d.stderr()}")
            d = None

        d = start_daemon(data, *DAEMON_ARGS)
        current.publish(d.url)
        starter.no_new_runs.set()
        deadline = time.monotonic() + FINAL_DEADLINE_S
        while not starter.idle() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert starter.idle(), f"run starts still unanswered: {starter.pending}"
        with d.client() as client:
            results = _wait_runs(client, history.runs, deadline)
            stop.set()
            for t in threads:
                t.join(10)
            assert not any(t.is_alive() for t in threads), "a client thread did not stop"
            journals = {}
            states = {}
            for _, run_id in history.runs.values():
                r = client.get(f"/v1/api/runs/{run_id}/journal")
                assert r.status_code == 200, r.text
                journals[run_id] = r.json()["events"]
                states[run_id] = client.get(f"/v1/api/runs/{run_id}").json()["state"]
            listed = _all_runs(client)
        final_status = stop_daemon(d)
        if "Traceback" in d.stderr():
            tracebacks.append(f"final daemon:\n{d.stderr()}")
        d = None
    finally:
        stop.set()
        current.publish(None)
        if d is not None:
            kill9(d)
        for t in threads:
            t.join(10)

    # ------------------------------------------------------------------ check
    completed_by: dict[str, tuple[str, str]] = {}  # lease -> run, step (from journals)
    duplicated = 0
    for run_id, events in journals.items():
        slots = Counter((e["step_id"], e.get("item_index")) for e in events
                        if e["type"] == "step_completed")
        duplicated += sum(c - 1 for c in slots.values() if c > 1)
        for e in events:
            if e["type"] == "step_completed":
                completed_by[e["lease_id"]] = (run_id, e["step_id"])

    lost = []
    for lease_id, (run_id, step_id, out) in history.acked.items():
        if completed_by.get(lease_id) != (run_id, step_id) or states[run_id].get(step_id) != out:
            lost.append((lease_id, run_id, step_id, out, states[run_id].get(step_id)))
    recovered = [lid for lid in history.ambiguous if lid in completed_by]
    not_landed = [lid for lid in history.ambiguous if lid not in completed_by]
    contradictions = ([lid for lid in history.said_applied if lid not in completed_by]
                      + [lid for lid in history.said_rejected if lid in completed_by])
    attempted = set(history.acked) | set(history.ambiguous)
    unexpected = list(history.unexpected) + [
        f"step_completed for {lid}, never completed by a worker"
        for lid in completed_by if lid not in attempted]

    wrong_results = []
    for key, (n, run_id) in history.runs.items():
        body = results.get(run_id, {})
        result = body.get("result")
        if body.get("status") != "completed" or not isinstance(result, dict) \
                or result.get("acc") != n * (n - 1) // 2:
            wrong_results.append((key, run_id, body))
    run_ids = [run_id for _, run_id in history.runs.values()]
    double_created = len(listed) - len(set(run_ids))

    line = (
        f"D1 seed={seed} kills={kills} (on-ack {kills_on_ack}) runs={len(history.runs)} "
        f"completed={len(history.runs) - len(wrong_results)} complete-calls={history.complete_calls} "
        f"acknowledged={len(history.acked)} ambiguous={len(history.ambiguous)} "
        f"(recovered {len(recovered)}, not-landed {len(not_landed)}; "
        f"resent and acknowledged {history.retried_acked}) "
        f"lost={len(lost)} duplicated={duplicated} unexpected={len(unexpected)} "
        f"contradictions={len(contradictions)} lease-404={history.lease_unknown} "
        f"start-dedup={history.start_dedup} conflicts={dict(sorted(history.conflicts.items()))} "
        f"elapsed={time.monotonic() - t0:.1f}s"
    )
    summary(line)
    assert history.acked, "empty history: no completion was acknowledged (" + line + ")"
    assert kills >= KILLS
    assert not lost, f"acknowledged completions lost: {lost[:5]}"
    assert duplicated == 0
    assert not unexpected, unexpected[:5]
    assert not contradictions, contradictions[:5]
    assert not wrong_results, f"{len(wrong_results)} runs not completed right: {wrong_results[:3]}"
    assert double_created == 0, f"{len(listed)} runs listed for {len(run_ids)} keys"
    assert not history.bad_status, history.bad_status[:5]
    assert not tracebacks, tracebacks[0]
    assert final_status == 0
