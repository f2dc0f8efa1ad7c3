"""Worker sessions across real processes: SIGKILL the holder (AFFINITY.md "Worker sessions").

A ``stepd serve`` subprocess on 127.0.0.1 and SDK worker processes
(`tests.affinity._session_worker`) over the WebSocket or HTTP long-poll. Worker A
(``gpu: a100``) is the only match when the run starts, so it creates and holds
the session and runs ``load``; then B (``a100``) and C (``t4``) register, and A
is SIGKILLed by its PID while the run waits for its signal. A's session lease
(600 ms) expires without renewals:

* ``reacquire: "same_requirements"``: B takes the session over (generation 2),
  its ``on_session_acquired`` hook runs before ``infer``, which runs on B; C
  (resources do not match) never gets a step of it. The workers keep sticky
  caches: A was the run's sticky holder, so B's lease of ``infer`` is cold
  (reason ``session_holder_lost``) and B counts a forced cold replay, not a miss;
* ``reacquire: "never"``: the run fails with reason ``session_lost``.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests._waiting import eventually
from tests.reliability.conftest import start_daemon, stop_daemon

ROOT = Path(__file__).resolve().parents[2]
DAEMON_ARGS = ("--lease-ttl-ms", "800", "--heartbeat-ms", "200", "--recovery-window-ms", "200",
               "--max-request-ms", "2000")
WAIT_S = 30.0

pytestmark = pytest.mark.timeout(120)


class SessionWorker:
    """A `_session_worker` subprocess, stopped by its PID and always reaped."""

    def __init__(self, url: str, workflow: str, gpu: str, reacquire: str, transport: str,
                 name: str, logs: Path, sticky: bool) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("STEPD_")}
        cmd = [sys.executable, "-m", "tests.affinity._session_worker", "--url", url,
               "--workflow", workflow, "--gpu", gpu, "--reacquire", reacquire,
               "--transport", transport, "--name", name] + (["--sticky"] if sticky else [])
        self.log = logs / f"{name}.log"
        with self.log.open("w") as err:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=err,
                                         text=True, env=env)
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        self.worker_id = ""
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        with self.proc.stdout:
            for line in self.proc.stdout:
                self.lines.put(line.rstrip("\n"))

    def expect(self, prefix: str) -> str:
        """The next line starting with `prefix` (bounded wait); earlier lines are kept."""
        deadline = time.monotonic() + WAIT_S
        while True:
            for line in self.seen:
                if line.startswith(prefix):
                    return line
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {prefix!r} line; saw {self.seen}; "
                                     f"stderr: {self.log.read_text(errors='replace')[-2000:]}")
            try:
                self.seen.append(self.lines.get(timeout=min(left, 0.5)))
            except queue.Empty:
                pass

    def ready(self) -> str:
        self.worker_id = self.expect("ready ").split()[1]
        return self.worker_id

    def drain(self) -> list[str]:
        while True:
            try:
                self.seen.append(self.lines.get_nowait())
            except queue.Empty:
                return self.seen

    def kill9(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill9()


def journal(client: httpx.Client, run_id: str) -> list[dict[str, Any]]:
    r = client.get(f"/v1/api/runs/{run_id}/journal")
    assert r.status_code == 200, r.text
    return list(r.json()["events"])


def wait_for(check: Any, what: str) -> Any:
    return eventually(check, timeout=WAIT_S, what=what, interval=0.05)


def scenario(tmp_path: Path, transport: str, reacquire: str, *, sticky: bool = False
             ) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, SessionWorker],
                        dict[str, Any]]:
    """Run the scenario; returns the run's journal, its result, the workers and the
    workers API's sticky counts by worker id (once the run ended)."""
    d = start_daemon(tmp_path / "data", *DAEMON_ARGS)
    workers: dict[str, SessionWorker] = {}
    workflow = f"sess-{uuid.uuid4().hex[:8]}"
    try:
        def spawn(name: str, gpu: str) -> SessionWorker:
            w = workers[name] = SessionWorker(d.url, workflow, gpu, reacquire, transport, name,
                                              tmp_path, sticky)
            w.ready()
            return w

        a = spawn("a", "a100")
        with httpx.Client(base_url=d.url, timeout=10) as client:
            r = client.post("/v1/api/runs", json={"workflow": workflow, "input": {"n": 7}})
            assert r.status_code == 201, r.text
            run_id = r.json()["run_id"]
            a.expect("acquired ")
            a.expect(f"body load {run_id}")
            wait_for(lambda: any(e["type"] == "step_completed" and e["step_id"] == "load"
                                 for e in journal(client, run_id)), "load completed")
            b = spawn("b", "a100")
            spawn("c", "t4")
            a.kill9()
            if reacquire == "same_requirements":
                wait_for(lambda: any(e["type"] == "session_acquired"
                                     and e["worker_id"] == b.worker_id
                                     for e in journal(client, run_id)), "reacquired by b")
            r = client.post(f"/v1/api/runs/{run_id}/signal", json={"name": "go"})
            assert r.status_code in (200, 409), r.text  # 409 run_terminal: "never" failed it
            result = wait_for(lambda: _terminal(client, run_id), "the run's end")
            events = journal(client, run_id)
            counts = {w["worker_id"]: w.get("sticky")
                      for w in client.get("/v1/api/workers").json()["workers"]}
        for name in ("b", "c"):
            workers[name].stop()
        assert stop_daemon(d) == 0
        d.assert_quiet_log()
        for w in workers.values():
            w.drain()
        return events, result, workers, counts
    finally:
        for w in workers.values():
            w.kill9()
        stop_daemon(d)


