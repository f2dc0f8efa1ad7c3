"""A worker process for the campaign: the Python SDK (`stepd.Worker`) serving one workflow.

    python -m tests.campaign._worker_proc --url URL --workflow wk|ak --bodies DIR
        [--transport websocket|http] [--concurrency N] [--name NAME]

Started by the campaign's tests with `subprocess` (and SIGKILLed by its PID by
some of them). It prints ``ready <worker_id>`` once registered, then serves
until SIGTERM (a graceful stop) or SIGKILL.

Each body counts itself on the worker's side, durably: before its effect it
creates ``DIR/<run>__<step>__<item>__<lease>`` (``O_EXCL``), writes its PID and
attempt, fsyncs the file and the directory, and prints ``body <delivery>
<file>``; after the effect it creates the same name with ``.done``. So a
file per attempt that reached its body, written before the body did anything,
survives the worker's death at any later point.

Workflows (the results are computed again by the tests):

* ``wk`` (worker kills): ``prep`` (at-least-once) -> ``effect`` (at-most-once,
  0.2-0.5 s) -> ``fx``, a ``for_each`` of two at-most-once items (0.2-0.5 s
  each) -> ``total`` (at-least-once): ``10 n + (n + 1) + (n + 2)``;
* ``ak`` (actor kills): ``prep`` (at-least-once, patches ``items`` into the
  state) -> ``square``, a ``for_each`` of four at-least-once items ->
  ``effect`` (at-most-once) -> ``total``: ``n + sum((n + k)^2, k < 4) + 10 n``.
"""

from __future__ import annotations

import argparse
import os
import random
import threading
import time
from pathlib import Path
from typing import Any

import stepd
from tests._durable import write_synced

BODIES: Path = Path(".")
RETRY = stepd.Retry(max_attempts=1000, initial_backoff=0)


def record(ctx: stepd.StepContext) -> Path:
    """The durable count: one file per attempt, fsynced before the body's effect."""
    path = BODIES / f"{ctx.run_id}__{ctx.step_id}__{ctx.item_index}__{ctx.lease_id}"
    write_synced(path, f"{os.getpid()} {ctx.attempt} {ctx.delivery}\n")
    print(f"body {ctx.delivery} {path}", flush=True)
    return path


def done(path: Path) -> None:
    path.with_name(path.name + ".done").touch()


# --------------------------------------------------------------------------- wk


def prep(ctx: stepd.StepContext, input: dict[str, Any]) -> dict[str, Any]:
    path = record(ctx)
    n = int(input["n"])
    done(path)
    return {"n": n, "items": [n + 1, n + 2]}


def effect(ctx: stepd.StepContext, input: dict[str, Any]) -> dict[str, Any]:
    path = record(ctx)
    time.sleep(random.uniform(0.2, 0.5))  # the effect: the worker may die here
    done(path)
    return {"v": 10 * int(input["n"]), "lease_id": ctx.lease_id}


def fx(ctx: stepd.StepContext, item: int) -> dict[str, Any]:
    path = record(ctx)
    time.sleep(random.uniform(0.2, 0.5))
    done(path)
    return {"v": int(item), "lease_id": ctx.lease_id}


def total(ctx: stepd.StepContext, input: Any, steps: dict[str, Any]) -> int:
    path = record(ctx)
    out = int(steps["effect"]["v"]) + sum(int(o["v"]) for o in steps["fx"])
    done(path)
    return out


wk = (
    stepd.Workflow("camp-wk", version="camp-wk.v1")
    .then(prep, retry=RETRY)
    .then(effect, input="${steps.prep}", delivery="at_most_once", retry=RETRY)
    .for_each("${steps.prep.items}", fx, into="fx", delivery="at_most_once", retry=RETRY)
    .then(total, retry=RETRY)
)


def wk_result(n: int) -> int:
    return 10 * n + (n + 1) + (n + 2)


# --------------------------------------------------------------------------- ak


def ak_prep(ctx: stepd.StepContext, input: dict[str, Any]) -> dict[str, Any]:
    path = record(ctx)
    n = int(input["n"])
    time.sleep(random.uniform(0.005, 0.03))
    ctx.patch_state(items=[n + k for k in range(4)])
    done(path)
    return {"n": n}


async def ak_square(ctx: stepd.StepContext, item: int) -> int:
    import anyio

    path = record(ctx)
    await anyio.sleep(random.uniform(0.01, 0.08))
    done(path)
    return int(item) * int(item)


def ak_effect(ctx: stepd.StepContext, input: Any, steps: dict[str, Any]) -> dict[str, Any]:
    path = record(ctx)
    time.sleep(random.uniform(0.01, 0.05))
    done(path)
    return {"v": 10 * int(steps["ak_prep"]["n"]), "lease_id": ctx.lease_id}


def ak_total(ctx: stepd.StepContext, input: Any, steps: dict[str, Any]) -> int:
    path = record(ctx)
    done(path)
    n = int(steps["ak_prep"]["n"])
    return n + sum(int(v) for v in steps["ak_square"]) + int(steps["ak_effect"]["v"])


ak = (
    stepd.Workflow("camp-ak", version="camp-ak.v1")
    .then(ak_prep, retry=RETRY)
    .for_each("${state.items}", ak_square, into="squares", retry=RETRY)
    .then(ak_effect, delivery="at_most_once", retry=RETRY)
    .then(ak_total, retry=RETRY)
)


def ak_result(n: int) -> int:
    return n + sum((n + k) ** 2 for k in range(4)) + 10 * n


WORKFLOWS = {"wk": wk, "ak": ak}


def main() -> int:
    global BODIES
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--workflow", choices=sorted(WORKFLOWS), required=True)
    parser.add_argument("--bodies", required=True)
    parser.add_argument("--transport", default="websocket", choices=("websocket", "http"))
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--name", default=None)
    args = parser.parse_args()
    BODIES = Path(args.bodies)
    worker = stepd.Worker(args.url, concurrency=args.concurrency, name=args.name,
                          transport=args.transport, grace=5.0)
    worker.register(WORKFLOWS[args.workflow])
    return serve_announcing(worker)


def serve_announcing(worker: stepd.Worker) -> int:
    """Serve on the main thread (SIGTERM stops it gracefully), printing ``ready <worker_id>``
    once registered: what the parent test waits for."""

    def announce() -> None:
        if worker.wait_ready(30):
            print(f"ready {worker.worker_id}", flush=True)

    threading.Thread(target=announce, daemon=True).start()
    worker.serve()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
