"""The Prometheus registry: exact text for fixed observations, and a parser check.

`parse_exposition` is a small, strict reader of the 0.0.4 text format (the
subset we emit): it refuses anything malformed, and reads back every sample,
so a rendering that Prometheus would reject fails here.
"""

from __future__ import annotations

import math
import re

import pytest

from stepd.transport.metrics import (
    COMMIT_BATCH_BUCKETS,
    CONTENT_TYPE,
    LATENCY_BUCKETS,
    Counter,
    Gauge,
    Histogram,
    Registry,
    daemon_metrics,
)

_SAMPLE = re.compile(
    r"(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)"
    r"(?:\{(?P<labels>.*)\})?"
    r" (?P<value>[+-]?(?:Inf|NaN|[0-9.eE+-]+))\Z"
)
_LABEL_PAIR = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\[\\"n])*)"(,|\Z)')

Labels = tuple[tuple[str, str], ...]


def _unescape(value: str) -> str:
    return re.sub(r"\\(.)", lambda m: {"n": "\n", "\\": "\\", '"': '"'}[m.group(1)], value)


def _labels(text: str) -> Labels:
    pairs: list[tuple[str, str]] = []
    pos = 0
    while pos < len(text):
        m = _LABEL_PAIR.match(text, pos)
        assert m is not None, f"bad labels at {text[pos:]!r}"
        pairs.append((m.group(1), _unescape(m.group(2))))
        pos = m.end()
    return tuple(pairs)


def parse_exposition(text: str) -> dict[str, dict[str, object]]:
    """name -> {"type", "help", "samples": {(sample name, labels): value}}.

    Checks: the text ends with a newline; every metric has HELP then TYPE
    before its samples; sample names belong to the metric declared last
    (``_bucket``/``_sum``/``_count`` for histograms); no sample twice;
    histogram buckets cumulative and ending at ``+Inf`` == ``_count``.
    """
    assert text == "" or text.endswith("\n")
    metrics: dict[str, dict[str, object]] = {}
    current: str | None = None
    for line in text.splitlines():
        assert line, "no blank lines"
        if line.startswith("# HELP "):
            name, _, help_text = line[7:].partition(" ")
            assert name not in metrics, f"{name} declared twice"
            metrics[name] = {"help": help_text, "type": None, "samples": {}}
            current = name
        elif line.startswith("# TYPE "):
            name, _, type_name = line[7:].partition(" ")
            assert name == current and metrics[name]["type"] is None
            assert type_name in ("counter", "gauge", "histogram", "summary", "untyped")
            metrics[name]["type"] = type_name
        else:
            assert not line.startswith("#")
            m = _SAMPLE.match(line)
            assert m is not None, f"bad sample line {line!r}"
            assert current is not None
            kind = metrics[current]["type"]
            sample_name = m.group("name")
            allowed = {current}
            if kind == "histogram":
                allowed = {current + s for s in ("_bucket", "_sum", "_count")}
            assert sample_name in allowed, (sample_name, current)
            samples = metrics[current]["samples"]
            assert isinstance(samples, dict)
            key = (sample_name, _labels(m.group("labels") or ""))
            assert key not in samples, f"duplicate sample {key}"
            samples[key] = float(m.group("value").replace("Inf", "inf"))
    for name, metric in metrics.items():
        if metric["type"] == "histogram":
            _check_histogram(name, metric["samples"])  # type: ignore[arg-type]
    return metrics


def _check_histogram(name: str, samples: dict[tuple[str, Labels], float]) -> None:
    series: dict[Labels, list[tuple[float, float]]] = {}
    for (sample_name, labels), value in samples.items():
        if sample_name == name + "_bucket":
            le = dict(labels)["le"]
            rest = tuple(p for p in labels if p[0] != "le")
            series.setdefault(rest, []).append((float(le.replace("Inf", "inf")), value))
    for rest, buckets in series.items():
        bounds = [b for b, _ in buckets]
        assert bounds == sorted(bounds) and bounds[-1] == math.inf
        counts = [c for _, c in buckets]
        assert counts == sorted(counts), "buckets must be cumulative"
        assert samples[(name + "_count", rest)] == counts[-1]
        assert (name + "_sum", rest) in samples


# --------------------------------------------------------------------------- exact output


def test_exact_rendering() -> None:
    reg = Registry()
    requests = reg.counter(
        "demo_requests_total", "Requests.\nSecond line \\ backslash.", ("route", "status")
    )
    temp = reg.gauge("demo_temperature", "A gauge.")
    lat = reg.histogram("demo_latency_seconds", "Latency.", buckets=(0.1, 1.0, 10.0))
    requests.labels("/a", "200").inc()
    requests.labels("/a", "200").inc(2)
    requests.labels('/b "q"\n\\', "500").inc()
    temp.set(21.5)
    temp.inc()
    temp.dec(0.5)
    for v in (0.05, 0.1, 0.5, 3.0, 100.0):
        lat.observe(v)
    assert reg.render() == (
        "# HELP demo_requests_total Requests.\\nSecond line \\\\ backslash.\n"
        "# TYPE demo_requests_total counter\n"
        'demo_requests_total{route="/a",status="200"} 3\n'
        'demo_requests_total{route="/b \\"q\\"\\n\\\\",status="500"} 1\n'
        "# HELP demo_temperature A gauge.\n"
        "# TYPE demo_temperature gauge\n"
        "demo_temperature 22\n"
        "# HELP demo_latency_seconds Latency.\n"
        "# TYPE demo_latency_seconds histogram\n"
        'demo_latency_seconds_bucket{le="0.1"} 2\n'  # 0.1 itself is in le=0.1
        'demo_latency_seconds_bucket{le="1.0"} 3\n'
        'demo_latency_seconds_bucket{le="10.0"} 4\n'
        'demo_latency_seconds_bucket{le="+Inf"} 5\n'
        "demo_latency_seconds_sum 103.65\n"
        "demo_latency_seconds_count 5\n"
    )
    parsed = parse_exposition(reg.render())
    samples = parsed["demo_requests_total"]["samples"]
    assert isinstance(samples, dict)
    assert samples[("demo_requests_total", (("route", '/b "q"\n\\'), ("status", "500")))] == 1


def test_labelled_histogram_and_special_values() -> None:
    reg = Registry()
    h = reg.histogram("h_seconds", "h", ("op",), buckets=(1, 2))
    h.labels("b").observe(5)
    h.labels("a").observe(1)
    g = reg.gauge("g", "g", ("k",))
    g.labels("inf").set(math.inf)
    g.labels("nan").set(math.nan)
    g.labels("neg").set(-math.inf)
    text = reg.render()
    assert text.splitlines()[2:] == [
        'h_seconds_bucket{op="a",le="1.0"} 1',
        'h_seconds_bucket{op="a",le="2.0"} 1',
        'h_seconds_bucket{op="a",le="+Inf"} 1',
        'h_seconds_sum{op="a"} 1',
        'h_seconds_count{op="a"} 1',
        'h_seconds_bucket{op="b",le="1.0"} 0',
        'h_seconds_bucket{op="b",le="2.0"} 0',
        'h_seconds_bucket{op="b",le="+Inf"} 1',
        'h_seconds_sum{op="b"} 5',
        'h_seconds_count{op="b"} 1',
        "# HELP g g",
        "# TYPE g gauge",
        'g{k="inf"} +Inf',
        'g{k="nan"} NaN',
        'g{k="neg"} -Inf',
    ]
    parse_exposition(text)


def test_gauge_functions_at_scrape_time() -> None:
    reg = Registry()
    counts = {"running": 2}
    by_status = reg.gauge(
        "runs", "runs", ("status",), function=lambda: {(s,): n for s, n in counts.items()}
    )
    plain = reg.gauge("x", "x")
    plain.set_function(lambda: 7)
    assert 'runs{status="running"} 2' in reg.render()
    counts["completed"] = 5
    text = reg.render()
    assert 'runs{status="completed"} 5' in text and "\nx 7\n" in text
    by_status.set_function(lambda: {"waiting": 1})  # a bare string for a one-label gauge
    assert 'runs{status="waiting"} 1' in reg.render()
    by_status.set_function(lambda: 3)
    with pytest.raises(TypeError):
        reg.render()
    by_status.set_function(lambda: {("a", "b"): 1})
    with pytest.raises(ValueError):
        reg.render()
    by_status.set_function(None)
    assert "runs{" not in reg.render()  # back to recorded series: none yet


def test_errors() -> None:
    reg = Registry()
    c = reg.counter("c_total", "c")
    with pytest.raises(ValueError):
        c.inc(-1)
    with pytest.raises(ValueError):
        reg.counter("c_total", "again")
    reg.histogram("lat", "l")
    with pytest.raises(ValueError):
        reg.counter("lat_count", "clashes with the histogram's _count")
    with pytest.raises(ValueError):
        Counter("bad name", "x")
    with pytest.raises(ValueError):
        Counter("ok", "x", ("__reserved",))
    with pytest.raises(ValueError):
        Counter("ok", "x", ("a", "a"))
    with pytest.raises(ValueError):
        Histogram("h", "h", ("le",))
    with pytest.raises(ValueError):
        Histogram("h", "h", buckets=(2, 1))
    with pytest.raises(ValueError):
        Histogram("h", "h", buckets=())
    labelled = Counter("l_total", "l", ("a",))
    with pytest.raises(ValueError):
        labelled.inc()  # labelled: use .labels()
    with pytest.raises(ValueError):
        labelled.labels("x", "y")
    with pytest.raises(ValueError):
        c.labels("x")
    assert Histogram("h", "h", buckets=(1, math.inf)).bounds == (1.0,)


def test_label_values_are_strings_whatever_was_passed() -> None:
    c = Counter("r_total", "r", ("status",))
    c.labels(200).inc()  # type: ignore[arg-type]
    c.labels("200").inc()
    c.labels(200).inc()  # type: ignore[arg-type]
    assert c.render_lines()[-1] == 'r_total{status="200"} 3'


def test_histogram_le_semantics_at_bounds() -> None:
    h = Histogram("b", "b", buckets=COMMIT_BATCH_BUCKETS)
    for n in (1, 2, 3, 4, 1024, 1025):
        h.observe(n)
    lines = dict(line.rsplit(" ", 1) for line in h.render_lines()[2:])
    assert lines['b_bucket{le="1.0"}'] == "1"
    assert lines['b_bucket{le="2.0"}'] == "2"
    assert lines['b_bucket{le="4.0"}'] == "4"
    assert lines['b_bucket{le="1024.0"}'] == "5"
    assert lines['b_bucket{le="+Inf"}'] == "6"
    assert [2.0**i for i in range(11)] == list(COMMIT_BATCH_BUCKETS)


def test_daemon_metrics_render_and_parse() -> None:
    reg = Registry()
    m = daemon_metrics(reg)
    m.runs_by_status.set_function(
        lambda: {(s,): i for i, s in enumerate(["running", "waiting", "completed"])}
    )
    m.live_leases.set(3)
    m.waiting_claims.inc()
    m.connected_workers.set(2)
    m.step_schedule_to_start_seconds.observe(0.0004)
    m.run_to_complete_seconds.observe(42.0)
    m.commit_batch_size.observe(8)
    m.requests_total.labels("/v1/api/runs/{run}", "200").inc()
    parsed = parse_exposition(reg.render())
    assert {name: metric["type"] for name, metric in parsed.items()} == {
        "stepd_runs": "gauge",
        "stepd_live_leases": "gauge",
        "stepd_waiting_claims": "gauge",
        "stepd_connected_workers": "gauge",
        "stepd_worker_sticky_cache": "gauge",
        "stepd_step_schedule_to_start_seconds": "histogram",
        "stepd_run_to_complete_seconds": "histogram",
        "stepd_commit_batch_size": "histogram",
        "stepd_http_requests_total": "counter",
    }
    sched = parsed["stepd_step_schedule_to_start_seconds"]["samples"]
    assert isinstance(sched, dict)
    assert sched[("stepd_step_schedule_to_start_seconds_bucket", (("le", "0.0005"),))] == 1
    assert sched[("stepd_step_schedule_to_start_seconds_bucket", (("le", "0.00025"),))] == 0
    assert len([k for k in sched if k[0].endswith("_bucket")]) == len(LATENCY_BUCKETS) + 1
    assert CONTENT_TYPE == "text/plain; version=0.0.4; charset=utf-8"
    with pytest.raises(ValueError):
        daemon_metrics(reg)  # one set per registry


def test_recording_is_cheap() -> None:
    """Not a benchmark: a guard that observe/inc stay O(1)-ish (no per-call allocation of series)."""
    reg = Registry()
    m = daemon_metrics(reg)
    child = m.requests_total.labels("/healthz", "200")
    for _ in range(10_000):
        m.requests_total.labels("/healthz", "200").inc()
        m.step_schedule_to_start_seconds.observe(0.001)
    assert child.value == 10_000
    assert len(m.requests_total._children) == 1


def test_empty_registry_renders_empty() -> None:
    assert Registry().render() == ""
    g = Gauge("only_help", "h", ("a",))
    assert g.render_lines() == ["# HELP only_help h", "# TYPE only_help gauge"]