def _terminal(client: httpx.Client, run_id: str) -> dict[str, Any] | None:
    r = client.get(f"/v1/api/runs/{run_id}/result", params={"wait_ms": 500})
    body = r.json()
    return body if body["status"] in ("completed", "failed", "cancelled", "timed_out") else None


@pytest.mark.parametrize("transport", ["websocket", "http"])
def test_sigkill_of_the_holder_moves_the_session_to_a_matching_worker(
        tmp_path: Path, transport: str) -> None:
    events, result, workers, counts = scenario(tmp_path, transport, "same_requirements",
                                               sticky=True)
    a, b, c = workers["a"], workers["b"], workers["c"]
    assert result["status"] == "completed" and result["result"] == {"answer": {"n": 7}}
    sessions = [(e["type"], e.get("worker_id"), e.get("generation")) for e in events
                if e["type"].startswith("session_")]
    assert sessions == [("session_acquired", a.worker_id, 1), ("session_lost", a.worker_id, 1),
                        ("session_acquired", b.worker_id, 2)]
    offered = {e["step_id"]: e["worker_id"] for e in events if e["type"] == "step_offered"}
    assert offered == {"load": a.worker_id, "infer": b.worker_id}
    assert c.worker_id not in {e.get("worker_id") for e in events}
    # B's hook ran for generation 2, before its body of the session's next step.
    lines = b.seen
    hook = next(i for i, line in enumerate(lines) if line.startswith("acquired ")
                and line.endswith(" 2"))
    body = next(i for i, line in enumerate(lines) if line.startswith("body infer"))
    assert hook < body
    assert not any(line.startswith(("acquired", "body")) for line in c.seen)
    # A held the run's sticky cache; B's lease said so (cold) and B fetched the history.
    b_counts = counts[b.worker_id]
    assert {k: b_counts[k] for k in ("hit", "miss", "eviction", "forced_cold_replay")} == {
        "hit": 0, "miss": 0, "eviction": 0, "forced_cold_replay": 1}
    assert counts[a.worker_id]["miss"] == 1  # load: the run's first step, a cold start


@pytest.mark.parametrize("transport", ["websocket", "http"])
def test_sigkill_of_the_holder_with_reacquire_never_fails_the_run(
        tmp_path: Path, transport: str) -> None:
    events, result, workers, _ = scenario(tmp_path, transport, "never")
    assert result["status"] == "failed" and result["error"]["reason"] == "session_lost"
    assert not [e for e in events if e["type"] == "step_offered" and e["step_id"] == "infer"]
    assert not any(line.startswith("body") for line in workers["b"].seen)
