"""The load and the history of the power-cut test (test_power_loss.py).

Raw-HTTP clients that speak only PROTOCOL.md, as D1's do
(tests/reliability/test_crash_sigkill.py), plus a signaller:

* `Worker` (HTTP) and `WsWorker` (the WebSocket, msgpack frames, one credit
  at a time): register, take a lease, call ``started`` and ``complete``, and
  handle each 409 by its reason. It keeps its ``worker_id`` and its lease across
  daemons (a lease belongs to the worker) and sends an unanswered ``complete``
  again to the next daemon.
* `Starter`: starts ``seq(n)`` and ``sig2`` runs, one idempotency key each;
  a start that got no answer is sent again with the same key.
* `Signaller`: sends the two ``go`` signals each ``sig2`` run waits for, the
  first when the run waits at ``w0``, the second when it waits at ``w1`` or,
  for half of the runs, before (the run keeps it). A signal carries no
  idempotency key, so a signal that got no answer is never sent again blindly:
  once its daemon is dead, the run itself says whether it landed (the payload
  is in ``state``, or a kept signal is in the journal) or not (sent again).

Workflows. ``seq(n)``: n task steps; step k gets ``{"i": k, "prev":
steps.s{k-1}.acc}`` and outputs ``{"acc": prev + i, "lease_id": ...}``, also
patched into the state under its step id, so the result is ``n(n-1)/2`` only
if every accepted output fed the next step. ``sig2``: ``t0``, ``w0`` (wait for
``go``, into ``go0``), ``t1`` (``i`` = the first signal's ``n``), ``w1`` (into
``go1``), ``t2``: the result is the sum of the two signals' ``n``.

Everything a client saw goes in one `History`; `check` compares it with what
the last daemon kept, through the HTTP API only.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from tests.reliability.conftest import Current

SEQ_SIZES = range(3, 9)
CLAIM_WAIT_MS = 300
CLIENT_TIMEOUT_S = 10.0
BACKLOG = 16  # open runs started in the last STALE_S seconds
STALE_S = 20.0  # an unfinished run older than this no longer holds the starter back
MAX_RUNS = 5000  # a bound only
SIG_EVERY = 3  # one run in three is a sig2
TERMINAL = ("completed", "failed", "cancelled", "timed_out")
RETRY = {"max_attempts": 1000, "initial_backoff_ms": 0}  # every cut may cost a held lease one attempt


def seq_definition(n: int) -> dict[str, Any]:
    steps = []
    for k in range(n):
        prev: Any = 0 if k == 0 else f"${{steps.s{k - 1}.acc}}"
        steps.append({"id": f"s{k}", "kind": "task", "body": "add",
                      "input": {"i": k, "prev": prev}, "retry": RETRY})
    return {"name": f"seq{n}", "steps": steps}


SIG2 = {
    "name": "sig2",
    "steps": [
        {"id": "t0", "kind": "task", "body": "add", "input": {"i": 0, "prev": 0}, "retry": RETRY},
        {"id": "w0", "kind": "wait", "event": "go", "into": "go0"},
        {"id": "t1", "kind": "task", "body": "add",
         "input": {"i": "${steps.w0.n}", "prev": "${steps.t0.acc}"}, "retry": RETRY},
        {"id": "w1", "kind": "wait", "event": "go", "into": "go1"},
        {"id": "t2", "kind": "task", "body": "add",
         "input": {"i": "${steps.w1.n}", "prev": "${steps.t1.acc}"}, "retry": RETRY},
    ],
}

DEFINITIONS = [seq_definition(n) for n in SEQ_SIZES] + [SIG2]
WORKFLOWS = [d["name"] for d in DEFINITIONS]
LAST_STEP = {d["name"]: d["steps"][-1]["id"] for d in DEFINITIONS}


@dataclass
class History:
    """Everything the clients saw, under one lock."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    # completions
    acked: dict[str, tuple[str, str, Any]] = field(default_factory=dict)  # lease -> run, step, out
    ambiguous: dict[str, tuple[str, str, Any]] = field(default_factory=dict)
    said_applied: set[str] = field(default_factory=set)
    said_rejected: set[str] = field(default_factory=set)
    complete_calls: int = 0
    retried_acked: int = 0
    # starts: key -> (workflow, run_id, time acknowledged)
    runs: dict[str, tuple[str, str, float]] = field(default_factory=dict)
    start_dedup: int = 0
    # signals: (run_id, k) -> payload, acknowledged / landed though unanswered
    signals: dict[tuple[str, int], dict[str, Any]] = field(default_factory=dict)
    signals_recovered: dict[tuple[str, int], dict[str, Any]] = field(default_factory=dict)
    signal_calls: int = 0
    signals_before_wait: int = 0  # acknowledged before the run waited for them (kept)
    signals_not_landed: int = 0
    # other
    conflicts: Counter[str] = field(default_factory=Counter)
    lease_unknown: int = 0
    registrations_lost: int = 0  # a register with our own worker_id answered 404
    runs_unknown: Counter[str] = field(default_factory=Counter)  # 404 for a run we started
    unexpected: list[str] = field(default_factory=list)
    bad_status: list[str] = field(default_factory=list)
    finished: set[str] = field(default_factory=set)  # runs whose last step a worker saw land
    acked_by: Counter[str] = field(default_factory=Counter)  # worker name -> completions acked
    crashed: list[str] = field(default_factory=list)  # a client thread's uncaught exception
    ack_events: dict[str, threading.Event] = field(default_factory=lambda: {
        k: threading.Event() for k in ("complete", "start", "signal")})

    def note(self, what: str, r: httpx.Response) -> None:
        with self.lock:
            self.bad_status.append(f"{what} -> {r.status_code} {r.text[:300]}")


