"""The worker process of `python -m bench`: ``python -m bench._worker URL --transport T``.

A `stepd.Worker` forced to one transport (``websocket`` or ``http``), serving
the bench's workflows (`bench._workloads.workflows`). It prints
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
    parser.add_argument("--concurrency", type=int, default=128)
    parser.add_argument("--name", default="bench-worker")
    args = parser.parse_args()
    worker = stepd.Worker(args.url, concurrency=args.concurrency, name=args.name,
                          transport=args.transport)
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
