"""Campaign: the daemon SIGKILLed under load, at-most-once steps included.

D1 (tests/reliability/test_crash_sigkill.py) at campaign size, with workers on
both transports and with ``at_most_once`` steps. One data directory; each round
starts ``python -m stepd serve`` on it, and against it work:

* four SDK-less workers, two over raw HTTP (claim) and two over the worker
  WebSocket (msgpack frames, credit 1, pushed leases), each holding one lease
  at a time and keeping its ``worker_id`` and its lease across daemons;
* one client starting ``camp-seq(n)`` runs (n = 3..8), one idempotency key
  each, at most 16 in flight.

The round ends with a SIGKILL of the daemon, by its PID: after a random
0.3-1.5 s, or right behind the next acknowledged ``complete``, or right behind
the next acknowledged ``started`` of an at-most-once step (one round in three
each). Rounds go on until both ``STEPD_CAMPAIGN_DAEMON_KILLS`` kills are done and
``STEPD_CAMPAIGN_DAEMON_ACKS`` completions were acknowledged; a last daemon then
lets every run end, and the history is checked against the journals.

``camp-seq(n)`` is D1's ``seq(n)`` (step k outputs ``acc = prev + k``, patched
into the state under its step id) where every odd step is ``at_most_once``
(PROTOCOL.md). A worker runs an at-most-once body only after its ``started``
was answered 200 (the daemon has persisted it); a ``started`` that got no
answer is sent again to the next daemon, and the body runs only if that one
answers 200. The workers count every body they run, per slot.

Checks (D1's, plus the at-most-once ones):

* lost 0: every acknowledged ``complete`` is in its run's journal and is the
  output the run kept;
* duplicated 0: no slot has two ``step_completed``;
* at-most-once: no slot ran its body twice (counted by the workers), no slot
  has ``step_started`` for two leases (the journal), the completion a slot
  kept is the one attempt whose body ran, and no lease whose ``started`` was
  acknowledged is unknown (404) to a later daemon;
* unexpected 0, contradictions 0 (answers to resent calls agree with the
  journal);
* every run ends ``completed`` with ``acc = n(n-1)/2``, or ``failed`` with
  ``lease_lost`` at an at-most-once step whose attempt had started (allowed by
  PROTOCOL.md "Expiry and recovery"; counted); journals consistent (dense
  sequence numbers, one terminal event, last); each key names one run;
* no daemon logs a traceback; the last one exits 0 on SIGTERM; at least
  ``STEPD_CAMPAIGN_DAEMON_ACKS`` completions were acknowledged.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.reliability.conftest import Current, DaemonProcess, kill9, start_daemon, stop_daemon

from ._common import (
    Ambiguous,
    Answer,
    HttpLink,
    Threads,
    WsLink,
    journal,
    journal_problems,
    list_runs,
    make_link,
    wait_runs,
)
from .conftest import campaign_int, campaign_seed

KILLS = campaign_int("STEPD_CAMPAIGN_DAEMON_KILLS")
ACKS = campaign_int("STEPD_CAMPAIGN_DAEMON_ACKS")
MAX_ROUNDS = 4 * KILLS + 40  # a bound only: rounds go on until both figures are reached
SIZES = range(3, 9)
TRANSPORTS = ("http", "http", "ws", "ws")
DAEMON_ARGS = ("--lease-ttl-ms", "1000", "--heartbeat-ms", "300",
               "--recovery-window-ms", "300", "--max-request-ms", "1000",
               "--shutdown-grace-ms", "2000")
ROUND_S = (0.3, 1.5)
BACKLOG = 16
MAX_RUNS = 100_000  # a bound only
FINAL_DEADLINE_S = 90.0
TIMEOUT_S = 5.0

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120 + 6 * MAX_ROUNDS)]


def seq_definition(n: int) -> dict[str, Any]:
    steps = []
    for k in range(n):
        prev: Any = 0 if k == 0 else f"${{steps.s{k - 1}.acc}}"
        step: dict[str, Any] = {"id": f"s{k}", "kind": "task", "body": "add",
                                "input": {"i": k, "prev": prev},
                                # each kill can cost a held lease one attempt
                                "retry": {"max_attempts": 1000, "initial_backoff_ms": 0}}
        if k % 2:
            step["delivery"] = "at_most_once"
        steps.append(step)
    return {"name": f"camp-seq{n}", "steps": steps}


DEFINITIONS = [seq_definition(n) for n in SIZES]

Slot = tuple[str, str, Any]  # run, step, item


@dataclass
class History:
    lock: threading.Lock = field(default_factory=threading.Lock)
    # lease -> run, step, output
    acked: dict[str, tuple[str, str, Any]] = field(default_factory=dict)
    ambiguous: dict[str, tuple[str, str, Any]] = field(default_factory=dict)
    said_applied: set[str] = field(default_factory=set)
    said_rejected: set[str] = field(default_factory=set)
    complete_calls: int = 0
    retried_acked: int = 0
    conflicts: Counter[str] = field(default_factory=Counter)
    lease_unknown: int = 0
    unexpected: list[str] = field(default_factory=list)
    bad_status: list[str] = field(default_factory=list)
    # slot -> the leases whose body ran
    bodies: dict[Slot, list[str]] = field(default_factory=lambda: defaultdict(list))
    delivery: dict[Slot, str] = field(default_factory=dict)
    amo_started_acked: set[str] = field(default_factory=set)
    amo_started_resent: int = 0  # an unanswered at-most-once `started`, sent again
    amo_held_across_kill: int = 0  # started at-most-once leases a worker carried to a new daemon
    amo_started_unknown: list[str] = field(default_factory=list)  # started acked, later 404
    by_transport: Counter[str] = field(default_factory=Counter)  # acknowledged, per transport
    ack_event: threading.Event = field(default_factory=threading.Event)
    amo_event: threading.Event = field(default_factory=threading.Event)
    runs: dict[str, tuple[int, str]] = field(default_factory=dict)  # key -> n, run id
    start_dedup: int = 0
    finished: set[str] = field(default_factory=set)

    def note(self, what: str) -> None:
        with self.lock:
            self.bad_status.append(what)


class CampaignWorker:
    """One worker thread: one lease at a time, over HTTP or the WebSocket, across daemons."""

    def __init__(self, index: int, transport: str, current: Current, history: History,
                 stop: threading.Event) -> None:
        self.name = f"camp-{transport}-{index}"
        self.transport = transport
        self.current = current
        self.h = history
        self.stop = stop
        self.worker_id: str | None = None
        self.link: HttpLink | WsLink | None = None
        self._reset_lease()

    def _reset_lease(self) -> None:
        self.lease: dict[str, Any] | None = None
        self.started = False  # `started` answered 200
        self.started_sent = False  # a `started` went out unanswered
        self.body_ran = False
        self.output: Any = None
        self.complete_sent = False  # a `complete` went out unanswered
        self.carried = False

    def run(self) -> None:
        gen_seen = 0
        try:
            while not self.stop.is_set():
                url, gen = self.current.get()
                if url is None:
                    continue
                if self.link is None or gen != gen_seen:
                    if not self._connect(url):
                        time.sleep(0.01)
                        continue
                    gen_seen = gen
                try:
                    self._step()
                except Ambiguous:
                    if self.link is not None:
                        self.link.close()
                    self.link = None  # reconnect (to this daemon, or the next one)
                    time.sleep(0.01)
        finally:
            if self.link is not None:
                self.link.close()

    def _connect(self, url: str) -> bool:
        if self.link is not None:
            self.link.close()
        self.link = make_link(self.transport, url, timeout=TIMEOUT_S)
        body: dict[str, Any] = {"name": self.name, "concurrency": 1, "definitions": DEFINITIONS}
        if self.worker_id is not None:
            body["worker_id"] = self.worker_id  # a lease belongs to the worker: keep it
        try:
            answer = self.link.register(body)
            if answer.kind != "ok":
                self.h.note(f"{self.name} register: {answer}")
                raise Ambiguous("register refused")
            self.worker_id = self.link.worker_id
            if self.lease is None:
                self.link.grant(1)
        except Ambiguous:
            self.link.close()
            self.link = None
            return False
        if self.lease is not None and self.started and self.lease["delivery"] == "at_most_once" \
                and not self.carried:
            self.carried = True
            with self.h.lock:
                self.h.amo_held_across_kill += 1
        return True

    def _drop(self) -> None:
        self._reset_lease()
        assert self.link is not None
        self.link.grant(1)

    def _refusal(self, op: str, answer: Answer) -> None:
        if answer.kind == "not_found":
            with self.h.lock:
                self.h.lease_unknown += 1
        elif answer.kind == "conflict":
            with self.h.lock:
                self.h.conflicts[f"{op}:{answer.detail}"] += 1
        else:
            self.h.note(f"{self.name} {op}: {answer}")

    def _step(self) -> None:
        assert self.link is not None
        if self.lease is None:
            leases = self.link.leases(max=1, wait_ms=300)
            if not leases:
                return
            self.lease = leases[0]
        lease = self.lease
        lease_id = lease["lease_id"]
        slot = (lease["run_id"], lease["step_id"], lease["item_index"])
        amo = lease["delivery"] == "at_most_once"
        if not self.started:
            resend = self.started_sent
            self.started_sent = True
            answer = self.link.call("started", lease_id)
            if answer.kind == "ok":
                self.started = True
                if amo:
                    with self.h.lock:
                        self.h.amo_started_acked.add(lease_id)
                        self.h.amo_started_resent += resend
                    self.h.amo_event.set()
            else:
                self._refusal("started", answer)
                if answer.kind == "conflict" and answer.detail == "already_applied" \
                        and not self.complete_sent:
                    with self.h.lock:
                        self.h.unexpected.append(
                            f"started {lease_id}: already_applied, never completed")
                if amo and lease_id in self.h.amo_started_acked and answer.kind == "not_found":
                    with self.h.lock:
                        self.h.amo_started_unknown.append(lease_id)
                self._drop()
                return
        if not self.body_ran:  # the body: only after `started` was acknowledged
            self.body_ran = True
            acc = lease["input"]["prev"] + lease["input"]["i"]
            self.output = {"acc": acc, "lease_id": lease_id}
            with self.h.lock:
                self.h.bodies[slot].append(lease_id)
                self.h.delivery[slot] = lease["delivery"]
        out = self.output
        record = (lease["run_id"], lease["step_id"], out)
        retry = self.complete_sent
        with self.h.lock:
            self.h.complete_calls += 1
            self.h.ambiguous[lease_id] = record  # until an answer comes back
        self.complete_sent = True
        answer = self.link.call("complete", lease_id, {"output": out,
                                                       "state_patch": {lease["step_id"]: out}})
        reason = answer.detail if answer.kind == "conflict" else answer.kind
        if answer.kind != "ok":
            self._refusal("complete", answer)
            if amo and lease_id in self.h.amo_started_acked and answer.kind == "not_found":
                with self.h.lock:
                    self.h.amo_started_unknown.append(lease_id)
        last = lease["step_id"] == f"s{int(lease['workflow'].removeprefix('camp-seq')) - 1}"
        with self.h.lock:
            if (last and reason in ("ok", "already_applied")) or reason == "run_terminal" \
                    or (amo and reason == "fenced"):
                self.h.finished.add(lease["run_id"])
            if answer.kind == "ok":
                del self.h.ambiguous[lease_id]
                self.h.acked[lease_id] = record
                self.h.retried_acked += retry
                self.h.by_transport[self.transport] += 1
            elif retry:  # an answer about the earlier, unanswered complete
                said = self.h.said_applied if reason == "already_applied" else self.h.said_rejected
                said.add(lease_id)
            else:
                del self.h.ambiguous[lease_id]
                if reason == "already_applied":
                    self.h.unexpected.append(f"complete {lease_id}: already_applied on first send")
        if answer.kind == "ok":
            self.h.ack_event.set()
        self._drop()


class Starter:
    """Starts ``camp-seq(n)`` runs, one idempotency key each; resends unanswered starts."""

    def __init__(self, current: Current, history: History, stop: threading.Event,
                 rng: random.Random) -> None:
        self.current = current
        self.h = history
        self.stop = stop
        self.rng = rng
        self.no_new_runs = threading.Event()
        self.sizes: dict[int, int] = {}
        self.pending: list[int] = []
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
                    client = httpx.Client(base_url=url, timeout=TIMEOUT_S, trust_env=False)
                    gen_seen = gen
                assert client is not None
                if self.pending:
                    number = self.pending.pop(0)
                elif not self.no_new_runs.is_set() and self.next_run < MAX_RUNS \
                        and self._open() < BACKLOG:
                    number = self.next_run
                    self.next_run += 1
                    self.sizes[number] = self.rng.choice(SIZES)
                else:
                    time.sleep(0.005)
                    continue
                self._start(client, number)
        finally:
            if client is not None:
                client.close()

    def _start(self, client: httpx.Client, number: int) -> None:
        n = self.sizes[number]
        key = f"camp-run-{number}"
        try:
            r = client.post("/v1/api/runs", json={"workflow": f"camp-seq{n}", "input": None,
                                                  "idempotency_key": key})
        except httpx.TransportError:
            self.pending.append(number)
            time.sleep(0.01)
            return
        if r.status_code in (200, 201):
            with self.h.lock:
                self.h.runs[key] = (n, r.json()["run_id"])
                self.h.start_dedup += r.status_code == 200
        else:
            if r.status_code != 422:  # 422: no worker registered the workflow yet
                self.h.note(f"start -> {r.status_code} {r.text[:200]}")
            self.pending.append(number)
            time.sleep(0.02)


def test_daemon_sigkill_campaign(tmp_path: Path, summary: Any) -> None:
    seed = campaign_seed()
    rng = random.Random(seed)
    data = tmp_path / "data"
    t0 = time.monotonic()
    current = Current()
    history = History()
    stop = threading.Event()
    starter = Starter(current, history, stop, random.Random(seed + 1))
    workers = [CampaignWorker(i, t, current, history, stop) for i, t in enumerate(TRANSPORTS)]
    threads = Threads()
    for w in workers:
        threads.start(w.name, w.run)
    threads.start("camp-starter", starter.run)
    tracebacks: list[str] = []
    kills = 0
    kill_modes: Counter[str] = Counter()
    d: DaemonProcess | None = None
    try:
        for round_no in range(MAX_ROUNDS):
            if kills >= KILLS and len(history.acked) >= ACKS:
                break
            d = start_daemon(data, *DAEMON_ARGS)
            current.publish(d.url)
            time.sleep(rng.uniform(*ROUND_S))
            mode = ("time", "on-ack", "on-amo-started")[round_no % 3]
            if mode == "on-ack":
                history.ack_event.clear()
                if not history.ack_event.wait(2.0):
                    mode = "time"
            elif mode == "on-amo-started":
                history.amo_event.clear()
                if not history.amo_event.wait(2.0):
                    mode = "time"
            kill9(d)
            kills += 1
            kill_modes[mode] += 1
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
        with d.client(timeout=30.0) as client:
            run_ids = [run_id for _, run_id in history.runs.values()]
            results = wait_runs(client, run_ids, deadline)
            stop.set()
            alive = threads.join()
            assert not alive, f"client threads did not stop: {alive}"
            journals = {run_id: journal(client, run_id) for run_id in run_ids}
            states = {run_id: client.get(f"/v1/api/runs/{run_id}").json()["state"]
                      for run_id in run_ids}
            listed = [r for n in SIZES for r in list_runs(client, f"camp-seq{n}")]
        final_status = stop_daemon(d)
        if "Traceback" in d.stderr():
            tracebacks.append(f"final daemon:\n{d.stderr()}")
        d = None
    finally:
        stop.set()
        current.publish(None)
        if d is not None:
            kill9(d)
        threads.join()

    # ------------------------------------------------------------------ check
    completed_by: dict[str, tuple[str, str]] = {}
    duplicated = 0
    journal_bad: list[str] = []
    started_leases: dict[Slot, set[str]] = defaultdict(set)
    kept: dict[Slot, str] = {}
    failed_lost: dict[str, Slot] = {}
    for run_id, events in journals.items():
        journal_bad += journal_problems(run_id, events, results[run_id].get("status"))
        slots = Counter((e["step_id"], e.get("item_index")) for e in events
                        if e["type"] == "step_completed")
        duplicated += sum(c - 1 for c in slots.values() if c > 1)
        for e in events:
            slot: Slot = (run_id, str(e.get("step_id")), e.get("item_index"))
            if e["type"] == "step_completed":
                completed_by[e["lease_id"]] = (run_id, e["step_id"])
                kept[slot] = e["lease_id"]
            elif e["type"] == "step_started":
                started_leases[slot].add(e["lease_id"])
            elif e["type"] == "step_failed" and e.get("error_class") == "lost":
                failed_lost[run_id] = slot

    lost = [(lid, run_id, step_id) for lid, (run_id, step_id, out) in history.acked.items()
            if completed_by.get(lid) != (run_id, step_id) or states[run_id].get(step_id) != out]
    recovered = [lid for lid in history.ambiguous if lid in completed_by]
    not_landed = [lid for lid in history.ambiguous if lid not in completed_by]
    contradictions = ([lid for lid in history.said_applied if lid not in completed_by]
                      + [lid for lid in history.said_rejected if lid in completed_by])
    attempted = set(history.acked) | set(history.ambiguous)
    unexpected = list(history.unexpected) + [
        f"step_completed for {lid}, never completed by a worker" for lid in completed_by
        if lid not in attempted]

    amo_slots = [s for s, d_ in history.delivery.items() if d_ == "at_most_once"]
    amo_bodies = sum(len(history.bodies[s]) for s in amo_slots)
    amo_twice = [(s, history.bodies[s]) for s in amo_slots if len(history.bodies[s]) > 1]
    amo_started_twice = [(s, ls) for s, ls in started_leases.items()
                         if s[1] is not None and int(s[1][1:]) % 2 and len(ls) > 1]
    amo_kept_other = [(s, kept[s], history.bodies[s]) for s in amo_slots
                      if s in kept and history.bodies[s] and kept[s] != history.bodies[s][0]]
    alo_reexecuted = sum(1 for s, d_ in history.delivery.items()
                         if d_ == "at_least_once" and len(history.bodies[s]) > 1)

    wrong: list[Any] = []
    lost_runs = 0
    for key, (n, run_id) in history.runs.items():
        body = results.get(run_id, {})
        result = body.get("result")
        if body.get("status") == "completed" and isinstance(result, dict) \
                and result.get("acc") == n * (n - 1) // 2:
            continue
        error = body.get("error") or {}
        lost_slot = failed_lost.get(run_id)
        if body.get("status") == "failed" and error.get("reason") == "lease_lost" and lost_slot \
                and int(lost_slot[1][1:]) % 2 and started_leases.get(lost_slot):
            lost_runs += 1  # an at-most-once attempt that had started and was lost: allowed
            continue
        wrong.append((key, run_id, body))
    double_created = len(listed) - len({run_id for _, run_id in history.runs.values()})

    line = (
        f"campaign-daemon-sigkill seed={seed} kills={kills} {dict(kill_modes)} "
        f"runs={len(history.runs)} completed={len(history.runs) - len(wrong) - lost_runs} "
        f"failed-lease-lost={lost_runs} complete-calls={history.complete_calls} "
        f"acknowledged={len(history.acked)} {dict(history.by_transport)} "
        f"ambiguous={len(history.ambiguous)} (recovered {len(recovered)}, not-landed "
        f"{len(not_landed)}; resent and acknowledged {history.retried_acked}) "
        f"lost={len(lost)} duplicated={duplicated} amo-slots={len(amo_slots)} "
        f"amo-bodies={amo_bodies} amo-started-acked={len(history.amo_started_acked)} "
        f"(resent {history.amo_started_resent}, "
        f"carried across a kill {history.amo_held_across_kill}) "
        f"amo-ran-twice={len(amo_twice)} amo-started-twice={len(amo_started_twice)} "
        f"amo-kept-other={len(amo_kept_other)} "
        f"amo-started-then-404={len(history.amo_started_unknown)} "
        f"alo-reexecuted={alo_reexecuted} unexpected={len(unexpected)} "
        f"contradictions={len(contradictions)} journal-violations={len(journal_bad)} "
        f"wrong-runs={len(wrong)} lease-404={history.lease_unknown} "
        f"start-dedup={history.start_dedup} "
        f"conflicts={dict(sorted(history.conflicts.items()))} elapsed={time.monotonic() - t0:.1f}s"
    )
    summary(line)
    assert not threads.errors, threads.errors[0]
    assert history.acked, "empty history: " + line
    assert kills >= KILLS, line
    assert len(history.acked) >= ACKS, f"fewer than {ACKS} completions acknowledged: {line}"
    assert not lost, f"acknowledged completions lost: {lost[:5]}"
    assert duplicated == 0
    assert not amo_twice, f"at-most-once bodies ran twice: {amo_twice[:5]}"
    assert not amo_started_twice, amo_started_twice[:5]
    assert not amo_kept_other, amo_kept_other[:5]
    assert not history.amo_started_unknown, history.amo_started_unknown[:5]
    assert not unexpected, unexpected[:5]
    assert not contradictions, contradictions[:5]
    assert not journal_bad, journal_bad[:5]
    assert not wrong, f"{len(wrong)} runs not ended right: {wrong[:3]}"
    assert double_created == 0, f"{len(listed)} runs listed for {len(history.runs)} keys"
    assert not history.bad_status, history.bad_status[:5]
    assert not tracebacks, tracebacks[0]
    assert final_status == 0