def guarded(h: History, target: Callable[[], None]) -> Callable[[], None]:
    """A thread target whose uncaught exception is recorded (the test fails on it)."""

    def run() -> None:
        try:
            target()
        except BaseException:
            with h.lock:
                h.crashed.append(traceback.format_exc())
            raise

    return run


class _Client:
    """A thread's HTTP client, renewed when a new daemon is published."""

    def __init__(self, current: Current) -> None:
        self.current = current
        self.gen = 0
        self.client: httpx.Client | None = None

    def get(self) -> tuple[httpx.Client | None, bool]:
        """(client, new): None while no daemon serves; ``new`` on a generation change."""
        url, gen = self.current.get()
        if url is None:
            return None, False
        if gen == self.gen and self.client is not None:
            return self.client, False
        if self.client is not None:
            self.client.close()
        self.client = httpx.Client(base_url=url, timeout=CLIENT_TIMEOUT_S, trust_env=False)
        self.gen = gen
        return self.client, True

    def close(self) -> None:
        if self.client is not None:
            self.client.close()


class Worker:
    """One SDK-less worker over raw HTTP (PROTOCOL.md "Worker calls")."""

    def __init__(self, index: int, current: Current, history: History, stop: threading.Event):
        self.name = f"power-w{index}"
        self.c = _Client(current)
        self.h = history
        self.stop = stop
        self.worker_id: str | None = None
        self.registered_gen = 0
        self.lease: dict[str, Any] | None = None
        self.started = False
        self.complete_sent = False

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                client, _ = self.c.get()
                if client is None:
                    continue
                try:
                    if self.registered_gen != self.c.gen:
                        if self._register(client):
                            self.registered_gen = self.c.gen
                        else:
                            time.sleep(0.02)
                        continue
                    self._step(client)
                except httpx.TransportError:
                    time.sleep(0.01)  # the daemon is gone (or going): wait for the next one
        finally:
            self.c.close()

    def _register(self, client: httpx.Client) -> bool:
        body: dict[str, Any] = {"name": self.name, "concurrency": 1, "definitions": DEFINITIONS}
        if self.worker_id is not None:
            body["worker_id"] = self.worker_id  # a lease belongs to the worker: keep holding it
        r = client.post("/v1/api/workers/register", json=body)
        if r.status_code == 404 and self.worker_id is not None:
            with self.h.lock:  # an acknowledged registration did not survive
                self.h.registrations_lost += 1
            self.worker_id = None
            self._drop()
            return False
        if r.status_code != 200:
            self.h.note("register", r)
            return False
        self.worker_id = r.json()["worker_id"]
        return True

    def _drop(self) -> None:
        self.lease, self.started, self.complete_sent = None, False, False

    def _conflict(self, op: str, r: httpx.Response) -> str | None:
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
            if r.status_code == 404:  # our registration is gone: register again
                with self.h.lock:
                    self.h.registrations_lost += 1
                self.worker_id, self.registered_gen = None, 0
                return
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
        if not self.started:
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
        retry = self._before_complete(lease, out)
        r = client.post(f"/v1/api/steps/{lease_id}/complete",
                        json={"output": out, "state_patch": {lease["step_id"]: out}})
        reason = None if r.status_code == 200 else self._conflict("complete", r)
        self._after_complete(lease, out, retry, r.status_code == 200, reason)

    def _before_complete(self, lease: dict[str, Any], out: dict[str, Any]) -> bool:
        """Note a complete about to go out (ambiguous until answered); True when it is a resend."""
        retry = self.complete_sent
        with self.h.lock:
            self.h.complete_calls += 1
            self.h.ambiguous[lease["lease_id"]] = (lease["run_id"], lease["step_id"], out)
        self.complete_sent = True
        return retry

    def _after_complete(self, lease: dict[str, Any], out: dict[str, Any], retry: bool,
                        ok: bool, reason: str | None) -> None:
        lease_id = lease["lease_id"]
        record = (lease["run_id"], lease["step_id"], out)
        last = lease["step_id"] == LAST_STEP[lease["workflow"]]
        with self.h.lock:
            if last and (ok or reason == "already_applied"):
                self.h.finished.add(lease["run_id"])
            if ok:
                self.h.acked_by[self.name] += 1
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
        if ok:
            self.h.ack_events["complete"].set()
        self._drop()


