"""An idle worker is served again after its session actor, or all of them, restarted.

examples/chaos.py left runs `running` for good (1 chaos run in ~60 under load,
2026-12-02): the surviving worker had finished its work and was waiting for
more, with all its credit granted, when ``/sessions`` was killed. The
successor sessions started from new child specs knew nothing of the open
connection, so they did not close it; the connection's credit had died with
the old incarnations; and an idle worker sends no more credit until a lease
ends. The daemon counted the worker as not connected, the worker waited for
leases, and every slot queued after that waited for a subscription that never
came. A session's start now closes any push connection of its worker attached
before it (`Services.push_conns`), so the worker reconnects and grants its
credit again.

Real parts: a daemon on uvicorn (127.0.0.1, its own data directory, since the
test kills its actors) or the embedded daemon, and an SDK worker over the
WebSocket or the in-process channel.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

import stepd

from .conftest import _net_daemon, serving, unique


@contextmanager
def _client(kind: str, path: Path) -> Iterator[stepd.Client]:
    if kind == "embedded":
        with stepd.embedded(path) as d:
            yield stepd.Client(d)
    else:
        with _net_daemon(path) as net, stepd.Client(net.url, trust_env=False) as client:
            yield client


@pytest.mark.parametrize("target", ["/sessions", "/sessions/{worker_id}"])
@pytest.mark.parametrize("kind", ["websocket", "embedded"])
def test_an_idle_worker_is_served_after_its_session_restarts(tmp_path: Path, kind: str,
                                                             target: str) -> None:
    name = unique("idle")

    def double(ctx: stepd.StepContext, input: Any) -> int:
        return int(input) * 2

    wf = stepd.Workflow(name).then(double)
    with _client(kind, tmp_path / "data") as client:
        options: dict[str, Any] = {"transport": "websocket"} if kind == "websocket" else {}
        worker = stepd.Worker(client, **options).register(wf)
        with serving(worker):
            # Served once: the worker is attached, its credit granted, and now idle.
            assert client.start(wf, input=1).result(timeout=20) == 2
            client.kill_actor(target.format(worker_id=worker.worker_id))
            # Work that arrives after the restart reaches the idle worker.
            assert client.start(wf, input=21).result(timeout=20) == 42
            assert worker.errors == []


def test_credit_the_session_cannot_take_closes_the_connection(tmp_path: Path) -> None:
    """A grant its session cannot take (gone, or its mailbox full) is not dropped in silence.

    The worker (one slot) holds a lease while its session actor is stopped for good
    (stopped, not killed: nothing restarts it, so no successor closes the connection).
    When the body ends, the worker grants its slot back; that credit has nowhere to
    go. Dropped, the worker would wait for leases no session offers it (the run
    below would never start); instead the daemon closes the connection, and the
    worker attaches again, to a new session, and is served.
    """
    name = unique("credit")
    release = threading.Event()

    def hold(ctx: stepd.StepContext, input: Any) -> int:
        if input == "hold":
            assert release.wait(20)
            return 0
        return int(input) * 2

    wf = stepd.Workflow(name).then(hold)
    with stepd.embedded(tmp_path / "data") as d:
        client = stepd.Client(d)
        worker = stepd.Worker(client, concurrency=1).register(wf)
        with serving(worker):
            held = client.start(wf, input="hold")
            deadline = time.monotonic() + 20
            while not d.daemon.live_leases() and time.monotonic() < deadline:
                time.sleep(0.01)
            assert d.daemon.live_leases() == 1
            path = f"/sessions/{worker.worker_id}"
            d.call_blocking(d.daemon.system.stop, path)
            release.set()  # the body ends: its slot's credit goes to a stopped session
            assert held.result(timeout=20) == 0
            assert client.start(wf, input=21).result(timeout=20) == 42
            assert worker.errors == []
