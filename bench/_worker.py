"""The worker process of `python -m bench`: ``python -m bench._worker URL --transport T``.

A `stepd.Worker` forced to one transport (``websocket`` or ``http``), serving
the bench's workflows (`bench._workloads.workflows`), written as a user writes
it: ``stepd.Worker(url)`` with the SDK's default concurrency (unless
``--concurrency`` is given) and ``worker.serve()``. It prints
``ready <transport> <worker_id>`` once registered, then serves until SIGTERM
(graceful stop: the SDK's own signal handling).
"""

from __future__ import annotations

import argparse
import sys
import threading

import stepd
from bench._workloads import bodies, workflows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("--transport", required=True, choices=["websocket", "http"])
    parser.add_argument("--concurrency", type=int, default=None,
                        help="slots; default: stepd.Worker's own default")
    parser.add_argument("--name", default="bench-worker")
    args = parser.parse_args()
    knobs = {} if args.concurrency is None else {"concurrency": args.concurrency}
    worker = stepd.Worker(args.url, name=args.name, transport=args.transport, **knobs)
    worker.register(*workflows(), bodies=bodies())

    def announce() -> None:
        if worker.wait_ready(30):
            print(f"ready {worker.transport} {worker.worker_id}", flush=True)
        else:
            print("not ready after 30 s", file=sys.stderr, flush=True)

    threading.Thread(target=announce, daemon=True).start()
    worker.serve()  # main thread: SIGTERM/SIGINT stop it gracefully


if __name__ == "__main__":
    main()
