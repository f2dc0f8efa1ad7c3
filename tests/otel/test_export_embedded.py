"""``stepd.embedded(path, otlp_endpoint=...)``, and the worker continuing the daemon's trace.

The application here has an OpenTelemetry tracer of its own (an SDK
``TracerProvider`` sending OTLP/HTTP to the same receiver): the spans it
makes inside a step body must land in the daemon's trace, children of the
step attempt's span, or of the ``ctx.span`` they were made in.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

import stepd
from bench._otlp_sink import otlp_sink
from stepd.sansio.trace import run_span_id
from tests.cli._serve import ROOT, clean_env
from tests.sdk.conftest import serving, unique

pytestmark = pytest.mark.timeout(90)


def test_embedded_export_and_the_application_spans_join_the_daemons_trace(
        tmp_path: Path) -> None:
    name = unique("otel-embedded")
    seen: dict[str, dict[str, Any]] = {}
    with otlp_sink() as sink:
        provider = TracerProvider(resource=Resource({"service.name": "the-app"}))
        provider.add_span_processor(BatchSpanProcessor(
            OTLPSpanExporter(endpoint=f"{sink.url}/v1/traces")))
        tracer = provider.get_tracer("the-app")

        async def fetch(ctx: stepd.StepContext) -> str:
            seen["fetch"] = {"trace_id": ctx.trace_id, "span_id": ctx.span_id}
            with tracer.start_as_current_span("app.fetch"):
                return "fetched"

        def think(ctx: stepd.StepContext) -> str:  # a sync body: runs on a worker thread
            seen["think"] = {"trace_id": ctx.trace_id, "span_id": ctx.span_id}
            with tracer.start_as_current_span("app.prepare"):
                pass
            with ctx.span("llm.call") as call:
                seen["llm.call"] = {"span_id": call.span_id}
                with tracer.start_as_current_span("http.post"):
                    call.set_usage(model="m", input_tokens=3, output_tokens=4)
            return "thought"

        workflow = stepd.Workflow(name).then(fetch).then(think)
        try:
            with stepd.embedded(tmp_path / "data", otlp_endpoint=sink.url) as daemon:
                client = stepd.Client(daemon)
                worker = stepd.Worker(daemon, name="embedded-worker")
                worker.register(workflow)
                with serving(worker):
                    run = client.start(name, None)
                    assert run.result(timeout=30) == "thought"
            # Leaving the daemon sent its spans; the application flushes its own.
            assert provider.force_flush(10_000)
        finally:
            provider.shutdown()
        spans = {s.name: s for s in sink.snapshot()}

    trace_id = seen["fetch"]["trace_id"]
    assert seen["think"]["trace_id"] == trace_id
    root = spans[f"run {name}"]
    assert root.trace_id == trace_id and root.span_id == run_span_id(run.run_id)
    assert root.resource["service.name"] == "stepd"
    step_fetch, step_think = spans["step fetch"], spans["step think"]
    assert step_fetch.span_id == seen["fetch"]["span_id"]
    assert step_think.span_id == seen["think"]["span_id"]
    assert step_fetch.parent_span_id == step_think.parent_span_id == root.span_id
    assert step_think.attributes["stepd.worker_name"] == "embedded-worker"
    # The application's spans: the daemon's trace id, parented by the attempt or body span.
    app_fetch, app_prepare, http_post = spans["app.fetch"], spans["app.prepare"], spans["http.post"]
    assert {app_fetch.trace_id, app_prepare.trace_id, http_post.trace_id} == {trace_id}
    assert app_fetch.resource["service.name"] == "the-app"
    assert app_fetch.parent_span_id == step_fetch.span_id
    assert app_prepare.parent_span_id == step_think.span_id
    llm = spans["llm.call"]
    assert llm.span_id == seen["llm.call"]["span_id"] and llm.parent_span_id == step_think.span_id
    assert http_post.parent_span_id == llm.span_id
    assert llm.attributes["gen_ai.usage.output_tokens"] == 4


NO_IMPORT = """
import sys, threading
import stepd
from stepd.sansio.run import trace_id_for

def body(ctx):
    return ctx.trace_id == trace_id_for(ctx.run_id)

with stepd.embedded(sys.argv[1]) as daemon:
    client = stepd.Client(daemon)
    worker = stepd.Worker(daemon)
    worker.register(stepd.Workflow("w").then(body))
    thread = threading.Thread(target=worker.serve)
    thread.start()
    assert worker.wait_ready(20)
    print(client.start("w", None).result(timeout=20))
    worker.stop()
    thread.join(20)
print(sorted(m for m in sys.modules if m.startswith("opentelemetry") or m == "stepd._otel_spans"))
"""


def test_without_an_endpoint_nothing_of_opentelemetry_is_imported(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-c", NO_IMPORT, str(tmp_path / "data")],
                          check=False, capture_output=True, text=True, timeout=60, env=clean_env(),
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:2] == ["True", "[]"]


def test_a_local_step_is_a_span_under_its_parent_with_its_body_spans_beneath(
        tmp_path: Path) -> None:
    """docs/affinity.md "Local steps": a local step ran with no lease of its own; the
    export shows it as a span under the parent's attempt, and its body's spans (and the
    application's) under it."""
    name = unique("otel-local")
    with otlp_sink() as sink:
        provider = TracerProvider(resource=Resource({"service.name": "the-app"}))
        provider.add_span_processor(BatchSpanProcessor(
            OTLPSpanExporter(endpoint=f"{sink.url}/v1/traces")))
        tracer = provider.get_tracer("the-app")

        def ask(ctx: stepd.StepContext) -> str:
            return "asked"

        def summarise(ctx: stepd.StepContext) -> str:
            with ctx.span("llm.summary") as call, tracer.start_as_current_span("app.summary"):
                call.set_usage(model="m", input_tokens=11, output_tokens=2)
            return "summary"

        workflow = stepd.Workflow(name).then(ask).then(summarise, local=True)
        try:
            with stepd.embedded(tmp_path / "data", otlp_endpoint=sink.url) as daemon:
                client = stepd.Client(daemon)
                worker = stepd.Worker(daemon, local_steps=True).register(workflow)
                with serving(worker):
                    run = client.start(name, None)
                    assert run.result(timeout=30) == "summary"
            assert provider.force_flush(10_000)
        finally:
            provider.shutdown()
        spans = {s.name: s for s in sink.snapshot()}

    root, ask_span, local = spans[f"run {name}"], spans["step ask"], spans["step summarise"]
    assert ask_span.parent_span_id == root.span_id
    assert local.parent_span_id == ask_span.span_id
    assert local.attributes["stepd.execution_mode"] == "local"
    assert local.attributes["gen_ai.usage.input_tokens"] == 11
    assert spans["llm.summary"].parent_span_id == local.span_id
    assert spans["app.summary"].parent_span_id == spans["llm.summary"].span_id
    assert root.attributes["gen_ai.usage.input_tokens"] == 11
