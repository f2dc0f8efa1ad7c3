"""A worker process for the sticky execution tests (tests/affinity/test_sticky_processes.py).

``python -m tests.affinity._sticky_worker --url URL --prefix NAME [...]`` serves
the workflows of `workflows(prefix)` with the sticky cache settings given, prints
``ready <worker_id>`` once registered, and stops gracefully on SIGTERM (a test
SIGKILLs it to lose it without a word).
"""

from __future__ import annotations

import argparse
from typing import Any

import stepd
from tests.campaign._worker_proc import serve_announcing

STATE_BYTES = 2048


def grow(ctx: stepd.StepContext, input: Any, steps: dict[str, Any]) -> dict[str, Any]:
    """Each step adds 2 KB of state and reports what it saw: the history a body sees
    must be the same with the sticky cache on or off."""
    n = len([k for k in steps if k.startswith("s")])
    ctx.patch_state(**{f"k{ctx.step_id}": f"{ctx.step_id}:" + "x" * STATE_BYTES})
    return {"step": ctx.step_id, "seen_steps": list(steps), "seen_state": list(ctx.state),
            "n": n, "go": steps.get("go")}


def workflows(prefix: str, steps: int = 5) -> list[stepd.Workflow]:
    """``<prefix>-chain``: `steps` task steps. ``<prefix>-paused``: s0, a wait for signal
    ``go`` (so a test can change workers between steps), s1, s2."""
    chain = stepd.Workflow(f"{prefix}-chain", version="v1")
    for i in range(steps):
        chain = chain.then(grow, id=f"s{i}")
    paused = (stepd.Workflow(f"{prefix}-paused", version="v1").then(grow, id="s0")
              .wait("go", into="go").then(grow, id="s1").then(grow, id="s2"))
    return [chain, paused]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--prefix", required=True)
    parser.add_argument("--transport", default="websocket", choices=("websocket", "http"))
    parser.add_argument("--name", default=None)
    parser.add_argument("--build-id", default=None)
    parser.add_argument("--worker-id", default=None)
    parser.add_argument("--capacity", type=int, default=0)
    parser.add_argument("--max-bytes", type=int, default=64 << 20)
    parser.add_argument("--schedule-ms", type=int, default=None)
    args = parser.parse_args()
    worker = stepd.Worker(args.url, concurrency=4, name=args.name, build_id=args.build_id,
                          transport=args.transport, grace=5.0, worker_id=args.worker_id,
                          sticky_cache_capacity=args.capacity,
                          sticky_cache_bytes=args.max_bytes,
                          sticky_schedule_ms=args.schedule_ms)
    worker.register(*workflows(args.prefix))
    return serve_announcing(worker)


if __name__ == "__main__":
    raise SystemExit(main())
