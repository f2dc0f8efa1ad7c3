"""Prometheus metrics without a dependency: counters, gauges, histograms, text format 0.0.4.

``GET /metrics`` answers `Registry.render()` with `CONTENT_TYPE`. Recording
runs on the hot path (every request, every commit, every step start), so it is
kept to what it must be: a labelled child is found with one dict lookup
(`Counter.labels`), ``inc`` is one add, a histogram ``observe`` is one bisect
and two adds. Everything else (cumulative buckets, ``_count``, sorting, label
escaping, callbacks) happens at scrape time.

Threading: recording is meant for the event loop thread. ``x += 1`` on a Python
attribute is not atomic across threads, so a value recorded from another thread
could, rarely, lose an update; hand such values to the loop instead
(``call_soon_threadsafe``) rather than paying for a lock on every record.

`daemon_metrics` declares the daemon's metric set (docs/http-api.md "Metrics").
"""

from __future__ import annotations

import dataclasses
import math
import re
from bisect import bisect_left
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Generic, TypeVar

__all__ = [
    "COMMIT_BATCH_BUCKETS",
    "CONTENT_TYPE",
    "LATENCY_BUCKETS",
    "RUN_DURATION_BUCKETS",
    "Counter",
    "DaemonMetrics",
    "Gauge",
    "Histogram",
    "Registry",
    "daemon_metrics",
]

CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"
"""The ``Content-Type`` of `Registry.render`'s output."""

LATENCY_BUCKETS: Final = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
"""Seconds, 100 µs to 10 s: request and schedule-to-start latencies (the targets are sub-ms)."""

RUN_DURATION_BUCKETS: Final = (
    0.001,
    0.01,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    300.0,
    900.0,
    3600.0,
    21600.0,
    86400.0,
)
"""Seconds, 1 ms to a day: whole runs include waits and sleeps, so they need a longer range."""

COMMIT_BATCH_BUCKETS: Final = tuple(float(2**i) for i in range(11))
"""Requests per commit: 1, 2, 4, ... 1024 (the storage's default ``max_batch``)."""

_NAME: Final = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*\Z")
_LABEL: Final = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*\Z")

Number = int | float


def _format_value(value: Number) -> str:
    """A sample value: integers as integers, floats shortest round-trip, +Inf/-Inf/NaN."""
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(value)


def _format_le(bound: float) -> str:
    """A bucket bound, as Prometheus' own clients write it (``1.0``, ``0.0001``, ``+Inf``)."""
    if math.isinf(bound):
        return "+Inf"
    return repr(float(bound))


