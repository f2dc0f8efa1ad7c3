"""An SDK worker over HTTP long-poll spends one request a step, not two
(docs/leases.md "The next lease in the answer"): each ``complete`` asks for the
worker's next lease (``claim_next``) and the run's next step comes back in its
answer, so the worker claims only for a run's first step. Counted from the
daemon's own ``stepd_http_requests_total``, on a real daemon (uvicorn,
127.0.0.1) with a real SDK worker.
"""

from __future__ import annotations

from typing import Any

import httpx

import stepd

from .conftest import NetDaemon, serving, unique

STEPS = 10
RUNS = 3


def _requests(url: str, route: str) -> int:
    """``stepd_http_requests_total{route=<route>, status="200"}`` from ``/metrics``."""
    series = f'stepd_http_requests_total{{route="{route}",status="200"}} '
    for line in httpx.get(f"{url}/metrics", trust_env=False).text.splitlines():
        if line.startswith(series):
            return int(float(line[len(series):]))
    return 0


def test_an_http_worker_gets_the_next_step_in_its_complete(net: NetDaemon) -> None:
    def add(ctx: stepd.StepContext, input: Any) -> int:
        return int(input or 0) + 1

    wf = stepd.Workflow(unique("next"))
    for i in range(STEPS):
        wf.then(add, id=f"s{i}", input="${input}" if i == 0 else f"${{steps.s{i - 1}}}")
    with stepd.Client(net.url, trust_env=False) as client:
        worker = stepd.Worker(net.url, transport="http").register(wf)
        with serving(worker):
            assert worker.transport == "http"
            assert client.start(wf, input=0).result(timeout=20) == STEPS  # warmed up
            claims = _requests(net.url, "/v1/api/steps/claim")
            completes = _requests(net.url, "/v1/api/steps/{lease}/complete")
            for _ in range(RUNS):
                assert client.start(wf, input=0).result(timeout=20) == STEPS
            claims = _requests(net.url, "/v1/api/steps/claim") - claims
            completes = _requests(net.url, "/v1/api/steps/{lease}/complete") - completes
            assert worker.errors == []
    assert completes == RUNS * STEPS
    # Without the next lease in the answer every step is a claim's answer and a new
    # claim (RUNS * STEPS); with it, a run's first step (and the rare step that met
    # its worker's session busy, docs/leases.md) is.
    assert claims < RUNS * STEPS // 2, (claims, completes)
