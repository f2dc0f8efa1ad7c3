"""Helpers shared by the campaign's own tests (not a test module).

* `HttpLink` and `WsLink`: one worker's connection to one daemon, over raw
  HTTP (claim) or the worker WebSocket (msgpack frames, credit, pushed
  leases), with the same small interface, so a test speaks PROTOCOL.md over
  either. A call that got no answer (the connection died, the daemon was
  killed) raises `Ambiguous`: it may or may not have landed.
* `journal_problems`: the journal invariants every campaign test checks.
* `wait_runs` and `list_runs`: bounded reads of a daemon's runs.

The daemon helpers themselves (``start_daemon``, ``kill9``, ``stop_daemon``,
``Current``) are the reliability tests' (``tests/reliability/conftest.py``).
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from websockets.exceptions import ConnectionClosed, InvalidHandshake
from websockets.sync.client import connect
from websockets.typing import Subprotocol

from tests.transport.conftest import WsWorker

TERMINAL = ("completed", "failed", "cancelled", "timed_out")
TERMINAL_EVENTS = ("run_completed", "run_failed", "run_cancelled", "run_timed_out")


class Ambiguous(Exception):
    """No answer: the call may or may not have reached the daemon."""


@dataclass(frozen=True)
class Answer:
    """What the daemon answered: ``ok`` (body), ``conflict`` (reason), ``not_found``, ``error``."""

    kind: str
    detail: Any = None

    @property
    def label(self) -> str:
        return self.kind if self.kind != "conflict" else str(self.detail)


def _http_answer(r: httpx.Response) -> Answer:
    if r.status_code == 200:
        return Answer("ok", r.json())
    if r.status_code == 409:
        return Answer("conflict", r.json().get("reason"))
    if r.status_code == 404:
        return Answer("not_found", r.text[:200])
    return Answer("error", f"{r.status_code} {r.text[:300]}")


def _ws_answer(frame: dict[str, Any]) -> Answer:
    op = frame.get("op")
    if op in ("ok", "registered"):
        return Answer("ok", frame)
    if op == "conflict":
        return Answer("conflict", frame.get("reason"))
    if op == "error" and frame.get("status") == 404:
        return Answer("not_found", frame.get("message"))
    return Answer("error", frame)


class HttpLink:
    """A worker over raw HTTP: ``register``, ``claim``, lease calls."""

    transport = "http"

    def __init__(self, url: str, *, timeout: float = 5.0) -> None:
        self.client = httpx.Client(base_url=url, timeout=timeout, trust_env=False)
        self.worker_id: str | None = None

    def register(self, body: dict[str, Any]) -> Answer:
        try:
            r = self.client.post("/v1/api/workers/register", json=body)
        except httpx.TransportError as exc:
            raise Ambiguous(f"register: {exc!r}") from exc
        answer = _http_answer(r)
        if answer.kind == "ok":
            self.worker_id = answer.detail["worker_id"]
        return answer

    def grant(self, n: int) -> None:
        """Credit has no HTTP form: a claim asks for what it wants."""

    def leases(self, *, max: int = 1, wait_ms: int = 300,
               run_id: str | None = None) -> list[dict[str, Any]]:
        body: dict[str, Any] = {"worker_id": self.worker_id, "max": max, "wait_ms": wait_ms}
        if run_id is not None:
            body["run_id"] = run_id
        try:
            r = self.client.post("/v1/api/steps/claim", json=body)
        except httpx.TransportError as exc:
            raise Ambiguous(f"claim: {exc!r}") from exc
        if r.status_code != 200:
            raise Ambiguous(f"claim answered {r.status_code} {r.text[:200]}")
        return list(r.json()["leases"])

    def call(self, op: str, lease_id: str, body: dict[str, Any] | None = None) -> Answer:
        try:
            r = self.client.post(f"/v1/api/steps/{lease_id}/{op}", json=body or {})
        except httpx.TransportError as exc:
            raise Ambiguous(f"{op} {lease_id}: {exc!r}") from exc
        return _http_answer(r)

    def close(self) -> None:
        self.client.close()


class WsLink:
    """A worker over the WebSocket (``stepd.v1.msgpack``): register, credit, pushed leases."""

    transport = "ws"

    def __init__(self, url: str, *, timeout: float = 5.0) -> None:
        self.ws_url = url.replace("http://", "ws://", 1) + "/v1/api/workers/connect"
        self.timeout = timeout
        self.ws: WsWorker | None = None
        self.worker_id: str | None = None

    def _conn(self) -> WsWorker:
        if self.ws is None:
            try:
                conn = connect(self.ws_url, subprotocols=[Subprotocol("stepd.v1.msgpack")],
                               proxy=None, compression=None, open_timeout=self.timeout,
                               close_timeout=1, legacy=True)
            except (OSError, InvalidHandshake, TimeoutError) as exc:
                raise Ambiguous(f"connect: {exc!r}") from exc
            self.ws = WsWorker(conn)
        return self.ws

    def _request(self, op: str, **body: Any) -> dict[str, Any]:
        ws = self._conn()
        try:
            return ws.request(op, timeout=self.timeout, **body)
        except (ConnectionClosed, OSError, TimeoutError) as exc:
            self.close()
            raise Ambiguous(f"{op}: {exc!r}") from exc

    def register(self, body: dict[str, Any]) -> Answer:
        answer = _ws_answer(self._request("register", **body))
        if answer.kind == "ok":
            self.worker_id = answer.detail["worker_id"]
        return answer

    def grant(self, n: int) -> None:
        ws = self._conn()
        try:
            ws.send({"op": "credit", "n": n})
        except (ConnectionClosed, OSError) as exc:
            self.close()
            raise Ambiguous(f"credit: {exc!r}") from exc

    def leases(self, *, max: int = 1, wait_ms: int = 300,
               run_id: str | None = None) -> list[dict[str, Any]]:
        ws = self._conn()
        try:
            frame = ws.wait_for("lease", timeout=wait_ms / 1000)
        except TimeoutError:
            return []
        except (ConnectionClosed, OSError) as exc:
            self.close()
            raise Ambiguous(f"lease push: {exc!r}") from exc
        return [frame["lease"]]

    def cancels(self) -> list[dict[str, Any]]:
        """The ``cancel`` frames received so far (taken out of the pending frames)."""
        if self.ws is None:
            return []
        got = [f for f in self.ws.pending if f.get("op") == "cancel"]
        self.ws.pending = [f for f in self.ws.pending if f.get("op") != "cancel"]
        return got

    def call(self, op: str, lease_id: str, body: dict[str, Any] | None = None) -> Answer:
        return _ws_answer(self._request(op, lease_id=lease_id, **(body or {})))

    def pipeline(self, calls: list[tuple[str, str, dict[str, Any]]]) -> list[Answer]:
        """Send every ``(op, lease_id, body)`` frame at once, then read their answers (by id).

        The daemon applies the frames of one lease in the order they arrived
        (docs/serve.md), so this is how a worker sends calls "out of order"
        without waiting for each answer.
        """
        ws = self._conn()
        ids = []
        try:
            for op, lease_id, body in calls:
                ws.next_id += 1
                ids.append(ws.next_id)
                ws.send({"op": op, "id": ws.next_id, "lease_id": lease_id, **body})
            answers: dict[int, dict[str, Any]] = {}
            for _ in range(1000):
                if len(answers) == len(ids):
                    break
                frame = ws.recv_raw(self.timeout)
                if frame.get("id") in ids and frame["op"] in ("ok", "conflict", "error"):
                    answers[frame["id"]] = frame
                else:
                    ws.pending.append(frame)
        except (ConnectionClosed, OSError, TimeoutError) as exc:
            self.close()
            raise Ambiguous(f"pipeline: {exc!r}") from exc
        return [_ws_answer(answers[i]) for i in ids]

    def close(self) -> None:
        if self.ws is not None:
            with contextlib.suppress(Exception):  # closing a broken socket: nothing to do
                self.ws.conn.close()
            self.ws = None


class Threads:
    """Client threads whose exceptions are kept for the test (bounded joins)."""

    def __init__(self) -> None:
        self.threads: list[threading.Thread] = []
        self.errors: list[str] = []

    def start(self, name: str, fn: Callable[[], None]) -> None:
        def run() -> None:
            try:
                fn()
            except BaseException:  # noqa: BLE001 - handed to the test
                self.errors.append(f"{name}: {traceback.format_exc()}")

        t = threading.Thread(target=run, name=name, daemon=True)
        self.threads.append(t)
        t.start()

    def join(self, timeout: float = 15.0) -> list[str]:
        """Join each (bounded); the names of those still alive."""
        for t in self.threads:
            t.join(timeout)
        return [t.name for t in self.threads if t.is_alive()]


def make_link(transport: str, url: str, *, timeout: float = 5.0) -> HttpLink | WsLink:
    return HttpLink(url, timeout=timeout) if transport == "http" else WsLink(url, timeout=timeout)


def journal_problems(run_id: str, events: list[dict[str, Any]],
                     status: str | None = None) -> list[str]:
    """What is wrong with one run's journal (empty: consistent).

    * sequence numbers are dense: 1, 2, ..., n, in order;
    * every slot (step, item) has at most one ``step_completed`` naming a lease,
      and every step at most one ``step_completed`` of its own (a ``for_each``);
    * a terminal run has exactly one terminal event, and it is the last;
      a running one has none.
    """
    problems: list[str] = []
    seqs = [e.get("seq") for e in events]
    if seqs != list(range(1, len(events) + 1)):
        problems.append(f"{run_id}: sequence numbers not dense: {seqs[:5]}...{seqs[-5:]}")
    done = Counter((e["step_id"], e.get("item_index"), "lease_id" in e) for e in events
                   if e["type"] == "step_completed")
    for slot, count in done.items():
        if count > 1:
            problems.append(f"{run_id}: step_completed {count} times for {slot}")
    terminal = [i for i, e in enumerate(events) if e["type"] in TERMINAL_EVENTS]
    if status in TERMINAL:
        if len(terminal) != 1 or terminal[0] != len(events) - 1:
            problems.append(f"{run_id}: terminal events at {terminal} of {len(events)}")
        elif events[-1]["type"] != f"run_{status}":
            problems.append(f"{run_id}: status {status}, last event {events[-1]['type']}")
    elif status is not None and terminal:
        problems.append(f"{run_id}: {status} but journal has terminal events at {terminal}")
    return problems


def wait_runs(client: httpx.Client, run_ids: list[str],
              deadline: float) -> dict[str, dict[str, Any]]:
    """Long-poll each run's result until terminal or the deadline passes (then its last answer)."""
    out: dict[str, dict[str, Any]] = {}
    todo = list(run_ids)
    while todo and time.monotonic() < deadline:
        run_id = todo[0]
        try:
            r = client.get(f"/v1/api/runs/{run_id}/result", params={"wait_ms": 800})
        except httpx.TransportError:
            time.sleep(0.1)
            continue
        if r.status_code == 200 and r.json()["status"] in TERMINAL:
            out[run_id] = r.json()
            todo.pop(0)
    for run_id in todo:
        out[run_id] = client.get(f"/v1/api/runs/{run_id}/result").json()
    return out


