"""Chaos: a batch of runs while actors are killed at random and a worker is SIGKILLed.

    python examples/chaos.py [--runs 50] [--seed N] [--timeout 50]

It starts `stepd serve` (a subprocess, short lease timings: TTL 1 s, heartbeat
0.2 s, recovery window 0.3 s) and two worker processes (this file with
``--worker``), starts ``--runs`` runs of a small workflow (a task that patches
the state, a ``for_each`` of four items, a task that adds it all up), then,
while they run:

* kills up to three random actors of the daemon's supervision tree every ~50 ms
  (``POST /v1/api/actors/kill``, `stepd.Client.kill_actor`): run actors, lease
  actors, the registry, the timers, the supervisors; each is restarted from
  storage by its supervisor;
* SIGKILLs the first worker process once the first runs have completed, at a
  moment it holds leases: the leases it held expire, are recovered, and the
  second worker takes them over. (Not "once a quarter have completed": on a
  fast machine the whole batch can finish between two looks at the run list.)

Then it checks every run: completed, with the result computed independently
here, and counts what happened (journal events, restarts). It exits 0 only if
every run completed with the right result and none is missing.
"""

from __future__ import annotations

import argparse
import os
import queue
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import stepd

TIMINGS = ["--lease-ttl-ms", "1000", "--heartbeat-ms", "200", "--recovery-window-ms", "300"]


# --------------------------------------------------------------------------- the workflow


def prepare(ctx: stepd.StepContext, input: dict[str, Any]) -> dict[str, Any]:
    time.sleep(random.uniform(0.005, 0.03))
    n = input["n"]
    ctx.patch_state(items=[n, n + 1, n + 2, n + 3])
    return {"n": n}


async def square(ctx: stepd.StepContext, item: int) -> int:
    import anyio

    await anyio.sleep(random.uniform(0.02, 0.12))
    return item * item


def total(ctx: stepd.StepContext, input: Any, steps: dict[str, Any]) -> int:
    return int(steps["prepare"]["n"]) + sum(steps["square"])


chaos = (
    stepd.Workflow("chaos", version="chaos.v1")
    .then(prepare, retry=stepd.Retry(max_attempts=10, initial_backoff="20ms"))
    .for_each("${state.items}", square, into="squares",
              retry=stepd.Retry(max_attempts=10, initial_backoff="20ms"))
    .then(total, retry=stepd.Retry(max_attempts=10, initial_backoff="20ms"))
)


def expected(n: int) -> int:
    return n + sum((n + k) ** 2 for k in range(4))


# --------------------------------------------------------------------------- processes


def worker_main(url: str, name: str) -> int:
    """``--worker``: serve the workflow until SIGTERM (or SIGKILL)."""
    worker = stepd.Worker(url, concurrency=8, name=name).register(chaos)

    def announce() -> None:
        if worker.wait_ready(20):
            print(f"ready {worker.worker_id}", flush=True)

    threading.Thread(target=announce, daemon=True).start()
    worker.serve()  # the main thread: SIGTERM stops it gracefully
    return 0


class Child:
    """A subprocess whose stdout lines we read on a thread (bounded waits)."""

    def __init__(self, name: str, cmd: list[str], log: Path) -> None:
        self.name = name
        self.log = log
        with log.open("w") as err:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def expect(self, pattern: str, timeout: float = 20.0) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError(f"{self.name}: no {pattern!r} within {timeout} s") from None
            if line is None:
                raise RuntimeError(f"{self.name} exited ({self.proc.wait()}):\n"
                                   f"{self.log.read_text()[-2000:]}")
            found = re.search(pattern, line)
            if found:
                return found

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout)
        return self.proc.returncode


# --------------------------------------------------------------------------- chaos


def actor_paths(tree: dict[str, Any]) -> list[str]:
    paths = [tree["path"]]
    for child in tree.get("children") or []:
        paths.extend(actor_paths(child))
    return [p for p in paths if p != "/"]


COOLDOWN_S = 3.0
"""An actor is not killed again, nor its ancestors or descendants, within this.

A killed lease actor is re-armed with a full TTL (PROTOCOL.md: a restart must
not mass-expire healthy workers), so killing the same lease (or ``/leases``)
more often than the TTL plus the recovery window would keep a dead worker's
lease from ever expiring. The cool-down leaves every lease that window.
"""


def related(a: str, b: str) -> bool:
    return a == b or a.startswith(b + "/") or b.startswith(a + "/")


def pick(paths: list[str], recent: dict[str, float], now: float, rng: random.Random) -> str | None:
    for path in list(recent):
        if now - recent[path] > COOLDOWN_S:
            del recent[path]
    eligible = [p for p in paths if not any(related(p, k) for k in recent)]
    return rng.choice(eligible) if eligible else None


