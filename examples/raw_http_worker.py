"""A stepd worker with no SDK: PROTOCOL.md over plain HTTP, about a hundred lines.

    python examples/raw_http_worker.py --url http://127.0.0.1:7707 [--key K] [--runs 5]

It registers a two-step workflow, starts `--runs` runs of it, serves their
steps by HTTP long-poll (claim, started, heartbeat, complete/fail) and answers
every 409 by its reason as the PROTOCOL.md table says, then prints each run's
result and exits. With no daemon at --url (or one that refuses it) it says so
in one line on stderr and exits 1. Nothing here imports stepd: other languages
can copy it.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time

import httpx

DEFINITION = {
    "name": "raw_greet",
    "version": "raw.v1",
    "steps": [
        {"id": "shout", "kind": "task", "body": "shout", "input": "${input}"},
        {"id": "greet", "kind": "task", "body": "greet", "input": "${steps.shout}"},
    ],
}
BODIES = {"shout": lambda name: name.upper(), "greet": lambda name: f"hello, {name}!"}


class Worker:
    def __init__(self, url: str, key: str | None) -> None:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.http = httpx.Client(base_url=url, headers=headers, timeout=60)
        reg = self.post("/v1/api/workers/register", {"name": "raw-http", "definitions": [DEFINITION]})
        self.worker_id = reg.json()["worker_id"]
        self.heartbeat_s = reg.json()["heartbeat_ms"] / 1000
        self.done_runs: set[str] = set()  # run_terminal: claim nothing more from these

    def post(self, path: str, body: dict) -> httpx.Response:
        r = self.http.post(path, json=body)
        if r.status_code >= 400 and r.status_code != 409:
            r.raise_for_status()
        return r

    def call(self, lease: dict, op: str, body: dict) -> bool:
        """POST a lease call; False means stop working on this lease (a 409)."""
        r = self.post(f"/v1/api/steps/{lease['lease_id']}/{op}", body)
        if r.status_code != 409:
            return True
        reason = r.json()["reason"]
        if reason == "already_applied":  # an earlier complete/fail landed: success
            return False
        if reason == "fenced":  # a later attempt owns the step: abandon it
            return False
        if reason == "run_terminal":  # the run is over: nothing more from it
            self.done_runs.add(lease["run_id"])
            return False
        if reason == "not_started":  # our bug: we must say started first
            sys.exit(f"worker bug: {op} before started on {lease['lease_id']}")
        raise RuntimeError(f"unknown 409 reason {reason!r}")

    def serve_one(self, lease: dict) -> None:
        if lease["run_id"] in self.done_runs:
            return
        if lease["workflow"] != DEFINITION["name"] or lease["body"] not in BODIES:
            self.call(lease, "fail", {"error": {"class": "unservable", "message": "not mine"}})
            return
        if not self.call(lease, "started", {}):
            return
        stop = threading.Event()
        beat = threading.Thread(target=self.heartbeat, args=(lease, stop), daemon=True)
        beat.start()
        try:
            output = BODIES[lease["body"]](lease["input"])
        except Exception as exc:  # only the message travels, never the traceback
            stop.set()
            self.call(lease, "fail", {"error": {"class": "fatal", "message": str(exc)}})
            return
        stop.set()
        self.call(lease, "complete", {"output": output})

    def heartbeat(self, lease: dict, stop: threading.Event) -> None:
        while not stop.wait(self.heartbeat_s):
            if not self.call(lease, "heartbeat", {"progress": None}):
                return

    def claim(self, wait_ms: int = 5000) -> list[dict]:
        body = {"worker_id": self.worker_id, "max": 4, "wait_ms": wait_ms}
        return self.post("/v1/api/steps/claim", body).json()["leases"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", default="http://127.0.0.1:7707")
    parser.add_argument("--key", default=None)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args()
    try:
        run(args)
    except httpx.TransportError as exc:  # one line, not a traceback: nobody to talk to
        sys.exit(f"error: no stepd daemon answers at {args.url} ({type(exc).__name__}: {exc}); "
                 "start one with 'stepd serve --data DIR' or pass --url")
    except httpx.HTTPStatusError as exc:  # e.g. 401: a daemon with keys and no --key
        sys.exit(f"error: the daemon at {args.url} answered {exc.response.status_code} to "
                 f"{exc.request.method} {exc.request.url.path}: {exc.response.text[:200]!r}")


def run(args: argparse.Namespace) -> None:
    worker = Worker(args.url, args.key)
    names = [f"ada-{i}" for i in range(args.runs)]
    runs = [worker.post("/v1/api/runs", {"workflow": "raw_greet", "input": n}).json()["run_id"]
            for n in names]
    deadline = time.monotonic() + args.timeout
    pending = set(runs)
    while pending and time.monotonic() < deadline:
        for lease in worker.claim(wait_ms=1000):
            worker.serve_one(lease)
        for run_id in list(pending):
            if worker.http.get(f"/v1/api/runs/{run_id}").json()["status"] != "running":
                pending.discard(run_id)
    for name, run_id in zip(names, runs):
        view = worker.http.get(f"/v1/api/runs/{run_id}").json()
        print(f"{run_id} {view['status']} {view['result']!r}")
    if pending:
        sys.exit(f"{len(pending)} runs did not finish in {args.timeout} s")


if __name__ == "__main__":
    main()