class WsWorker(Worker):
    """The same worker over the WebSocket (PROTOCOL.md "WebSocket transport", msgpack frames).

    One credit at a time: a lease is pushed, ``started`` and ``complete`` are
    request frames answered ``ok``/``conflict``/``error``. After a daemon dies
    it connects to the next one, registers with its ``worker_id`` (a lease
    belongs to the worker, not to the connection) and carries on with the lease
    it holds; a ``complete`` that got no answer is sent again.
    """

    def __init__(self, index: int, current: Current, history: History, stop: threading.Event):
        super().__init__(index, current, history, stop)
        self.name = f"power-ws{index}"
        self.conn: Any = None
        self._stack = contextlib.ExitStack()
        self.conn_gen = 0
        self.next_id = 0
        self.credit = 0

    def run(self) -> None:
        from websockets.exceptions import WebSocketException

        try:
            while not self.stop.is_set():
                url, gen = self.c.current.get()
                if url is None:
                    continue
                try:
                    if self.conn is None or gen != self.conn_gen:
                        self._close()
                        if not self._connect(url, gen):
                            time.sleep(0.02)
                        continue
                    self._step_ws()
                except (OSError, TimeoutError, WebSocketException):
                    self._close()  # the daemon is gone (or going): the next one, or this one again
                    time.sleep(0.01)
        finally:
            self._close()

    def _close(self) -> None:
        if self.conn is not None:
            with contextlib.suppress(Exception):  # closing a dead connection
                self._stack.close()
            self.conn = None

    def _connect(self, url: str, gen: int) -> bool:
        import msgpack  # type: ignore[import-untyped,unused-ignore]
        from websockets.sync.client import connect

        stack = contextlib.ExitStack()
        self.conn = stack.enter_context(connect(
            url.replace("http://", "ws://", 1) + "/v1/api/workers/connect",
            subprotocols=["stepd.v1.msgpack"],  # type: ignore[list-item]
            open_timeout=5, close_timeout=1, proxy=None, compression=None))
        self._stack = stack
        self._msgpack = msgpack
        self.conn_gen, self.next_id, self.credit = gen, 0, 0
        body: dict[str, Any] = {"name": self.name, "concurrency": 1, "definitions": DEFINITIONS}
        if self.worker_id is not None:
            body["worker_id"] = self.worker_id
        answer = self._request("register", **body)
        if answer["op"] == "error" and answer.get("status") == 404 and self.worker_id is not None:
            with self.h.lock:  # an acknowledged registration did not survive
                self.h.registrations_lost += 1
            self.worker_id = None
            self._drop()
            self._close()
            return False
        if answer["op"] != "registered":
            with self.h.lock:
                self.h.bad_status.append(f"ws register -> {str(answer)[:300]}")
            self._close()
            return False
        self.worker_id = answer["worker_id"]
        return True

    def _send(self, frame: dict[str, Any]) -> None:
        self.conn.send(self._msgpack.packb(frame, use_bin_type=True))

    def _recv(self, timeout: float) -> dict[str, Any]:
        return dict(self._msgpack.unpackb(self.conn.recv(timeout=timeout), raw=False))

    def _request(self, op: str, **body: Any) -> dict[str, Any]:
        """Send a request frame and wait (bounded) for its answer; pushed frames are noted."""
        self.next_id += 1
        frame_id = self.next_id
        self._send({"op": op, "id": frame_id, **body})
        deadline = time.monotonic() + CLIENT_TIMEOUT_S
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no answer to {op}")
            frame = self._recv(left)
            if frame.get("id") == frame_id:
                return frame
            self._pushed(frame)

    def _pushed(self, frame: dict[str, Any]) -> None:
        if frame.get("op") == "lease":
            self.credit -= 1
            if self.lease is None:
                self.lease = frame["lease"]
            else:  # one credit: a second lease cannot come
                with self.h.lock:
                    self.h.unexpected.append(f"ws lease beyond credit: {frame['lease']['lease_id']}")
        # "cancel" frames: the complete that follows gets its 409 anyway

    def _answer(self, op: str, frame: dict[str, Any]) -> str | None:
        """None for ``ok``; else the 409 reason, or ``not_found`` for a 404 error frame."""
        if frame["op"] == "ok":
            return None
        if frame["op"] == "conflict":
            reason = str(frame.get("reason"))
            with self.h.lock:
                self.h.conflicts[f"{op}:{reason}"] += 1
            return reason
        if frame["op"] == "error" and frame.get("status") == 404:
            with self.h.lock:
                self.h.lease_unknown += 1
            return "not_found"
        with self.h.lock:
            self.h.bad_status.append(f"ws {op} -> {str(frame)[:300]}")
        return "error"

    def _step_ws(self) -> None:
        if self.lease is None:
            if self.credit < 1:
                self._send({"op": "credit", "n": 1})
                self.credit += 1
            try:
                frame = self._recv(CLAIM_WAIT_MS / 1000)
            except TimeoutError:
                return
            self._pushed(frame)
            if self.lease is None:
                return
        lease = self.lease
        lease_id = lease["lease_id"]
        if not self.started:
            reason = self._answer("started", self._request("started", lease_id=lease_id))
            if reason is None:
                self.started = True
            else:
                if reason == "already_applied":
                    with self.h.lock:
                        self.h.unexpected.append(f"started {lease_id}: already_applied, never completed")
                self._drop()
                return
        out = {"acc": lease["input"]["prev"] + lease["input"]["i"], "lease_id": lease_id}
        retry = self._before_complete(lease, out)
        frame = self._request("complete", lease_id=lease_id, output=out,
                              state_patch={lease["step_id"]: out})
        reason = self._answer("complete", frame)
        self._after_complete(lease, out, retry, reason is None, reason)