def list_runs(client: httpx.Client, workflow: str) -> list[str]:
    """Every run id of ``workflow`` (paged, bounded)."""
    ids: list[str] = []
    cursor: str | None = None
    for _ in range(1000):
        params: dict[str, Any] = {"workflow": workflow, "limit": 1000}
        if cursor:
            params["cursor"] = cursor
        page = client.get("/v1/api/runs", params=params).json()
        ids += [run["run_id"] for run in page["runs"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    return ids


def journal(client: httpx.Client, run_id: str) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    for _ in range(100):  # pages of 10,000 events
        r = client.get(f"/v1/api/runs/{run_id}/journal",
                       params={"after_seq": events[-1]["seq"] if events else 0, "limit": 10_000})
        assert r.status_code == 200, r.text
        page = r.json()["events"]
        events += page
        if len(page) < 10_000:
            break
    return events


# --------------------------------------------------------------------------- worker processes

ROOT = Path(__file__).resolve().parents[2]


class WorkerProcess:
    """A `tests.campaign._worker_proc` subprocess (SDK worker), stopped by its PID, always reaped.

    ``module`` and ``extra`` run another worker script taking the same arguments
    (tests/affinity's `_worker_proc`, with its own options after them).

    Its stdout lines go to ``lines`` as ``(self, line)`` (``(self, None)`` at its end).
    """

    def __init__(self, name: str, url: str, workflow: str, bodies: Path, logs: Path,
                 lines: queue.Queue[tuple[WorkerProcess, str | None]], *,
                 transport: str = "websocket", concurrency: int = 4,
                 module: str = "tests.campaign._worker_proc", extra: tuple[str, ...] = ()
                 ) -> None:
        self.name = name
        self.log = logs / f"{name}.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("STEPD_")}
        cmd = [sys.executable, "-m", module, "--url", url,
               "--workflow", workflow, "--bodies", str(bodies), "--transport", transport,
               "--concurrency", str(concurrency), "--name", name, *extra]
        with self.log.open("w") as err:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=err,
                                         text=True, env=env)
        self.lines = lines
        self.killed = False
        self.ready = False
        threading.Thread(target=self._pump, name=f"pump-{name}", daemon=True).start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        with self.proc.stdout:
            for line in self.proc.stdout:
                if line.startswith("ready "):
                    self.ready = True
                self.lines.put((self, line.rstrip("\n")))
        self.lines.put((self, None))

    def kill9(self) -> int:
        """SIGKILL by PID and reap."""
        self.killed = True
        if self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return self.proc.wait(10)

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM (the SDK's graceful stop), a bounded wait, then SIGKILL; reaped either way."""
        if self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signal.SIGTERM)
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                return self.kill9()
            except ProcessLookupError:
                pass
        return self.proc.wait(10)

    def stderr(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""


def body_files(bodies: Path) -> dict[tuple[str, str, str], list[tuple[str, bool]]]:
    """The workers' durable count: slot (run, step, item) -> [(lease, finished)]."""
    names = set(os.listdir(bodies))
    out: dict[tuple[str, str, str], list[tuple[str, bool]]] = {}
    for name in sorted(names):
        if name.endswith(".done"):
            continue
        run_id, step_id, item, lease_id = name.split("__")
        out.setdefault((run_id, step_id, item), []).append((lease_id, f"{name}.done" in names))
    return out


# --------------------------------------------------------------------------- daemon logs


_EXC = re.compile(r"^[\w.]+(Error|Exception|Unavailable|Dead|Failed|Escalation|Timeout)\b")


def _innermost(block: list[str]) -> str:
    """The last exception line of a traceback block (the innermost of a group)."""
    found = ""
    for ln in block:
        if ln[:1].isdigit():  # the next log record
            break
        text = ln.strip(" |+-")
        if _EXC.match(text) and not text.startswith(("ExceptionGroup", "BaseExceptionGroup")):
            found = text
    return found


def log_findings(text: str) -> dict[str, list[str]]:
    """The daemon log's lines that matter, by class (each line with the line after it).

    * ``unhandled``: an exception nothing handled (uvicorn's "Exception in ASGI
      application", ``log.exception`` of a bug);
    * ``escalations``: a supervisor gave up ("escalates to its parent");
    * ``crashes``: an actor crashed (WARNING ``stepd.actors``, with its traceback);
    * ``errors``: any other ERROR line.
    """
    out: dict[str, list[str]] = {"unhandled": [], "escalations": [], "crashes": [], "errors": []}
    lines = text.splitlines()
    for i, line in enumerate(lines):
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        if " ERROR uvicorn.error: Exception in ASGI application" in line:
            out["unhandled"].append(f"{line} :: {_innermost(lines[i + 1:i + 300])}")
        elif "escalates to its parent" in line:
            out["escalations"].append(line)
        elif " WARNING stepd.actors: actor " in line and " crashed: " in line:
            out["crashes"].append(line)
        elif " ERROR " in line:
            (out["unhandled"] if "Traceback" in nxt else out["errors"]).append(f"{line} :: {nxt}")
    return out
