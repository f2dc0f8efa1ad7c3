"""A worker process for the affinity scenarios: the Python SDK serving one workflow.

    python -m tests.affinity._worker_proc --url URL --bodies DIR --name NAME
        [--transport websocket|http] [--protocol 1.20] [--local]
        [--workflow local|plain] [--block STEP] [--slow-ms N]

Started by tests/affinity with `subprocess` and stopped by its PID (SIGKILL by
some tests). Prints ``ready <worker_id>`` once registered, then serves until
SIGTERM (a graceful stop) or SIGKILL.

Every body counts itself durably before it returns: it creates
``DIR/<run>__<step>__<pid>__<attempt>`` (``O_EXCL``) holding its idempotency
key and lease id, fsyncs it and the directory, and prints ``body <step>
<run>``. With ``--block STEP`` the body of STEP then prints ``blocked <run>``
and waits (bounded) to be killed: a kill "after the local bodies ran but
before the parent's complete committed" is ``--block norm``, one after it is
``--block tally``.

Workflows (results computed again by the tests, `expected`):

* ``local``: ``prep`` (``n + 1``) -> ``norm`` (local: ``x 10``) -> ``tally`` (``+ 1``);
* ``plain``: the same steps with ``norm`` an ordinary task step.
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import stepd
from tests._durable import write_synced

BODIES = Path(".")
BLOCK: str | None = None
SLOW_S = 0.0


def expected(n: int) -> int:
    return (n + 1) * 10 + 1


def record(ctx: stepd.StepContext) -> None:
    path = BODIES / f"{ctx.run_id}__{ctx.step_id}__{os.getpid()}__{ctx.attempt}"
    write_synced(path, f"{ctx.idempotency_key} {ctx.lease_id}\n")
    print(f"body {ctx.step_id} {ctx.run_id}", flush=True)
    if SLOW_S:
        time.sleep(SLOW_S)
    if BLOCK == ctx.step_id:
        print(f"blocked {ctx.run_id}", flush=True)
        deadline = time.monotonic() + 60  # bounded: the test kills this process first
        while time.monotonic() < deadline:
            time.sleep(0.05)


def prep(ctx: stepd.StepContext, input: Any) -> dict[str, int]:
    record(ctx)
    return {"n": int(input["n"]) + 1}


def norm(ctx: stepd.StepContext, input: Any) -> int:
    record(ctx)
    return int(input) * 10


def tally(ctx: stepd.StepContext, input: Any) -> int:
    record(ctx)
    return int(input) + 1


def workflow(kind: str, name: str) -> stepd.Workflow:
    return (stepd.Workflow(name).then(prep)
            .then(norm, input="${steps.prep.n}", local=kind == "local")
            .then(tally, input="${steps.norm}"))


def main() -> None:
    global BODIES, BLOCK, SLOW_S
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--bodies", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--transport", default="websocket")
    p.add_argument("--protocol", default="1.20")
    p.add_argument("--local", action="store_true")
    p.add_argument("--workflow", default="local")
    p.add_argument("--workflow-name", default="aff-local")
    p.add_argument("--block", default=None)
    p.add_argument("--slow-ms", type=int, default=0)
    p.add_argument("--concurrency", type=int, default=2)
    args = p.parse_args()
    BODIES, BLOCK, SLOW_S = Path(args.bodies), args.block, args.slow_ms / 1000
    worker = stepd.Worker(args.url, concurrency=args.concurrency, name=args.name,
                          transport=args.transport, grace=2.0, local_steps=args.local,
                          protocol_version=args.protocol)
    worker.register(workflow(args.workflow, args.workflow_name))
    signal.signal(signal.SIGTERM, lambda *_: worker.stop())

    def announce() -> None:
        if worker.wait_ready(30):
            print(f"ready {worker.worker_id}", flush=True)

    threading.Thread(target=announce, daemon=True).start()
    worker.serve()


if __name__ == "__main__":
    main()