class Starter:
    """Starts runs with one idempotency key each; retries unanswered starts with the same key."""

    def __init__(self, current: Current, history: History, stop: threading.Event,
                 rng: random.Random, prefix: str):
        self.c = _Client(current)
        self.h = history
        self.stop = stop
        self.prefix = prefix
        self.no_new_runs = threading.Event()
        self.workflows = ["sig2" if i % SIG_EVERY == SIG_EVERY - 1 else f"seq{rng.choice(SEQ_SIZES)}"
                          for i in range(MAX_RUNS)]
        self.pending: list[int] = []
        self.next_run = 0
        self.busy = threading.Lock()

    def _open(self) -> int:
        now = time.monotonic()
        with self.h.lock:
            open_runs = sum(1 for _, run_id, at in self.h.runs.values()
                            if run_id not in self.h.finished and now - at < STALE_S)
        return open_runs + len(self.pending)

    def idle(self) -> bool:
        """No new runs, and every start sent has been answered."""
        with self.busy:
            return self.no_new_runs.is_set() and not self.pending

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                client, _ = self.c.get()
                if client is None:
                    continue
                with self.busy:  # `idle` waits for a start in flight
                    if self.pending:
                        number = self.pending.pop(0)
                    elif not self.no_new_runs.is_set() and self.next_run < MAX_RUNS \
                            and self._open() < BACKLOG:
                        number = self.next_run
                        self.next_run += 1
                    else:
                        number = None
                    if number is not None:
                        self._start(client, number)
                if number is None:
                    time.sleep(0.005)
        finally:
            self.c.close()

    def key(self, number: int) -> str:
        return f"{self.prefix}-{number}"

    def _start(self, client: httpx.Client, number: int) -> None:
        workflow = self.workflows[number]
        key = self.key(number)
        try:
            r = client.post("/v1/api/runs", json={"workflow": workflow, "input": None,
                                                  "idempotency_key": key})
        except httpx.TransportError:
            self.pending.append(number)  # ambiguous: the same key again, on the next daemon
            time.sleep(0.01)
            return
        if r.status_code in (200, 201):
            run_id = r.json()["run_id"]
            with self.h.lock:
                earlier = self.h.runs.get(key)
                if earlier is not None and earlier[1] != run_id:
                    self.h.unexpected.append(f"start {key}: {run_id}, acknowledged before as {earlier[1]}")
                self.h.runs[key] = (workflow, run_id, time.monotonic())
                if r.status_code == 200:
                    self.h.start_dedup += 1
            self.h.ack_events["start"].set()
        else:
            if r.status_code != 422:  # 422: no worker registered the workflow yet on this daemon
                self.h.note("start", r)
            self.pending.append(number)
            time.sleep(0.02)


