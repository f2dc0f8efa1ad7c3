"""A worker process holding worker sessions: the Python SDK (`stepd.Worker`) with resources.

    python -m tests.affinity._session_worker --url URL --workflow NAME --gpu a100
        [--reacquire same_requirements|never] [--transport websocket|http] [--name NAME]
        [--sticky]

Started by the session tests with `subprocess` and SIGKILLed by its PID by some
of them. It prints ``ready <worker_id>`` once registered, ``acquired
<session_id> <generation>`` from its `on_session_acquired` hook, and ``body
<step_id> <run_id> <generation>`` when a body runs, then serves until SIGTERM
(a graceful stop, which closes its sessions) or SIGKILL. With ``--sticky`` it
also keeps a sticky cache (8 runs), so a holder loss shows as a forced cold
replay on the worker that takes the session over.

The workflow (`session_flow`): ``load`` (session ``gpu``) -> wait for the
signal ``go`` -> ``infer`` (session ``gpu``); ``gpu`` requires ``{"gpu":
"a100"}``, ``lease_ms`` 600, ``ttl_ms`` 120000.
"""

from __future__ import annotations

import argparse
import threading
from typing import Any

import stepd

LEASE_MS = 600
TTL_MS = 120_000
_generation: dict[str, int] = {}


def load(ctx: stepd.StepContext, input: Any) -> dict[str, Any]:
    print(f"body {ctx.step_id} {ctx.run_id}", flush=True)
    return {"loaded": input}


def infer(ctx: stepd.StepContext, input: Any, steps: dict[str, Any]) -> dict[str, Any]:
    print(f"body {ctx.step_id} {ctx.run_id}", flush=True)
    return {"answer": steps["load"]["loaded"]}


def session_flow(name: str, reacquire: str) -> stepd.Workflow:
    return (stepd.Workflow(name)
            .session("gpu", requirements={"gpu": "a100"}, queue="gpu", lease_ms=LEASE_MS,
                     ttl_ms=TTL_MS, reacquire=reacquire)
            .then(load, session="gpu")
            .wait("go")
            .then(infer, input="${input}", session="gpu"))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--workflow", required=True)
    parser.add_argument("--gpu", required=True)
    parser.add_argument("--reacquire", default="same_requirements")
    parser.add_argument("--transport", default="websocket", choices=("websocket", "http"))
    parser.add_argument("--name", default=None)
    parser.add_argument("--sticky", action="store_true")
    args = parser.parse_args()

    def acquired(session: Any) -> None:
        print(f"acquired {session.session_id} {session.generation}", flush=True)

    worker = stepd.Worker(args.url, concurrency=4, name=args.name, transport=args.transport,
                          grace=5.0, resources={"gpu": args.gpu}, max_sessions=2,
                          on_session_acquired=acquired,
                          sticky_cache_capacity=8 if args.sticky else 0)
    worker.register(session_flow(args.workflow, args.reacquire))

    def announce() -> None:
        if worker.wait_ready(30):
            print(f"ready {worker.worker_id}", flush=True)

    threading.Thread(target=announce, daemon=True).start()
    worker.serve()  # the main thread: SIGTERM stops it gracefully
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
