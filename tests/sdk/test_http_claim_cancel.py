"""An SDK worker over HTTP long-poll, stopped while its claim is parked at the daemon:
on asyncio the claim is cut short through the pump's own task (no cancel scope per
claim, `stepd.channels.http.HttpChannel`), on trio through a cancel scope. Either
way ``serve()`` returns promptly, the daemon sees the claim abandoned (its
``stepd_waiting_claims`` falls back to 0), and a run started afterwards is served
by the next worker. A real daemon (uvicorn, 127.0.0.1), real SDK workers.
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest

import stepd

from .conftest import NetDaemon, serving, unique


def _waiting_claims(url: str) -> int:
    for line in httpx.get(f"{url}/metrics", trust_env=False).text.splitlines():
        if line.startswith("stepd_waiting_claims "):
            return int(float(line.split()[1]))
    return 0


def _until(check: Any, what: str) -> None:
    deadline = time.monotonic() + 10
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_stop_cuts_a_parked_claim_short(net: NetDaemon, backend: str) -> None:
    def add(ctx: stepd.StepContext, input: Any) -> int:
        return int(input or 0) + 1

    wf = stepd.Workflow(unique("park")).then(add, id="s0")
    worker = stepd.Worker(net.url, transport="http").register(wf)
    with serving(worker, backend=backend):
        assert worker.transport == "http"
        _until(lambda: _waiting_claims(net.url) >= 1, "the worker's claim is not parked")
        stopped_at = time.monotonic()
    # `serving` returned: serve() ended after the stop (it joins the thread).
    assert time.monotonic() - stopped_at < 5
    assert worker.errors == []
    _until(lambda: _waiting_claims(net.url) == 0, "the abandoned claim is still parked")
    again = stepd.Worker(net.url, transport="http").register(wf)
    with stepd.Client(net.url, trust_env=False) as client, serving(again, backend=backend):
        assert client.start(wf, input=1).result(timeout=20) == 2