class Signaller:
    """Sends the two ``go`` signals of every acknowledged ``sig2`` run.

    The first when the run waits at ``w0``; the second when it waits at
    ``w1``, or (for half of the runs) as soon as the first is acknowledged,
    so that the run keeps it until it reaches ``w1`` (WORKFLOWS.md: signals
    sent before the matching ``wait`` are kept).
    """

    def __init__(self, current: Current, history: History, stop: threading.Event,
                 rng: random.Random):
        self.c = _Client(current)
        self.h = history
        self.stop = stop
        self.rng = rng
        self.next_k: dict[str, int] = {}  # run -> index of the next signal to send
        self.unanswered: dict[str, tuple[int, dict[str, Any], int]] = {}  # run -> k, payload, gen
        self.done: set[str] = set()
        self.early: dict[str, bool] = {}  # run -> its second signal goes before it waits at w1
        self.sends = 0

    def idle(self) -> bool:
        """Every signal sent has an answer or a verdict (none left unanswered)."""
        return not self.unanswered

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                client, _ = self.c.get()
                if client is None:
                    continue
                with self.h.lock:
                    todo = [run_id for wf, run_id, _ in self.h.runs.values()
                            if wf == "sig2" and run_id not in self.done]
                if not todo:
                    time.sleep(0.02)
                    continue
                for run_id in todo:
                    if self.stop.is_set() or self.c.current.get(0)[1] != self.c.gen:
                        break
                    try:
                        self._visit(client, run_id)
                    except httpx.TransportError:
                        time.sleep(0.01)
                        break
                time.sleep(0.01)
        finally:
            self.c.close()

    def _visit(self, client: httpx.Client, run_id: str) -> None:
        r = client.get(f"/v1/api/runs/{run_id}")
        if r.status_code == 404:  # an acknowledged start is gone (the check counts it lost)
            with self.h.lock:
                self.h.runs_unknown[run_id] += 1
            self.done.add(run_id)
            return
        if r.status_code != 200:
            self.h.note("get run", r)
            return
        run = r.json()
        k = self.next_k.get(run_id, 0)
        early = self.early.setdefault(run_id, self.rng.random() < 0.5)
        pending = self.unanswered.get(run_id)
        if pending is not None:
            pk, payload, gen = pending
            landed = run["state"].get(f"go{pk}") == payload
            if not landed and pk == 1 and early:  # kept for w1 (the only signal ever buffered)?
                landed = any(e["type"] == "signal_received" and e.get("buffered")
                             for e in journal(client, run_id) or [])
            if landed:
                del self.unanswered[run_id]
                with self.h.lock:
                    self.h.signals_recovered[(run_id, pk)] = payload
                self.next_k[run_id] = k = pk + 1
            elif gen == self.c.gen:
                return  # its daemon may still apply it: wait for a verdict
            else:  # its daemon is dead and the run shows no trace of it: it did not land
                del self.unanswered[run_id]
                with self.h.lock:
                    self.h.signals_not_landed += 1
        if run["status"] in TERMINAL or k >= 2:
            if run["status"] in TERMINAL:
                self.done.add(run_id)
            return
        waits_for_it = run["status"] == "waiting" and run.get("current_steps") == [f"w{k}"]
        if not waits_for_it and not (k == 1 and early):
            return  # (with `early`, the second signal goes before w1: the run keeps it for w1)
        payload = {"n": self.rng.randrange(1, 1000), "sig": f"{run_id}/{k}/{self.sends}"}
        self.sends += 1
        self.unanswered[run_id] = (k, payload, self.c.gen)
        with self.h.lock:
            self.h.signal_calls += 1
        r = client.post(f"/v1/api/runs/{run_id}/signal", json={"name": "go", "payload": payload})
        if r.status_code == 200:
            del self.unanswered[run_id]
            with self.h.lock:
                self.h.signals[(run_id, k)] = payload
                self.h.signals_before_wait += not waits_for_it
            self.next_k[run_id] = k + 1
            self.h.ack_events["signal"].set()
            return
        del self.unanswered[run_id]  # a clear answer: nothing landed
        if r.status_code == 404:
            with self.h.lock:
                self.h.runs_unknown[run_id] += 1
        else:
            self.h.note("signal", r)


