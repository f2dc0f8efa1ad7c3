"""`stepd.otel.SpanExport`: the hand-off from the event loop never waits; a full queue drops
and counts; a collector that is down costs failed spans, not a stuck daemon."""

from __future__ import annotations

import os
import signal
import socket
from typing import Any

import pytest

from bench._otlp_sink import otlp_sink
from stepd.actors.daemon.store import RunWrite
from stepd.otel import SpanExport, traces_url
from stepd.sansio.errors import Invalid

from ..daemon.helpers import eventually

pytestmark = pytest.mark.timeout(60)


def finished_run(i: int) -> RunWrite:
    """A committed write that ends run ``r_i`` (one span: the run's)."""
    record: dict[str, Any] = {"run_id": f"r_{i}", "workflow": "wf", "created_at": 1_000,
                              "hash": "h", "parent": None}
    return RunWrite(run_id=f"r_{i}", record=record,
                    journal=[{"seq": 2, "type": "run_completed", "at": 1_005, "result": i}])


def test_a_full_queue_drops_and_counts_and_what_was_queued_is_sent() -> None:
    with otlp_sink() as sink:
        export = SpanExport(sink.url, max_queue=3)  # not started: nothing drains yet
        for i in range(5):
            export.committed(finished_run(i))
        stats = export.statistics()
        assert (stats.queued, stats.dropped, stats.exported) == (3, 2, 0)
        export.start()
        export.close()
        assert export.statistics().exported == 3
        assert sorted(s.attributes["stepd.run_id"] for s in sink.snapshot()) == [
            "r_0", "r_1", "r_2"]


def test_a_collector_that_hangs_fails_spans_and_never_holds_the_hand_off(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A collector that accepts and never answers: the export child waits (up to the
    exporter's timeout), the hand-off does not: the queue (the writes the child has not read)
    fills, then drops and counts."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "1")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "10")
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        server.settimeout(20)
        export = SpanExport(f"http://127.0.0.1:{server.getsockname()[1]}", max_queue=2)
        export.start()
        try:
            export.committed(finished_run(0))
            conn, _ = server.accept()  # the child is inside its request now
            with conn:
                for i in range(1, 6):
                    export.committed(finished_run(i))
                stats = export.statistics()
                assert (stats.queued, stats.dropped) == (2, 3)
        finally:
            export.close()
    stats = export.statistics()
    assert stats.exported == 0 and stats.failed >= 1 and stats.queued == 0


def test_the_endpoint_must_be_an_http_url() -> None:
    assert traces_url("http://127.0.0.1:4318") == "http://127.0.0.1:4318/v1/traces"
    assert traces_url("https://c.example/") == "https://c.example/v1/traces"
    assert traces_url("http://c:4318/custom/path") == "http://c:4318/custom/path"
    for bad in ("c:4318", "ftp://c/", "http://", ""):
        with pytest.raises(Invalid) as err:
            traces_url(bad)
        assert err.value.field == "otlp_endpoint"


def test_a_bad_batch_setting_is_refused_naming_the_variable(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "soon")
    with pytest.raises(Invalid) as err:
        SpanExport("http://127.0.0.1:4318")
    assert err.value.field == "OTEL_BSP_SCHEDULE_DELAY"


def test_the_standard_exporter_variables_apply(monkeypatch: pytest.MonkeyPatch) -> None:
    """Headers and compression from ``OTEL_EXPORTER_OTLP_*`` reach the collector."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_HEADERS", "x-tenant=stepd-tests")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_COMPRESSION", "gzip")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "orchestrator")
    with otlp_sink() as sink:
        export = SpanExport(sink.url)
        export.start()
        export.committed(finished_run(7))
        export.close()
        [span] = sink.snapshot()
        [headers] = sink.headers
    assert headers["x-tenant"] == "stepd-tests"
    assert headers["content-encoding"] == "gzip"
    assert span.resource["service.name"] == "orchestrator"
    assert span.attributes["stepd.run_id"] == "r_7"


def test_on_an_event_loop_a_turn_of_writes_goes_down_the_pipe_in_one_write(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The period's first write arms one timer; 1,000 writes handed over meanwhile cross in
    one ``os.write`` when it fires, and every span arrives."""
    import asyncio

    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "10")
    writes_down: list[int] = []
    real_write = os.write

    def counted_write(fd: int, data: Any) -> int:
        n = real_write(fd, data)
        writes_down.append(n)
        return n

    monkeypatch.setattr(os, "write", counted_write)  # the export calls os.write; counted

    async def main(url: str) -> SpanExport:
        export = SpanExport(url)
        export.start()
        for i in range(1_000):
            export.committed(finished_run(i))
        assert writes_down == []  # nothing yet: the timer has not fired
        await eventually(lambda: writes_down, what="the timer's flush")  # FLUSH_S after the first
        assert len(writes_down) == 1 and export.statistics().dropped == 0
        export.stop()
        await asyncio.to_thread(export.close)
        return export

    with otlp_sink() as sink:
        export = asyncio.run(main(sink.url))
        assert export.statistics().exported == 1_000
        assert len(sink.snapshot()) == 1_000


def test_a_child_that_died_costs_counted_drops_and_never_an_exception() -> None:
    export = SpanExport("http://127.0.0.1:9")  # nothing listens: it never gets that far
    export.start()
    assert export._proc is not None
    os.kill(export._proc.pid, signal.SIGKILL)
    export._proc.wait()
    for i in range(5):
        export.committed(finished_run(i))  # outside an event loop: each is written at once
    stats = export.statistics()
    assert (stats.queued, stats.dropped, stats.exported) == (0, 5, 0)
    export.close()
    assert export.statistics().dropped == 5


def test_a_write_larger_than_the_pipe_crosses_whole_in_pieces() -> None:
    """A step output of 3 MiB (three pipes' worth): each period's write takes what the pipe
    holds, the rest waits packed, and the child reads on until the write is whole."""
    import asyncio

    big = finished_run(1)
    big.journal.insert(0, {"seq": 1, "type": "step_completed", "at": 1_004, "step_id": "s",
                           "attempt": 1, "fence": 1, "lease_id": "l_1", "worker_id": "w",
                           "output": "x" * (3 << 20)})

    async def main(url: str) -> SpanExport:
        export = SpanExport(url)
        export.start()
        export.committed(big)
        export.committed(finished_run(2))
        # r_1's run and attempt, r_2's run
        await eventually(lambda: export.statistics().exported == 3, what="three spans exported")
        assert export.statistics().dropped == 0
        export.stop()
        await asyncio.to_thread(export.close)
        return export

    with otlp_sink() as sink:
        export = asyncio.run(main(sink.url))
        assert export.statistics().exported == 3
        assert sorted(s.attributes["stepd.run_id"] for s in sink.snapshot()) == [
            "r_1", "r_1", "r_2"]