def _escape_label_value(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _label_text(names: Sequence[str], values: Sequence[str], extra: str = "") -> str:
    parts = [f'{n}="{_escape_label_value(v)}"' for n, v in zip(names, values, strict=True)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


# --------------------------------------------------------------------------- children


class CounterChild:
    """One labelled series of a `Counter`."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value: Number = 0

    def inc(self, amount: Number = 1) -> None:
        """Add ``amount`` (>= 0: a counter only goes up).

        Raises:
            ValueError: ``amount`` is negative.
        """
        if amount < 0:
            raise ValueError(f"a counter only goes up; got inc({amount})")
        self.value += amount


class GaugeChild:
    """One labelled series of a `Gauge`."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value: Number = 0

    def set(self, value: Number) -> None:
        self.value = value

    def inc(self, amount: Number = 1) -> None:
        self.value += amount

    def dec(self, amount: Number = 1) -> None:
        self.value -= amount


class HistogramChild:
    """One labelled series of a `Histogram`: per-bucket counts (not cumulative) and a sum."""

    __slots__ = ("_bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last slot is +Inf
        self.sum: float = 0.0

    def observe(self, value: float) -> None:
        """Record one observation: a bisect and two adds.

        ``bisect_left`` puts ``value`` in the first bucket whose bound is >= it,
        which is Prometheus' ``le`` (less than or equal) semantics.
        """
        self.counts[bisect_left(self._bounds, value)] += 1
        self.sum += value


_Child = TypeVar("_Child", CounterChild, GaugeChild, HistogramChild)


# --------------------------------------------------------------------------- metrics


class _Metric(Generic[_Child]):
    """Name, help, label names, and the children by label values."""

    type_name: str = ""

    def __init__(self, name: str, help: str, labelnames: Sequence[str] = ()) -> None:
        if _NAME.match(name) is None:
            raise ValueError(f"bad metric name {name!r}")
        for label in labelnames:
            if _LABEL.match(label) is None or label.startswith("__"):
                raise ValueError(f"bad label name {label!r} for metric {name!r}")
        if len(set(labelnames)) != len(labelnames):
            raise ValueError(f"duplicate label names for metric {name!r}: {labelnames}")
        self.name = name
        self.help = help
        self.labelnames: tuple[str, ...] = tuple(labelnames)
        self._children: dict[tuple[str, ...], _Child] = {}
        self._default: _Child | None = None if labelnames else self._new_child()
        if self._default is not None:
            self._children[()] = self._default

    def _new_child(self) -> _Child:
        raise NotImplementedError

    def labels(self, *values: str) -> _Child:
        """The series for these label values, in ``labelnames`` order (created on first use).

        Hot path: one dict lookup once the series exists. Pass strings (a
        status code as ``"200"``); other values are converted, at the cost of
        a conversion on every call.
        Keep label values bounded (a route template, a status code), never a
        run id: every distinct value is a series kept forever.

        Raises:
            ValueError: the wrong number of values (checked only when the
                series is created).
        """
        child = self._children.get(values)
        if child is None:
            return self._create(values)
        return child

    def _create(self, values: tuple[object, ...]) -> _Child:
        key = tuple(str(v) for v in values)
        child = self._children.get(key)  # the values were not all strings (a status int)
        if child is None:
            if len(key) != len(self.labelnames) or not self.labelnames:
                raise ValueError(
                    f"metric {self.name!r} has labels {self.labelnames}, got values {values}"
                )
            child = self._children[key] = self._new_child()
        return child

    def _only(self) -> _Child:
        if self._default is None:
            raise ValueError(f"metric {self.name!r} has labels {self.labelnames}: use .labels()")
        return self._default

    def _header(self) -> list[str]:
        return [
            f"# HELP {self.name} {_escape_help(self.help)}",
            f"# TYPE {self.name} {self.type_name}",
        ]

    def _series(self) -> list[tuple[tuple[str, ...], _Child]]:
        return sorted(self._children.items())

    def render_lines(self) -> list[str]:
        raise NotImplementedError


class Counter(_Metric[CounterChild]):
    """A value that only goes up (requests served). Name it ``..._total``."""

    type_name = "counter"

    def _new_child(self) -> CounterChild:
        return CounterChild()

    def inc(self, amount: Number = 1) -> None:
        """Add to the unlabelled counter (see `CounterChild.inc`).

        Raises:
            ValueError: the counter has labels, or ``amount`` < 0.
        """
        self._only().inc(amount)

    @property
    def value(self) -> Number:
        return self._only().value

    def render_lines(self) -> list[str]:
        lines = self._header()
        for values, child in self._series():
            lines.append(
                f"{self.name}{_label_text(self.labelnames, values)} {_format_value(child.value)}"
            )
        return lines


# Keys: label-value tuples, or bare strings for a one-label gauge (Any because
# Mapping is invariant in its key type: a dict[tuple[str, str], int] would not
# be a Mapping[tuple[str, ...], ...]).
GaugeFunction = Callable[[], "Number | Mapping[Any, Number]"]


class Gauge(_Metric[GaugeChild]):
    """A value that goes up and down: set on the hot path, or computed at scrape time.

    With `set_function`, the callback is called by every `Registry.render` and
    its result replaces the recorded series: a number for an unlabelled gauge,
    a mapping from label-value tuples to numbers for a labelled one (e.g.
    ``{("running",): 3, ("completed",): 40}``; a gauge with one label may use
    bare strings as keys: ``{"running": 3}``).
    """

    type_name = "gauge"

    def __init__(
        self,
        name: str,
        help: str,
        labelnames: Sequence[str] = (),
        *,
        function: GaugeFunction | None = None,
    ) -> None:
        super().__init__(name, help, labelnames)
        self._function = function

    def _new_child(self) -> GaugeChild:
        return GaugeChild()

    def set_function(self, function: GaugeFunction | None) -> None:
        """Compute the gauge at scrape time from ``function`` (None: back to recorded values)."""
        self._function = function

    def set(self, value: Number) -> None:
        """Set the unlabelled gauge. Raises ValueError if it has labels."""
        self._only().set(value)

    def inc(self, amount: Number = 1) -> None:
        self._only().inc(amount)

    def dec(self, amount: Number = 1) -> None:
        self._only().dec(amount)

    @property
    def value(self) -> Number:
        return self._only().value

    def _computed(self) -> list[tuple[tuple[str, ...], Number]]:
        assert self._function is not None
        result = self._function()
        if isinstance(result, Mapping):
            if not self.labelnames:
                raise TypeError(
                    f"gauge {self.name!r} has no labels; its function must return a number"
                )
            series: list[tuple[tuple[str, ...], Number]] = []
            for values, value in result.items():
                key = (values,) if isinstance(values, str) else tuple(str(v) for v in values)
                if len(key) != len(self.labelnames):
                    raise ValueError(
                        f"gauge {self.name!r} has labels {self.labelnames}, function gave {key}"
                    )
                series.append((key, value))
            return sorted(series)
        if self.labelnames:
            raise TypeError(
                f"gauge {self.name!r} has labels {self.labelnames}; its function must return "
                "a mapping of label values to numbers"
            )
        return [((), result)]

    def render_lines(self) -> list[str]:
        lines = self._header()
        if self._function is not None:
            series = self._computed()
        else:
            series = [(values, child.value) for values, child in self._series()]
        for values, value in series:
            lines.append(
                f"{self.name}{_label_text(self.labelnames, values)} {_format_value(value)}"
            )
        return lines


class Histogram(_Metric[HistogramChild]):
    """Observations counted into fixed buckets, with their sum and count.

    Rendered as ``<name>_bucket{le="..."}`` (cumulative, ``+Inf`` last),
    ``<name>_sum`` and ``<name>_count``.
    """

    type_name = "histogram"

    def __init__(
        self,
        name: str,
        help: str,
        labelnames: Sequence[str] = (),
        *,
        buckets: Iterable[float] = LATENCY_BUCKETS,
    ) -> None:
        bounds = tuple(float(b) for b in buckets)
        if bounds and math.isinf(bounds[-1]) and bounds[-1] > 0:
            bounds = bounds[:-1]  # +Inf is implicit
        if not bounds:
            raise ValueError(f"histogram {name!r} needs at least one finite bucket")
        if any(math.isnan(b) or math.isinf(b) for b in bounds) or list(bounds) != sorted(
            set(bounds)
        ):
            raise ValueError(f"histogram {name!r}: buckets must be finite, distinct and increasing")
        if "le" in labelnames:
            raise ValueError(f"histogram {name!r}: 'le' is reserved for buckets")
        self.bounds: tuple[float, ...] = bounds
        super().__init__(name, help, labelnames)

    def _new_child(self) -> HistogramChild:
        return HistogramChild(self.bounds)

    def observe(self, value: float) -> None:
        """Observe on the unlabelled histogram. Raises ValueError if it has labels."""
        self._only().observe(value)

    def render_lines(self) -> list[str]:
        lines = self._header()
        les = [_format_le(b) for b in self.bounds] + ["+Inf"]
        for values, child in self._series():
            cumulative = 0
            for le, count in zip(les, child.counts, strict=True):
                cumulative += count
                labels = _label_text(self.labelnames, values, f'le="{le}"')
                lines.append(f"{self.name}_bucket{labels} {cumulative}")
            labels = _label_text(self.labelnames, values)
            lines.append(f"{self.name}_sum{labels} {_format_value(child.sum)}")
            lines.append(f"{self.name}_count{labels} {cumulative}")
        return lines


# --------------------------------------------------------------------------- registry

_M = TypeVar("_M", Counter, Gauge, Histogram)


class Registry:
    """The metrics one ``/metrics`` endpoint exposes, in registration order."""

    def __init__(self) -> None:
        self._metrics: dict[str, Counter | Gauge | Histogram] = {}

    def register(self, metric: _M) -> _M:
        """Add ``metric``; returns it.

        Raises:
            ValueError: a metric with that name exists (or a histogram's derived
                ``_bucket``/``_sum``/``_count`` name collides with one).
        """
        names = {metric.name}
        if isinstance(metric, Histogram):
            names |= {metric.name + s for s in ("_bucket", "_sum", "_count")}
        taken = set(self._metrics)
        for existing in self._metrics.values():
            if isinstance(existing, Histogram):
                taken |= {existing.name + s for s in ("_bucket", "_sum", "_count")}
        clash = names & taken
        if clash:
            raise ValueError(f"metric name already registered: {min(clash)}")
        self._metrics[metric.name] = metric
        return metric

    def counter(self, name: str, help: str, labelnames: Sequence[str] = ()) -> Counter:
        """Create and register a `Counter`."""
        return self.register(Counter(name, help, labelnames))

    def gauge(
        self,
        name: str,
        help: str,
        labelnames: Sequence[str] = (),
        *,
        function: GaugeFunction | None = None,
    ) -> Gauge:
        """Create and register a `Gauge`."""
        return self.register(Gauge(name, help, labelnames, function=function))

    def histogram(
        self,
        name: str,
        help: str,
        labelnames: Sequence[str] = (),
        *,
        buckets: Iterable[float] = LATENCY_BUCKETS,
    ) -> Histogram:
        """Create and register a `Histogram`."""
        return self.register(Histogram(name, help, labelnames, buckets=buckets))

    def get(self, name: str) -> Counter | Gauge | Histogram | None:
        return self._metrics.get(name)

    def render(self) -> str:
        """The exposition text (format 0.0.4), ending with a newline.

        Calls every gauge function; an error in one propagates (a broken
        callback is a bug to see, not a series to drop silently).
        """
        lines: list[str] = []
        for metric in self._metrics.values():
            lines.extend(metric.render_lines())
        return "\n".join(lines) + "\n" if lines else ""


# --------------------------------------------------------------------------- the daemon's set


@dataclass(frozen=True, slots=True)
class DaemonMetrics:
    """The daemon's metrics (docs/http-api.md "Metrics" lists names and meanings).

    ``runs_by_status`` is computed at scrape time: wire it with
    ``runs_by_status.set_function(lambda: {("running",): n, ...})``. The other
    gauges are set by their owners (the registry actor for leases, claims and
    workers) or given functions the same way.
    """

    runs_by_status: Gauge
    live_leases: Gauge
    waiting_claims: Gauge
    connected_workers: Gauge
    step_schedule_to_start_seconds: Histogram
    run_to_complete_seconds: Histogram
    commit_batch_size: Histogram
    requests_total: Counter


def daemon_metrics(registry: Registry) -> DaemonMetrics:
    """Register the daemon's metric set in ``registry`` and return it.

    Raises:
        ValueError: ``registry`` already holds one of these names.
    """
    return DaemonMetrics(
        runs_by_status=registry.gauge(
            "stepd_runs", "Runs by status (computed from storage at scrape time).", ("status",)
        ),
        live_leases=registry.gauge(
            "stepd_live_leases", "Leases offered or started and not yet ended."
        ),
        waiting_claims=registry.gauge(
            "stepd_waiting_claims", "Claims held open (long-poll) waiting for work."
        ),
        connected_workers=registry.gauge(
            "stepd_connected_workers", "Workers with an open WebSocket or a claim in flight."
        ),
        step_schedule_to_start_seconds=registry.histogram(
            "stepd_step_schedule_to_start_seconds",
            "Time from a step attempt becoming runnable to its started call.",
            buckets=LATENCY_BUCKETS,
        ),
        run_to_complete_seconds=registry.histogram(
            "stepd_run_to_complete_seconds",
            "Time from run start to a terminal status, any terminal status.",
            buckets=RUN_DURATION_BUCKETS,
        ),
        commit_batch_size=registry.histogram(
            "stepd_commit_batch_size",
            "Write requests committed per storage transaction (group commit).",
            buckets=COMMIT_BATCH_BUCKETS,
        ),
        requests_total=registry.counter(
            "stepd_http_requests_total",
            "HTTP requests answered, by route template and status code.",
            ("route", "status"),
        ),
    )


def trace_export_metrics(registry: Registry, statistics: Callable[[], Any]) -> Gauge:
    """Register ``stepd_otel_export{what=...}``: the span export's counts (docs/otel.md).

    ``statistics`` returns the export's frozen record (`stepd.otel.ExportStats`):
    spans exported and failed, writes queued and dropped, attempts forgotten.
    Registered only when export is on.
    """
    return registry.gauge(
        "stepd_otel_export",
        "OpenTelemetry span export: spans exported and failed, run writes queued and dropped "
        "(queue full), attempts forgotten.",
        ("what",),
        function=lambda: dataclasses.asdict(statistics()),
    )

