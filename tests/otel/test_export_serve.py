"""``stepd serve --otlp-endpoint``: spans reach a real OTLP/HTTP receiver on 127.0.0.1.

The daemon is a ``python -m stepd serve`` subprocess, the worker a `stepd.Worker`
over the WebSocket, the receiver `bench._otlp_sink` (it decodes the protobuf
``ExportTraceServiceRequest`` as a collector would). Stopping the daemon with
SIGTERM sends what is queued, so the spans are all there once it has exited.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

import stepd
from bench._otlp_sink import ReceivedSpan, otlp_sink
from stepd.sansio.trace import run_span_id
from tests.cli._serve import serve_process
from tests.sdk.conftest import PRICES_TOML, serving, unique

pytestmark = pytest.mark.timeout(90)

_seen: dict[str, list[dict[str, Any]]] = {}
_lock = threading.Lock()


def _note(ctx: stepd.StepContext) -> None:
    with _lock:
        _seen.setdefault(ctx.run_id, []).append(
            {"step": ctx.step_id, "attempt": ctx.attempt, "trace_id": ctx.trace_id,
             "span_id": ctx.span_id, "lease_id": ctx.lease_id})


def ask(ctx: stepd.StepContext, input: Any) -> str:
    _note(ctx)
    with ctx.span("agent.turn", turn=1) as turn:
        with ctx.span("llm.call", model="m") as call:
            call.set_usage(model="m", input_tokens=1_000, output_tokens=500)
        turn.set_attribute("tools", ["search", "read"])
    return "asked"


def flaky(ctx: stepd.StepContext, input: Any) -> str:
    _note(ctx)
    if ctx.attempt == 1:
        raise stepd.Retryable("not yet")
    return "done"


def test_serve_exports_the_run_its_attempts_and_the_body_spans(tmp_path: Path) -> None:
    prices = tmp_path / "prices.toml"
    prices.write_text(PRICES_TOML)
    name = unique("otel")
    workflow = (stepd.Workflow(name, version="v1").then(ask)
                .then(flaky, retry=stepd.Retry(max_attempts=3, initial_backoff=0)))
    with otlp_sink() as sink:
        daemon = serve_process(tmp_path / "data", "--otlp-endpoint", sink.url,
                               "--prices", str(prices))
        try:
            worker = stepd.Worker(daemon.url, name="otel-worker")
            worker.register(workflow)
            with stepd.Client(daemon.url) as client, serving(worker):
                run = client.start(name, {"n": 1}, correlation="ticket-7")
                assert run.result(timeout=30) == "done"
                worker_id = worker.worker_id
            metrics = httpx.get(f"{daemon.url}/metrics", trust_env=False, timeout=10).text
            assert 'stepd_otel_export{what="dropped"} 0' in metrics
            assert 'stepd_otel_export{what="exported"}' in metrics
        finally:
            assert daemon.stop() == 0, daemon.stderr()
        spans = sink.snapshot()

    mine = [s for s in spans if s.attributes.get("stepd.run_id") == run.run_id
            or s.name in ("agent.turn", "llm.call")]
    names = sorted(s.name for s in mine)
    assert names == ["agent.turn", "llm.call", f"run {name}", "step ask", "step flaky",
                     "step flaky"], names
    notes = _seen[run.run_id]
    trace_id = notes[0]["trace_id"]
    assert {s.trace_id for s in mine} == {trace_id}  # the trace id every lease carried

    [root] = [s for s in mine if s.name.startswith("run ")]
    assert root.span_id == run_span_id(run.run_id) and root.parent_span_id is None
    assert root.attributes["stepd.workflow"] == name
    assert root.attributes["stepd.version"] == "v1"
    assert root.attributes["stepd.status"] == "completed"
    assert root.attributes["stepd.correlation"] == "ticket-7"
    assert root.attributes["gen_ai.usage.input_tokens"] == 1_000
    assert root.attributes["gen_ai.usage.output_tokens"] == 500
    assert root.attributes["stepd.cost_usd"] == pytest.approx(0.002)  # 1000 x 1 + 500 x 2 per M
    assert root.resource["service.name"] == "stepd" and root.scope == "stepd"

    attempts = {(s.attributes["stepd.step_id"], s.attributes["stepd.attempt"]): s
                for s in mine if s.name.startswith("step ")}
    for note in notes:
        span = attempts[(note["step"], note["attempt"])]
        assert span.span_id == note["span_id"]  # the span id the worker's lease carried
        assert span.parent_span_id == root.span_id
        assert span.attributes["stepd.lease_id"] == note["lease_id"]
        assert span.attributes["stepd.worker_id"] == worker_id
        assert span.attributes["stepd.worker_name"] == "otel-worker"
        assert span.attributes["stepd.delivery"] == "at_least_once"
        assert isinstance(span.attributes["stepd.fence"], int)
        assert root.start_ns <= span.start_ns <= span.end_ns <= root.end_ns
    assert attempts[("flaky", 1)].attributes["stepd.outcome"] == "failed"
    assert attempts[("flaky", 1)].attributes["stepd.error_class"] == "retryable"
    assert attempts[("flaky", 1)].status_code == 2  # ERROR
    assert "not yet" in attempts[("flaky", 1)].status_message
    assert attempts[("flaky", 2)].attributes["stepd.outcome"] == "completed"
    assert attempts[("flaky", 2)].attributes["stepd.fence"] > \
        attempts[("flaky", 1)].attributes["stepd.fence"]
    ask_span = attempts[("ask", 1)]
    assert ask_span.attributes["gen_ai.usage.input_tokens"] == 1_000
    assert ask_span.attributes["stepd.cost_usd"] == pytest.approx(0.002)
    assert [e[0] for e in ask_span.events] == ["started"]

    by_name: dict[str, ReceivedSpan] = {s.name: s for s in mine}
    turn, call = by_name["agent.turn"], by_name["llm.call"]
    assert turn.parent_span_id == ask_span.span_id
    assert call.parent_span_id == turn.span_id
    assert turn.attributes["turn"] == 1 and turn.attributes["tools"] == ["search", "read"]
    assert call.attributes["gen_ai.request.model"] == "m"
    assert call.attributes["gen_ai.usage.input_tokens"] == 1_000
    assert call.attributes["gen_ai.usage.output_tokens"] == 500
    assert call.attributes["stepd.cost_usd"] == pytest.approx(0.002)
    assert ask_span.start_ns <= turn.start_ns <= call.start_ns <= call.end_ns <= turn.end_ns


def test_serve_without_the_extra_names_what_to_install(tmp_path: Path) -> None:
    """The flag with OpenTelemetry missing: one line naming the extra, exit status 2."""
    import subprocess
    import sys

    from tests.cli._serve import ROOT, clean_env

    program = ("import sys\n"
               "sys.modules['opentelemetry'] = None  # as if the extra were not installed\n"
               "from stepd.cli import main\n"
               "main(['serve', '--data', sys.argv[1], '--port', '0', "
               "'--otlp-endpoint', 'http://127.0.0.1:4318'])\n")
    proc = subprocess.run([sys.executable, "-c", program, str(tmp_path / "data")],
                          check=False, capture_output=True, text=True, timeout=60, env=clean_env(),
                          cwd=ROOT)
    assert proc.returncode == 2, proc.stderr
    assert "pip install 'stepd[otel]'" in proc.stderr
    assert "otlp_endpoint" in proc.stderr
    assert "listening" not in proc.stdout


def test_a_bad_endpoint_is_refused_naming_the_flag(tmp_path: Path) -> None:
    import subprocess
    import sys

    from tests.cli._serve import ROOT, clean_env

    proc = subprocess.run([sys.executable, "-m", "stepd", "serve", "--data", str(tmp_path / "d"),
                           "--port", "0", "--otlp-endpoint", "collector:4318"],
                          check=False, capture_output=True, text=True, timeout=60, env=clean_env(),
                          cwd=ROOT)
    assert proc.returncode == 2, proc.stderr
    assert "otlp_endpoint" in proc.stderr and "http://" in proc.stderr
