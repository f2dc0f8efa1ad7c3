"""A worker session pinned to a GPU, and a local step: load a model once, warm it up in the
same worker with no round trip, run every prompt on the same machine.

    python examples/gpu_session.py                     # on an embedded daemon (a temporary directory)
    python examples/gpu_session.py --url http://127.0.0.1:7707 [--key KEY]   # on `stepd serve`

The workflow declares a session ``gpu`` that requires ``{"gpu": "a100"}``
(docs/affinity.md "Worker sessions"). Its steps (``load``, then a ``for_each``
of ``generate`` over the prompts, two at a time: ``max_concurrent`` 2) all run
on the worker holding the session. Three workers serve the workflow: a CPU-only
one (no sessions) and two GPU boxes (``resources={"gpu": "a100"}``).

Right after ``load``, ``warm`` is a *local* step (``local=True``, docs/affinity.md
"Local steps", declared by the GPU workers with ``local_steps=True``): it runs
inside the worker that ran ``load`` (the session's holder), straight after it, with no lease of its own; its record rides in
``load``'s ``complete`` and is journaled with ``"execution_mode": "local"``.

Each GPU worker's ``on_session_acquired`` hook "loads the model" into its own
process memory before the session's first step there: a session id never makes
process memory durable. Halfway (the run waits for a ``go`` signal), the
holder stops gracefully: it closes its session, the other GPU box takes it
over at once (same TTL, generation 2), its hook loads the model again, and the
prompts run there. The CPU worker never gets a step of the session.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from typing import Any

import stepd

PROMPTS = ["a haiku about LMDB", "a limerick about leases", "a koan about fences"]
MODELS: dict[str, str] = {}  # worker name -> the "model" its process has loaded


def load(ctx: stepd.StepContext, input: Any) -> dict[str, Any]:
    return {"model": input["model"]}


def warm(ctx: stepd.StepContext, input: Any) -> dict[str, Any]:
    return {"warmed": input["model"]}


def generate(ctx: stepd.StepContext, prompt: str) -> dict[str, Any]:
    if not MODELS:
        raise RuntimeError("no model loaded: on_session_acquired runs before a session's step")
    time.sleep(0.02)  # the GPU at work
    return {"prompt": prompt, "text": f"[{prompt}]"}


workflow = (
    stepd.Workflow("gpu-session", version="gpu-session.v1")
    .session("gpu", requirements={"gpu": "a100"}, lease_ms=3000, ttl_ms=600_000,
             max_concurrent=2, reacquire="same_requirements")
    .then(load, session="gpu")
    .then(warm, local=True, input="${steps.load}")  # in load's worker: no round trip
    .wait("go")
    .for_each("${input.prompts}", generate, into="texts", session="gpu")
)


def gpu_worker(target: Any, name: str) -> stepd.Worker:
    def acquired(session: stepd.SessionAcquired) -> None:
        MODELS[name] = "llm-7b"  # restore local resources before the session's next step
        print(f"session {session.name} acquired by {name} (generation {session.generation})",
              flush=True)

    return stepd.Worker(target, concurrency=4, name=name, resources={"gpu": "a100"},
                        max_sessions=1, on_session_acquired=acquired,
                        local_steps=True).register(workflow)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", help="a running daemon (default: an embedded one)")
    parser.add_argument("--key", help="its API key")
    args = parser.parse_args()
    with ExitStack() as stack:
        if args.url:
            target: Any = args.url
            print(f"daemon: {args.url}")
        else:
            data = stack.enter_context(tempfile.TemporaryDirectory(prefix="stepd-gpu-"))
            target = stack.enter_context(stepd.embedded(data))
            print("daemon: embedded")
        client = stack.enter_context(stepd.Client(target, key=args.key))
        cpu = stepd.Worker(client, concurrency=4, name="cpu-box").register(workflow)
        gpu_a = gpu_worker(client, "gpu-a")
        workers = [cpu, gpu_a]
        threads = []
        for w in workers:
            threads.append(threading.Thread(target=w.serve, kwargs={"handle_signals": False}))
            threads[-1].start()
            w.wait_ready(30)
        gpu_b = gpu_worker(client, "gpu-b")
        try:
            run = client.start(workflow, {"model": "llm-7b", "prompts": PROMPTS})
            deadline = time.monotonic() + 30
            while not any(e["type"] == "step_completed" for e in client.journal(run)):
                if time.monotonic() > deadline:
                    raise SystemExit("load did not complete")
                time.sleep(0.02)
            names = {w.worker_id: w.name for w in (cpu, gpu_a)}
            threads.append(threading.Thread(target=gpu_b.serve, kwargs={"handle_signals": False}))
            threads[-1].start()
            gpu_b.wait_ready(30)
            names[gpu_b.worker_id] = gpu_b.name
            print(f"{gpu_a.name} stops gracefully: it closes the sessions it holds", flush=True)
            gpu_a.stop()
            threads[1].join(30)
            deadline = time.monotonic() + 30
            while len([e for e in client.journal(run) if e["type"] == "session_acquired"]) < 2:
                if time.monotonic() > deadline:
                    raise SystemExit("the session was not taken over")
                time.sleep(0.02)
            client.signal(run, "go")
            result = client.result(run, timeout=30)
            print(f"texts: {[t['text'] for t in result]}")
            where = [(e["step_id"], e.get("item_index"), names.get(e["worker_id"], "?"))
                     for e in client.journal(run) if e["type"] == "step_offered"]
            for step_id, item, name in where:
                print(f"  {step_id}{'' if item is None else f'[{item}]'} offered to {name}")
            local = [names.get(e.get("worker_id"), "?") for e in client.journal(run)
                     if e["type"] == "step_completed" and e["step_id"] == "warm"
                     and e.get("execution_mode") == "local"]
            print(f"warm ran as a local step on: {', '.join(local) or 'nowhere'}")
            on_gpu = all(name.startswith("gpu-") for _, _, name in where)
            print(f"every session step ran on a GPU worker: {on_gpu}")
            print("journal:", ", ".join(e["type"] for e in client.journal(run)
                                        if e["type"].startswith("session_")))
            return 0 if on_gpu else 1
        finally:
            for w in (cpu, gpu_a, gpu_b):
                w.stop()
            for t in threads:
                t.join(30)


if __name__ == "__main__":
    sys.exit(main())