# --------------------------------------------------------------------------- the check


def wait_runs(client: httpx.Client, run_ids: list[str], deadline: float) -> dict[str, dict[str, Any]]:
    """Long-poll each run's result until terminal (404 kept as such) or the deadline."""
    results: dict[str, dict[str, Any]] = {}
    todo = list(run_ids)
    while todo and time.monotonic() < deadline:
        run_id = todo[0]
        r = client.get(f"/v1/api/runs/{run_id}/result", params={"wait_ms": 800})
        if r.status_code == 404:
            results[run_id] = {"status": "not_found"}
            todo.pop(0)
            continue
        assert r.status_code == 200, r.text
        body = r.json()
        if body["status"] in TERMINAL:
            results[run_id] = body
            todo.pop(0)
        else:
            todo.append(todo.pop(0))  # another run may finish first (a stuck one must not block)
    for run_id in todo:
        r = client.get(f"/v1/api/runs/{run_id}/result")
        results[run_id] = r.json() if r.status_code == 200 else {"status": "not_found"}
    return results


def journal(client: httpx.Client, run_id: str) -> list[dict[str, Any]] | None:
    events: list[dict[str, Any]] = []
    after = 0
    for _ in range(1000):
        r = client.get(f"/v1/api/runs/{run_id}/journal", params={"after_seq": after, "limit": 10_000})
        if r.status_code == 404:
            return None
        assert r.status_code == 200, r.text
        page = r.json()["events"]
        if not page:
            break
        events += page
        after = page[-1]["seq"]
    return events


def list_runs(client: httpx.Client) -> dict[str, list[dict[str, Any]]]:
    listed: dict[str, list[dict[str, Any]]] = {}
    for workflow in WORKFLOWS:
        cursor: str | None = None
        listed[workflow] = []
        for _ in range(100):
            params: dict[str, Any] = {"workflow": workflow, "limit": 1000}
            if cursor:
                params["cursor"] = cursor
            page = client.get("/v1/api/runs", params=params).json()
            listed[workflow] += page["runs"]
            cursor = page["next_cursor"]
            if cursor is None:
                break
    return listed


@dataclass
class Verdict:
    """What the check found; every list names the items (for the failure message)."""

    lost_completions: list[Any] = field(default_factory=list)
    lost_starts: list[Any] = field(default_factory=list)
    lost_signals: list[Any] = field(default_factory=list)
    duplicated: int = 0
    unexpected: list[str] = field(default_factory=list)
    contradictions: list[str] = field(default_factory=list)
    wrong_results: list[Any] = field(default_factory=list)
    double_created: int = 0
    recovered: int = 0
    not_landed: int = 0

    @property
    def lost(self) -> int:
        return len(self.lost_completions) + len(self.lost_starts) + len(self.lost_signals)


