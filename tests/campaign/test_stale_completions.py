"""Campaign: late, doubled and reordered worker calls get the right one of the four 409s.

One ``stepd serve`` (``--lease-ttl-ms 1500 --heartbeat-ms 500
--recovery-window-ms 1500``), restarted twice on the same directory: after a
third of the calls by SIGTERM, after two thirds by SIGKILL. Two SDK-less
workers speak PROTOCOL.md: W1 registers over HTTP and also opens a WebSocket
with the same ``worker_id`` (msgpack frames, no credit: its leases come from
``claim``), and reconnects
that WebSocket now and then (close, a new connection, ``register`` with its
``worker_id``); W2 gets its leases pushed over its own WebSocket. Each call
goes over HTTP or a WebSocket at random.

The test drives scenarios on real runs and leases, and a small model of
PROTOCOL.md ("The four rejections", "Expiry and recovery"), fed only with what
the test did, says what each call must get: per lease, whether its own
``complete``/``fail`` landed, whether it was superseded (recovered after its
TTL and window, or its step timed out), whether its run is over (completed,
failed, cancelled), whether ``started`` arrived; the first applicable of
``already_applied``, ``fenced``, ``run_terminal``, ``not_started`` wins, and
otherwise the call must be accepted. The daemon's answer is compared with it.

Scenarios (mixed at random, in rounds):

* ``double-complete``/``double-fail``: a second (third...) complete,
  heartbeat, fail and started after the lease's own complete or fail;
* ``amo-unstarted``: complete and fail of an at-most-once lease before
  ``started`` (``not_started``), then heartbeat, started, complete (accepted);
* ``alo-unstarted``: complete without started on an at-least-once lease
  (accepted), then the doubles;
* ``cancelled``: calls after the run was cancelled, with and without
  ``started`` (``run_terminal`` wins over ``not_started``);
* ``completed-then-cancelled``: step a completed, step b held, run cancelled
  (a: ``already_applied`` wins over ``run_terminal``; b: ``run_terminal``);
* ``sibling-failed``: a ``for_each`` item fails fatally; its sibling's lease
  gets ``run_terminal``;
* ``pipelined``: frames of one lease sent on one WebSocket without waiting
  (complete before started, doubled completes);
* ``concurrent-double``: the same complete at once over HTTP and the
  WebSocket (one accepted, one ``already_applied``);
* ``expired``: a lease (at-least-once or at-most-once, started or not) left
  silent until the journal shows it recovered: ``fenced``, also after the
  next attempt completed the step or the run failed ``lease_lost``
  (``fenced`` wins over ``run_terminal``);
* ``revived``: a heartbeat after ``step_orphaned`` and before the window
  ends revives the lease (accepted);
* ``timed-out``: a step whose ``timeout_ms`` passed: ``fenced``, then the
  next attempt completes;
* ``pushed``: a lease pushed over W2's WebSocket, completed and doubled;
* ``held``: leases left live across each restart (an at-most-once lease
  not started, one started, an at-least-once one, each on record first): the
  new daemon gives them a full TTL, still refuses ``complete``/``fail`` of the
  unstarted at-most-once one with ``not_started``, and accepts the rest;
* after each restart, every ended lease so far is probed again: the new
  daemon must judge from its records exactly as the old one did.

Checks: ``STEPD_CAMPAIGN_STALE`` calls that must be refused were sent; 0 of
them accepted, 0 refused with another reason, 0 calls the model accepts
refused, every run's journal consistent (dense sequence numbers, one
``step_completed`` per slot, terminal event last). A lease that expired
although no scenario let it expire (the test was too slow) is counted apart
as ``timing`` and its answers are not judged.
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.reliability.conftest import DaemonProcess, kill9, start_daemon, stop_daemon

from ._common import Ambiguous, Answer, HttpLink, WsLink, journal, journal_problems, wait_runs
from .conftest import campaign_int, campaign_seed

STALE = campaign_int("STEPD_CAMPAIGN_STALE")
TTL_MS = 1500
WINDOW_MS = 1500
DAEMON_ARGS = ("--lease-ttl-ms", str(TTL_MS), "--heartbeat-ms", "500",
               "--recovery-window-ms", str(WINDOW_MS), "--max-request-ms", "2000")
EXPIRY_WAIT_S = 30.0  # bound on waiting for the daemon to orphan/recover a lease
OPS = ("complete", "heartbeat", "fail", "started")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300 + STALE // 2)]

RETRY = {"max_attempts": 5, "initial_backoff_ms": 0}


def definitions(tag: str) -> dict[str, dict[str, Any]]:
    def one(name: str, **opts: Any) -> dict[str, Any]:
        return {"name": f"{name}-{tag}", "steps": [
            {"id": "t", "kind": "task", "body": "t", "retry": RETRY, **opts}]}

    return {
        "alo": one("st-alo"),
        "amo": one("st-amo", delivery="at_most_once"),
        "timeout": one("st-timeout", timeout_ms=400),
        "two": {"name": f"st-two-{tag}", "steps": [
            {"id": "a", "kind": "task", "body": "a", "retry": RETRY},
            {"id": "b", "kind": "task", "body": "b", "retry": RETRY}]},
        "fe": {"name": f"st-fe-{tag}", "steps": [
            {"id": "f", "kind": "for_each", "items": "${input}", "body": "f",
             "retry": {"max_attempts": 1}}]},
        "push": one("st-push"),
    }


# --------------------------------------------------------------------------- the model


@dataclass
class Run:
    run_id: str
    scenario: str
    over: bool = False


@dataclass
class Lease:
    """What the test knows of one lease, from what it did (PROTOCOL.md's rules)."""

    lease: dict[str, Any]
    run: Run
    scenario: str
    started: bool = False
    own_end: str | None = None  # "complete" | "fail": its own call landed
    superseded: bool = False  # recovered after TTL + window, or its step timed out
    may_expire: bool = False  # the scenario lets it expire (else an expiry is `timing`)
    owner: str = "w1"  # the worker holding it: WebSocket calls go over that worker's socket

    @property
    def lease_id(self) -> str:
        return str(self.lease["lease_id"])

    @property
    def amo(self) -> bool:
        return bool(self.lease["delivery"] == "at_most_once")

    def expect(self, op: str) -> str:
        """PROTOCOL.md "The four rejections": the first that applies, else ``ok``."""
        if self.own_end:
            return "already_applied"
        if self.superseded:
            return "fenced"
        if self.run.over:
            return "run_terminal"
        if op in ("complete", "fail") and self.amo and not self.started:
            return "not_started"
        return "ok"

    def applied(self, op: str) -> None:
        if op == "started":
            self.started = True
        elif op in ("complete", "fail"):
            self.own_end = op


@dataclass
class Tally:
    lock: threading.Lock = field(default_factory=threading.Lock)
    calls: int = 0
    must_refuse: int = 0  # calls the model says must be refused (the figure)
    by_expected: Counter[str] = field(default_factory=Counter)  # "op:expected"
    by_transport: Counter[str] = field(default_factory=Counter)
    by_scenario: Counter[str] = field(default_factory=Counter)
    accepted_wrongly: list[str] = field(default_factory=list)
    wrong_reason: list[str] = field(default_factory=list)
    refused_wrongly: list[str] = field(default_factory=list)
    other: list[str] = field(default_factory=list)
    records: list[tuple[Lease, str, str, str, str]] = field(default_factory=list)
    replayed: int = 0
    reconnects: int = 0
    revive_missed: int = 0  # the daemon recovered before the reviving heartbeat arrived


class Campaign:
    def __init__(self, data: Path, rng: random.Random, tally: Tally) -> None:
        self.data = data
        self.rng = rng
        self.t = tally
        self.tag = uuid.uuid4().hex[:6]
        self.defs = definitions(self.tag)
        self.d: DaemonProcess | None = None
        self.http: httpx.Client | None = None
        self.w1: HttpLink | None = None
        self.w1ws: WsLink | None = None
        self.w2ws: WsLink | None = None
        self.w1_id: str | None = None
        self.w2_id: str | None = None
        self.runs: list[Run] = []
        self.leases: list[Lease] = []
        self.tracebacks: list[str] = []

    # ------------------------------------------------------------------ daemon and links

    def start(self) -> None:
        self.d = start_daemon(self.data, *DAEMON_ARGS)
        self.http = self.d.client(timeout=15.0)
        self.w1 = HttpLink(self.d.url, timeout=15.0)
        body: dict[str, Any] = {"name": "stale-w1", "concurrency": 64,
                                "definitions": self.w1_defs()}
        if self.w1_id:
            body["worker_id"] = self.w1_id
        assert self.w1.register(body).kind == "ok"
        self.w1_id = self.w1.worker_id
        self.w1ws = None
        self._ws1()
        self.w2ws = None
        if self.w2_id is None:
            self.w2ws = WsLink(self.d.url, timeout=15.0)
            answer = self.w2ws.register({"name": "stale-w2", "concurrency": 8,
                                         "definitions": [self.defs["push"]]})
            assert answer.kind == "ok", answer
            self.w2_id = self.w2ws.worker_id
        self._ws2()

    def w1_defs(self) -> list[dict[str, Any]]:
        return [v for k, v in self.defs.items() if k != "push"]

    def _ws1(self) -> WsLink:
        if self.w1ws is None:
            assert self.d is not None
            self.w1ws = WsLink(self.d.url, timeout=15.0)
            answer = self.w1ws.register({"name": "stale-w1", "worker_id": self.w1_id,
                                         "concurrency": 64, "definitions": self.w1_defs()})
            assert answer.kind == "ok", answer
        return self.w1ws

    def _ws2(self) -> WsLink:
        if self.w2ws is None:
            assert self.d is not None
            self.w2ws = WsLink(self.d.url, timeout=15.0)
            answer = self.w2ws.register({"name": "stale-w2", "worker_id": self.w2_id,
                                         "concurrency": 8, "definitions": [self.defs["push"]]})
            assert answer.kind == "ok", answer
        return self.w2ws

    def reconnect(self, owner: str = "w1") -> None:
        """A worker drops its WebSocket and opens a new one, registering with its worker_id."""
        if owner == "w1":
            if self.w1ws is not None:
                self.w1ws.close()
            self.w1ws = None
            self._ws1()
        else:
            if self.w2ws is not None:
                self.w2ws.close()
            self.w2ws = None
            self._ws2()
        self.t.reconnects += 1

    def stop(self, *, graceful: bool = True) -> int | None:
        status = None
        for link in (self.w1, self.w1ws, self.w2ws):
            if link is not None:
                link.close()
        if self.http is not None:
            self.http.close()
        if self.d is not None:
            status = stop_daemon(self.d) if graceful else kill9(self.d)
            if "Traceback" in self.d.stderr():
                self.tracebacks.append(self.d.stderr())
        self.d = None
        return status

    # ------------------------------------------------------------------ runs and leases

    def run(self, kind: str, scenario: str, input: Any = None) -> Run:
        assert self.http is not None
        r = self.http.post("/v1/api/runs",
                           json={"workflow": self.defs[kind]["name"], "input": input})
        assert r.status_code == 201, r.text
        run = Run(r.json()["run_id"], scenario)
        self.runs.append(run)
        return run

    def claim(self, run: Run, scenario: str, n: int = 1, *,
              may_expire: bool = False) -> list[Lease]:
        assert self.w1 is not None
        got: list[dict[str, Any]] = []
        deadline = time.monotonic() + 20
        while len(got) < n and time.monotonic() < deadline:
            got += self.w1.leases(max=n - len(got), wait_ms=1000, run_id=run.run_id)
        assert len(got) == n, f"{scenario}: {len(got)} of {n} leases offered for {run.run_id}"
        out = [Lease(lease, run, scenario, may_expire=may_expire) for lease in
               sorted(got, key=lambda x: x["item_index"] or 0)]
        self.leases += out
        return out

    def cancel(self, run: Run) -> None:
        assert self.http is not None
        r = self.http.post(f"/v1/api/runs/{run.run_id}/cancel")
        assert r.status_code == 200, r.text
        run.over = True

    def journal(self, run: Run) -> list[dict[str, Any]]:
        assert self.http is not None
        return journal(self.http, run.run_id)

    # ------------------------------------------------------------------ calls

    @staticmethod
    def body(op: str, m: Lease, cls: str = "retryable") -> dict[str, Any]:
        if op == "complete":
            return {"output": {"by": m.lease_id}}
        if op == "fail":
            return {"error": {"class": cls, "message": f"{m.scenario} {m.lease_id}"}}
        return {}

    def link(self, transport: str, owner: str = "w1") -> HttpLink | WsLink:
        if transport == "http":
            assert self.w1 is not None
            return self.w1  # HTTP calls name no worker: any client may send them
        return self._ws1() if owner == "w1" else self._ws2()

    def send(self, m: Lease, op: str, transport: str, cls: str = "retryable") -> Answer:
        try:
            return self.link(transport, m.owner).call(op, m.lease_id, self.body(op, m, cls))
        except Ambiguous as exc:  # no fault here: a lost answer is itself a finding
            return Answer("error", f"no answer: {exc}")

    def call(self, m: Lease, op: str, *, transport: str | None = None,
             cls: str = "retryable") -> str:
        """One worker call, judged against the model; returns the answer's label."""
        transport = transport or self.rng.choice(("http", "ws"))
        want = m.expect(op)
        answer = self.send(m, op, transport, cls)
        self.judge(m, op, transport, want, answer)
        return answer.label

    def judge(self, m: Lease, op: str, transport: str, want: str, answer: Answer) -> None:
        got = answer.label
        t = self.t
        t.calls += 1
        t.by_transport[transport] += 1
        t.by_scenario[m.scenario] += 1
        t.by_expected[f"{op}:{want}"] += 1
        t.records.append((m, op, transport, want, got))
        if want != "ok":
            t.must_refuse += 1
        if got == "ok":  # (when it should not have been, the model follows the daemon)
            m.applied(op)
            if op == "complete" and self.ends_run(m):
                m.run.over = True

    def ends_run(self, m: Lease) -> bool:
        """A complete of the run's last step ends it (single-step workflows, and step b)."""
        return m.lease["step_id"] in ("t", "b")

    def probe(self, m: Lease, ops: tuple[str, ...] = OPS) -> None:
        """The late calls: each op once, in random order, over random transports."""
        if self.rng.random() < 0.3:
            self.reconnect(m.owner)
        for op in self.rng.sample(ops, len(ops)):
            assert m.expect(op) != "ok", (m.scenario, op)
            self.call(m, op)

    # ------------------------------------------------------------------ scenarios

    def double_complete(self, kind: str) -> None:
        name = f"double-complete-{kind}"
        (m,) = self.claim(self.run(kind, name), name)
        self.call(m, "started")
        self.call(m, "complete")
        self.probe(m)

    def double_fail(self, kind: str) -> None:
        name = f"double-fail-{kind}"
        run = self.run(kind, name)
        (m,) = self.claim(run, name)
        self.call(m, "started")
        self.call(m, "fail", cls="retryable")  # a next attempt is queued
        self.probe(m)
        self.cancel(run)  # ends the next attempt; m stays already_applied
        self.probe(m)

    def amo_unstarted(self) -> None:
        name = "amo-unstarted"
        (m,) = self.claim(self.run("amo", name), name)
        for op in ("complete", "fail", "complete", "fail"):  # not_started, over both transports
            if self.rng.random() < 0.3:
                self.reconnect()
            self.call(m, op)
        self.call(m, "heartbeat")
        self.call(m, "started")
        self.call(m, "complete")
        self.probe(m)

    def alo_unstarted(self) -> None:
        name = "alo-unstarted"
        (m,) = self.claim(self.run("alo", name), name)
        self.call(m, "complete")  # at-least-once: no `started` needed
        self.probe(m)

    def cancelled(self, kind: str, started: bool) -> None:
        name = f"cancelled-{kind}-{'started' if started else 'offered'}"
        run = self.run(kind, name)
        (m,) = self.claim(run, name)
        if started:
            self.call(m, "started")
        self.cancel(run)
        self.probe(m)

    def completed_then_cancelled(self) -> None:
        name = "completed-then-cancelled"
        run = self.run("two", name)
        (a,) = self.claim(run, name)
        self.call(a, "started")
        self.call(a, "complete")
        (b,) = self.claim(run, name)
        self.call(b, "started")
        self.cancel(run)
        self.probe(a)
        self.probe(b)

    def sibling_failed(self) -> None:
        name = "sibling-failed"
        run = self.run("fe", name, [1, 2])
        first, second = self.claim(run, name, 2)
        self.call(first, "started")
        self.call(second, "started")
        self.call(first, "fail", cls="fatal")  # max_attempts 1: the run fails
        run.over = True
        self.probe(second)
        self.probe(first)

    def pipelined(self, kind: str) -> None:
        name = f"pipelined-{kind}"
        (m,) = self.claim(self.run(kind, name), name)
        ops = ["complete", "started", "complete", "heartbeat", "fail"]
        wants = []
        # The model walks the frames in the order the daemon applies them.
        shadow = Lease(dict(m.lease), Run(m.run.run_id, name, m.run.over), name, m.started,
                       m.own_end, m.superseded)
        for op in ops:
            want = shadow.expect(op)
            wants.append(want)
            if want == "ok":
                shadow.applied(op)
        ws = self._ws1()
        try:
            answers = ws.pipeline([(op, m.lease_id, self.body(op, m)) for op in ops])
        except Ambiguous as exc:
            answers = [Answer("error", f"no answer: {exc}")] * len(ops)
        for op, want, answer in zip(ops, wants, answers):
            self.judge(m, op, "ws", want, answer)
        if m.own_end == "complete":
            m.run.over = True

    def concurrent_double(self, kind: str) -> None:
        name = f"concurrent-double-{kind}"
        (m,) = self.claim(self.run(kind, name), name)
        self.call(m, "started")
        http, ws = self.link("http"), self._ws1()
        go = threading.Barrier(2, timeout=10)
        answers: dict[str, Answer] = {}

        def send(link: HttpLink | WsLink, key: str) -> None:
            go.wait()
            try:
                answers[key] = link.call("complete", m.lease_id, self.body("complete", m))
            except Ambiguous as exc:
                answers[key] = Answer("error", f"no answer: {exc}")

        t = threading.Thread(target=send, args=(ws, "ws"), daemon=True)
        t.start()
        send(http, "http")
        t.join(20)
        labels = sorted(a.label for a in answers.values())
        # Exactly one lands; which one is the daemon's choice. Judge each against that.
        winner = next((k for k in ("http", "ws") if k in answers and answers[k].label == "ok"),
                      "http")
        loser = "ws" if winner == "http" else "http"
        self.judge(m, "complete", winner, "ok", answers.get(winner, Answer("error", "no answer")))
        self.judge(m, "complete", loser, m.expect("complete"),
                   answers.get(loser, Answer("error", "no answer")))
        if labels != ["already_applied", "ok"]:
            self.t.other.append(f"{name} {m.lease_id}: both answers {labels}")
        self.probe(m)

    def pushed(self) -> None:
        name = "pushed"
        w2 = self._ws2()
        w2.grant(1)
        run = self.run("push", name)
        leases: list[dict[str, Any]] = []
        deadline = time.monotonic() + 20
        while not leases and time.monotonic() < deadline:
            leases = w2.leases(wait_ms=1000)
        assert leases, "no lease pushed"
        m = Lease(leases[0], run, name, owner="w2")
        assert m.lease["run_id"] == run.run_id
        self.leases.append(m)
        self.call(m, "started", transport="ws")
        self.call(m, "complete", transport="ws")
        self.probe(m)

    # ------------------------------------------------------------------ expiry scenarios

    def expiry_round(self, n: int) -> None:
        """``n`` leases left silent (one revived, one timed out), judged once the daemon acted."""
        kinds = [("alo", True), ("alo", False), ("amo", True), ("amo", False)]
        held: list[Lease] = []
        for i in range(n):
            kind, started = kinds[i % len(kinds)]
            name = f"expired-{kind}-{'started' if started else 'offered'}"
            (m,) = self.claim(self.run(kind, name), name, may_expire=True)
            if started:
                self.call(m, "started")
            held.append(m)
        (revive,) = self.claim(self.run("alo", "revived"), "revived", may_expire=True)
        self.call(revive, "started")
        (slow,) = self.claim(self.run("timeout", "timed-out"), "timed-out", may_expire=True)
        self.call(slow, "started")

        pending = {m.lease_id: m for m in held + [slow]}
        revive_pending = True
        deadline = time.monotonic() + EXPIRY_WAIT_S
        while (pending or revive_pending) and time.monotonic() < deadline:
            if revive_pending:
                types = [e["type"] for e in self.journal(revive.run)
                         if e.get("lease_id") == revive.lease_id]
                if "step_orphaned" in types:
                    revive_pending = False
                    self.revive(revive, types)
            for lease_id, m in list(pending.items()):
                events = [e for e in self.journal(m.run) if e.get("lease_id") == lease_id]
                if m.scenario == "timed-out":
                    done = any(e["type"] == "step_failed" and e.get("error_class") == "timeout"
                               for e in events)
                else:
                    done = any(e["type"] == "step_recovered" for e in events)
                if done:
                    m.superseded = True
                    if m.amo and m.started:
                        m.run.over = True  # at-most-once, started, lost: the run fails lease_lost
                    del pending[lease_id]
            time.sleep(0.05)
        assert not pending, f"not recovered within {EXPIRY_WAIT_S} s: {sorted(pending)}"
        assert not revive_pending, "the revived lease was never orphaned"

        if revive.expect("complete") == "ok":
            self.call(revive, "complete")
            self.probe(revive)
        for m in held + [slow]:
            self.probe(m)
            if m.run.over:
                continue
            # The step goes on under a new lease (a new attempt, or the same
            # at-most-once attempt re-offered): it completes, and m stays fenced.
            (nxt,) = self.claim(m.run, m.scenario + "-next")
            self.call(nxt, "started")
            self.call(nxt, "complete")
            self.probe(m, ("complete", "heartbeat"))

    def revive(self, m: Lease, types: list[str]) -> None:
        """A heartbeat on an orphaned lease, inside the recovery window: it must revive it."""
        if "step_recovered" in types:  # the window had closed already: nothing to revive
            m.superseded = True
            self.t.revive_missed += 1
        transport = self.rng.choice(("http", "ws"))
        want = m.expect("heartbeat")
        answer = self.send(m, "heartbeat", transport)
        if want == "ok" and answer.label == "fenced":
            # Did the window close between our look and the heartbeat? The journal says.
            order = [e["type"] for e in self.journal(m.run) if e.get("lease_id") == m.lease_id]
            if "step_revived" not in order and "step_recovered" in order:
                self.t.revive_missed += 1
                m.superseded = True
                want = "fenced"
        self.judge(m, "heartbeat", transport, want, answer)

    # ------------------------------------------------------------------ across a restart

    def hold(self) -> list[Lease]:
        """Leases left live across the coming restart (at-most-once offered/started, at-least-once).

        The offer of a lease is written behind (docs/leases.md): wait until each
        is on record (the journal shows it), so even a SIGKILL keeps it.
        """
        held = []
        for kind, started in (("amo", False), ("amo", True), ("alo", True)):
            name = f"held-{kind}-{'started' if started else 'offered'}"
            (m,) = self.claim(self.run(kind, name), name)
            if started:
                self.call(m, "started")
            held.append(m)
        deadline = time.monotonic() + 10
        for m in held:
            while time.monotonic() < deadline and not any(
                    e["type"] == "step_offered" and e.get("lease_id") == m.lease_id
                    for e in self.journal(m.run)):
                time.sleep(0.02)
        return held

    def use_held(self, held: list[Lease]) -> None:
        """After the restart: the held leases are live (a full TTL again) and judged as before."""
        for m in held:
            if m.amo and not m.started:
                for op in self.rng.sample(["complete", "fail"], 2):
                    self.call(m, op)  # not_started: `started` never arrived, before or after
                self.call(m, "heartbeat")
                self.call(m, "started")
            else:
                self.call(m, "heartbeat")
            self.call(m, "complete")
            self.probe(m)

    # ------------------------------------------------------------------ replay

    def replay(self) -> None:
        """After a restart: every lease that is over, probed once more."""
        for m in list(self.leases):
            if all(m.expect(op) != "ok" for op in OPS):
                before = self.t.calls
                self.probe(m)
                self.t.replayed += self.t.calls - before


def test_stale_worker_calls_get_the_right_409(tmp_path: Path, summary: Any) -> None:
    seed = campaign_seed()
    rng = random.Random(seed)
    t0 = time.monotonic()
    tally = Tally()
    c = Campaign(tmp_path / "data", rng, tally)
    quick = [
        lambda: c.double_complete("alo"), lambda: c.double_complete("amo"),
        lambda: c.double_fail("alo"), lambda: c.double_fail("amo"),
        c.amo_unstarted, c.alo_unstarted,
        lambda: c.cancelled("alo", True), lambda: c.cancelled("amo", True),
        lambda: c.cancelled("amo", False), lambda: c.cancelled("alo", False),
        c.completed_then_cancelled, c.sibling_failed,
        lambda: c.pipelined("amo"), lambda: c.pipelined("alo"),
        lambda: c.concurrent_double("alo"), lambda: c.concurrent_double("amo"),
        c.pushed,
    ]
    plan = [(STALE // 3, "sigterm"), (2 * STALE // 3, "sigkill")]  # restarts, then a replay each
    restarts: list[str] = []
    statuses: list[int | None] = []
    journal_bad: list[str] = []
    timing: set[str] = set()
    results: dict[str, dict[str, Any]] = {}
    try:
        c.start()
        for _ in range(1000):  # bounded; ends on the figure
            if not plan and tally.must_refuse >= STALE:
                break
            if plan and tally.must_refuse >= plan[0][0]:
                how = plan.pop(0)[1]
                held = c.hold()
                status = c.stop(graceful=how == "sigterm")
                if how == "sigterm":
                    statuses.append(status)
                c.start()
                c.use_held(held)
                c.replay()
                restarts.append(how)
            c.expiry_round(8)
            for fn in rng.sample(quick, len(quick)):
                fn()
        # Every run ends: cancel those still going.
        assert c.http is not None
        for run in c.runs:
            r = c.http.get(f"/v1/api/runs/{run.run_id}").json()
            if r["status"] not in ("completed", "failed", "cancelled", "timed_out"):
                c.cancel(run)
        results = wait_runs(c.http, [r.run_id for r in c.runs], time.monotonic() + 30)
        journals = {run.run_id: c.journal(run) for run in c.runs}
        statuses.append(c.stop())
    finally:
        if c.d is not None:
            c.stop(graceful=False)

    for run_id, events in journals.items():
        journal_bad += journal_problems(run_id, events, results[run_id].get("status"))
        for e in events:  # a lease no scenario let expire, expired: the test was too slow
            if e["type"] == "step_orphaned":
                timing.add(e["lease_id"])
    may_expire = {m.lease_id for m in c.leases if m.may_expire}
    timing -= may_expire
    for m, op, transport, want, got in tally.records:
        if m.lease_id in timing or want == got:
            continue
        what = f"{m.scenario} {op} via {transport} on {m.lease_id}: expected {want}, got {got}"
        if got == "ok":
            tally.accepted_wrongly.append(what)
        elif want == "ok":
            tally.refused_wrongly.append(what)
        elif got in ("already_applied", "fenced", "run_terminal", "not_started"):
            tally.wrong_reason.append(what)
        else:
            tally.other.append(what)
    refused_right = sum(1 for m, _, _, want, got in tally.records
                        if want != "ok" and want == got and m.lease_id not in timing)
    reasons = Counter(want for _, _, _, want, _ in tally.records if want != "ok")
    line = (
        f"campaign-stale seed={seed} calls={tally.calls} must-refuse={tally.must_refuse} "
        f"refused-right={refused_right} {dict(sorted(reasons.items()))} "
        f"accepted-should-refuse={len(tally.accepted_wrongly)} "
        f"wrong-reason={len(tally.wrong_reason)} "
        f"refused-should-accept={len(tally.refused_wrongly)} other={len(tally.other)} "
        f"transports={dict(tally.by_transport)} leases={len(c.leases)} runs={len(c.runs)} "
        f"restarts={restarts} replayed-after-restart={tally.replayed} "
        f"ws-reconnects={tally.reconnects} "
        f"revive-missed={tally.revive_missed} timing={len(timing)} "
        f"journal-violations={len(journal_bad)} elapsed={time.monotonic() - t0:.1f}s"
    )
    summary(line)
    problems = tally.accepted_wrongly + tally.wrong_reason + tally.refused_wrongly + tally.other
    assert tally.must_refuse >= STALE, line
    assert not problems, f"{len(problems)} wrong answers: {problems[:10]}"
    assert not journal_bad, journal_bad[:5]
    assert not c.tracebacks, c.tracebacks[0]
    assert statuses == [0, 0], statuses
    assert restarts == ["sigterm", "sigkill"], restarts
