"""`stepd._otlp_proto`: the request the export child encodes itself is the one the SDK makes.

Both are decoded with opentelemetry-proto and compared as messages, field
by field; then both ways of sending (`stepd._otel_child.sender`, direct and
through SDK spans) are run against a real OTLP/HTTP receiver on 127.0.0.1.
"""

from __future__ import annotations

import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from bench._otlp_sink import otlp_sink
from stepd import __version__
from stepd._otel_child import sender
from stepd._otel_spans import Converter
from stepd._otlp_proto import encode_request, encode_scope
from stepd.sansio.trace import SpanData, TraceBuilder, run_span_id, span_attributes

pytestmark = pytest.mark.timeout(60)

TRACE = "0af7651916cd43dd8448eb211c80319c"


def spans() -> list[SpanData]:
    """Every shape the builder makes: root with a link and an error, an attempt with an
    event, a body span with list, float, bool, negative and JSON-text attributes."""
    root = SpanData(TRACE, run_span_id("r_1"), None, "run wf", 1_000, 1_250,
                    span_attributes({"stepd.run_id": "r_1", "stepd.status": "failed",
                                     "gen_ai.usage.input_tokens": 1_200, "stepd.cost_usd": 0.25,
                                     "stepd.error_reason": "budget"}),
                    error="budget: over the limit",
                    links=(("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"),))
    attempt = SpanData(TRACE, "b7ad6b7169203331", run_span_id("r_1"), "step s0[3]", 1_010,
                       1_200, span_attributes({"stepd.attempt": 2, "stepd.item_index": 3,
                                               "stepd.started": True, "stepd.outcome": "lost"}),
                       events=(("started", 1_020, {}),))
    body = SpanData(TRACE, "00f067aa0ba902b7", "b7ad6b7169203331", "llm.call — ünïcode",
                    1_050, 1_050, span_attributes({
                        "tags": ["a", "b"], "scores": [0.5, 1.5], "flags": [True, False],
                        "delta": -7, "nested": {"k": [1, "x"]}, "mixed": [1, "a"],
                        "empty": "", "skipped": None}))
    return [root, attempt, body]


def test_the_direct_request_decodes_to_what_the_sdk_encodes() -> None:
    convert = Converter()
    sdk = encode_spans(convert.spans(spans()))
    scope = encode_scope("stepd", __version__)
    direct = ExportTraceServiceRequest.FromString(encode_request(
        dict(convert.resource.attributes), scope, spans(), convert.resource.schema_url or ""))
    assert direct == sdk
    assert len(direct.resource_spans[0].scope_spans[0].spans) == 3


def test_an_integer_past_64_bits_is_sent_as_its_digits() -> None:
    span = SpanData(TRACE, "b7ad6b7169203331", None, "big", 1, 2, {"n": 1 << 70})
    decoded = ExportTraceServiceRequest.FromString(encode_request({}, b"", [span]))
    [kv] = decoded.resource_spans[0].scope_spans[0].spans[0].attributes
    assert (kv.key, kv.value.string_value) == ("n", str(1 << 70))


def test_both_ways_of_sending_deliver_the_same_spans() -> None:
    """Direct (the exporter's client) and through SDK spans (the exporter's ``export``)."""
    builder = TraceBuilder()
    made = builder.feed("r_9", {"workflow": "wf", "created_at": 1_000, "hash": "h"},
                        [{"seq": 3, "type": "run_completed", "at": 1_005}])
    got = []
    for direct in (True, False):
        with otlp_sink() as sink:
            exporter = OTLPSpanExporter(endpoint=sink.url + "/v1/traces")
            try:
                assert sender(exporter, direct=direct)([*spans(), *made])
            finally:
                exporter.shutdown()  # type: ignore[no-untyped-call]
            got.append(sorted(sink.snapshot(), key=lambda s: s.span_id))
    assert len(got[0]) == 4
    assert got[0] == got[1]