def check(client: httpx.Client, h: History, results: dict[str, dict[str, Any]]) -> Verdict:
    """Compare the history with what the daemon kept (journals, states, run list, keys)."""
    v = Verdict()
    runs = {run_id: (key, wf) for key, (wf, run_id, _) in h.runs.items()}
    journals: dict[str, list[dict[str, Any]] | None] = {}
    states: dict[str, dict[str, Any] | None] = {}
    for run_id in runs:
        journals[run_id] = journal(client, run_id)
        r = client.get(f"/v1/api/runs/{run_id}")
        states[run_id] = r.json() if r.status_code == 200 else None

    # starts: the run is there under its key, and the key still names it
    for run_id, (key, wf) in runs.items():
        status = states[run_id]
        r = client.post("/v1/api/runs", json={"workflow": wf, "input": None, "idempotency_key": key})
        again = r.json() if r.status_code in (200, 201) else {"status": r.status_code}
        if status is None or status.get("idempotency_key") != key or again.get("run_id") != run_id \
                or again.get("created") is not False:
            v.lost_starts.append((key, run_id, "run missing" if status is None else
                                  status.get("idempotency_key"), again))
    listed = list_runs(client)
    v.double_created = sum(len(listed[wf]) for wf in WORKFLOWS) - len(runs)

    # completions
    completed_by: dict[str, tuple[str, str]] = {}
    for run_id, events in journals.items():
        if events is None:
            continue
        slots = Counter((e["step_id"], e.get("item_index")) for e in events
                        if e["type"] == "step_completed")
        v.duplicated += sum(c - 1 for c in slots.values() if c > 1)
        for e in events:
            if e["type"] == "step_completed" and e.get("lease_id"):  # (a wait's has none)
                completed_by[e["lease_id"]] = (run_id, e["step_id"])
    for lease_id, (run_id, step_id, out) in h.acked.items():
        state = (states.get(run_id) or {}).get("state") or {}
        if completed_by.get(lease_id) != (run_id, step_id) or state.get(step_id) != out:
            v.lost_completions.append((lease_id, run_id, step_id, out, state.get(step_id)))
    v.recovered = sum(1 for lid in h.ambiguous if lid in completed_by)
    v.not_landed = sum(1 for lid in h.ambiguous if lid not in completed_by)
    v.contradictions = ([f"{lid}: already_applied, not in the journal"
                         for lid in h.said_applied if lid not in completed_by]
                        + [f"{lid}: refused, in the journal"
                           for lid in h.said_rejected if lid in completed_by])
    attempted = set(h.acked) | set(h.ambiguous)
    v.unexpected = list(h.unexpected) + [
        f"step_completed for {lid}, never completed by a worker"
        for lid in completed_by if lid not in attempted]

    # signals: the payload is the wait step's output, received once (at the wait, or kept
    # before it: a kept signal's event names no step, and only the second one is ever kept)
    for (run_id, k), payload in h.signals.items():
        state = (states.get(run_id) or {}).get("state") or {}
        received = [e for e in journals.get(run_id) or [] if e["type"] == "signal_received"
                    and (e.get("step_id") == f"w{k}" or (k == 1 and e.get("buffered")))]
        if state.get(f"go{k}") != payload or len(received) != 1:
            v.lost_signals.append((run_id, k, payload, state.get(f"go{k}"), len(received)))

    # every run ends completed with the right result
    for run_id, (key, wf) in runs.items():
        body = results.get(run_id, {})
        result = body.get("result")
        if wf == "sig2":
            sent = [h.signals.get((run_id, k)) or h.signals_recovered.get((run_id, k)) for k in (0, 1)]
            want = sum(p["n"] for p in sent) if all(sent) else None  # type: ignore[index]
        else:
            n = int(wf[3:])
            want = n * (n - 1) // 2
        if body.get("status") != "completed" or not isinstance(result, dict) \
                or want is None or result.get("acc") != want:
            v.wrong_results.append((key, run_id, body, want))
    return v