def restarts(tree: dict[str, Any]) -> int:
    return int(tree.get("restarts") or 0) + sum(restarts(c) for c in tree.get("children") or [])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--timeout", type=float, default=50.0, help="give up after this (s)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--name", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker_main(args.url, args.name)

    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    rng = random.Random(seed)
    t0 = time.monotonic()
    deadline = t0 + args.timeout
    with tempfile.TemporaryDirectory(prefix="stepd-chaos-") as tmp:
        base = Path(tmp)
        daemon = Child("stepd serve", [sys.executable, "-m", "stepd", "serve", "--data",
                                       str(base / "data"), "--port", "0", *TIMINGS],
                       base / "serve.log")
        workers: list[Child] = []
        try:
            url = daemon.expect(r"stepd listening on (http://\S+) ").group(1)
            for i in (1, 2):
                workers.append(Child(f"worker {i}", [sys.executable, __file__, "--worker",
                                                      "--url", url, "--name", f"chaos-w{i}"],
                                     base / f"worker{i}.log"))
            ids = [w.expect(r"ready (w_\S+)").group(1) for w in workers]
            print(f"daemon {url} (pid {daemon.proc.pid}), workers chaos-w1 {ids[0]} "
                  f"(pid {workers[0].proc.pid}) and chaos-w2 {ids[1]} (pid {workers[1].proc.pid}); "
                  f"seed {seed}")
            return drive(url, workers, ids, args.runs, rng, deadline, t0)
        finally:
            for w in workers:
                w.stop()
            code = daemon.stop()
            if code != 0:
                print(f"stepd serve exited {code}:\n{(base / 'serve.log').read_text()[-2000:]}")


def drive(url: str, workers: list[Child], ids: list[str], n: int, rng: random.Random,
          deadline: float, t0: float) -> int:
    client = stepd.Client(url, timeout=10, retries=10)
    runs = [client.start(chaos, {"n": i}, idempotency_key=f"chaos:{i}") for i in range(n)]
    print(f"started {n} runs of {chaos.name}; killing actors and, later, worker chaos-w1")
    kills: Counter[str] = Counter()
    recent: dict[str, float] = {}
    missed = 0
    killed_worker_at: float | None = None
    held_when_killed = 0
    done = 0
    while time.monotonic() < deadline:
        done = sum(1 for r in client.list_runs(workflow="chaos", limit=None) if r.done)
        if killed_worker_at is None and done >= 1:
            held = sum(len(w.get("leases") or []) for w in client.workers()
                       if w["worker_id"] == ids[0])
            if held > 0 or done == n:  # mid-work; or too late to catch it with leases
                held_when_killed = held
                os.kill(workers[0].proc.pid, signal.SIGKILL)
                workers[0].proc.wait(10)
                killed_worker_at = time.monotonic() - t0
                print(f"  {killed_worker_at:5.2f} s: SIGKILL chaos-w1 (pid {workers[0].proc.pid}) "
                      f"holding {held_when_killed} lease(s); {done}/{n} runs done")
        if done == n:
            break
        paths = actor_paths(client.actors())
        for _ in range(3):  # up to three kills per round
            path = pick(paths, recent, time.monotonic(), rng)
            if path is None:
                break
            try:
                client.kill_actor(path)
                kills[path.split("/")[1] if path.count("/") > 1 else path] += 1
            except (stepd.NotFound, stepd.Unavailable):
                missed += 1  # it ended (or is restarting) between the listing and the kill
            recent[path] = time.monotonic()
        time.sleep(rng.uniform(0.02, 0.05))
    elapsed = time.monotonic() - t0

    # --- the verdict
    right = wrong = failed = 0
    events: Counter[str] = Counter()
    attempts_by: Counter[str] = Counter()
    runs_on_both = 0
    for i, run in enumerate(runs):
        try:
            value = run.result(timeout=max(0.1, deadline - time.monotonic()))
        except stepd.RunFailed as exc:
            failed += 1
            print(f"  run {run} (n={i}) {exc.status}: {exc.reason}: {exc.message}")
            continue
        except TimeoutError:
            status = client.status(run)
            print(f"  run {run} (n={i}) still {status.status}: steps {status.current_steps}")
            continue
        if value == expected(i):
            right += 1
        else:
            wrong += 1
            print(f"  run {run} (n={i}): result {value}, expected {expected(i)}")
        names = set()
        for e in run.journal():
            events[e["type"]] += 1
            if e["type"] == "step_offered":
                attempts_by[e.get("worker_name", "?")] += 1
                names.add(e.get("worker_name"))
        runs_on_both += len(names) > 1
    listed = list(client.list_runs(workflow="chaos", limit=None))
    statuses = Counter(r.status for r in listed)
    tree = client.actors()
    client.close()

    print(f"after {elapsed:.1f} s:")
    print(f"  runs: {n} started, {len(listed)} listed by the daemon ({dict(statuses)}); "
          f"{right} right results, {wrong} wrong, {failed} failed, "
          f"{n - right - wrong - failed} unfinished")
    print(f"  actors killed: {sum(kills.values())} ({', '.join(f'{k} {v}' for k, v in sorted(kills.items()))}); "
          f"{missed} already gone; the actors alive now count {restarts(tree)} restarts")
    print(f"  worker chaos-w1 SIGKILLed at "
          f"{'-' if killed_worker_at is None else f'{killed_worker_at:.2f} s'} holding "
          f"{held_when_killed} lease(s); attempts offered: "
          f"{', '.join(f'{k} {v}' for k, v in sorted(attempts_by.items()))}; "
          f"{runs_on_both} runs ran on both workers")
    print(f"  journal: {events['step_offered']} attempts offered, {events['step_completed']} "
          f"steps completed, {events['step_failed']} attempts failed, "
          f"{events['step_orphaned']} orphaned, {events['step_revived']} revived, "
          f"{events['step_recovered']} recovered, {events['step_unservable']} unservable")
    ok = (right == n and len(listed) == n and statuses.get("completed") == n
          and killed_worker_at is not None)
    print(f"{'OK' if ok else 'FAILED'}: {right}/{n} runs completed with the right result, "
          f"{n - len(listed)} lost")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
