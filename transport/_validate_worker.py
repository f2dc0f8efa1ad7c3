"""The bodies a worker sends, one parser each (``transport/openapi.json``
``RegisterRequest``, ``ClaimRequest``, ``CompleteRequest``, ...): register and
its manifest, claims, worker-session calls, and a lease's calls (``started``,
``heartbeat``, ``complete`` with its usage, spans, local steps and sticky
cursor, ``fail``).

Each refuses what the document refuses (`_validate_fields`: unknown keys,
wrong types, values out of range) with one `Invalid` naming the field. The
parsers a worker hits every step (`parse_claim`, `parse_complete`) check the
common shape inline first, in a few calls.
"""

from __future__ import annotations

import re
from typing import Any, Final

from stepd.sansio.capabilities import CAPABILITIES
from stepd.sansio.errors import Invalid, NotFound, field_path
from stepd.sansio.local_steps import parse_records

from ._validate_fields import (
    HEX16,
    MISSING,
    PROTOCOL_VERSION,
    RUN_ID,
    WORKER_ID,
    body_object,
    body_or_empty,
    check_int,
    check_keys,
    check_name,
    check_object,
    check_pattern,
    is_run_id,
    optional_name,
    required,
)

MAX_CLAIM: Final = 1000
"""A claim offers at most this many leases at once (``max`` above it is capped: "up to")."""

MAX_TOKENS: Final = 1 << 40
"""The most tokens one usage object may report (~1.1e12, far beyond any model call).

Why a bound: the daemon sums usage into the run's totals, and a sum past what
the storage codec holds (2**64-1) failed the run's write on every retry: a
poison run. Refused here with a 400 naming the field, nothing of the call is applied.
"""

MAX_EPOCH_MS: Final = 1 << 53
"""Span times are epoch milliseconds: at most 2**53 (exact in a double, the year 287396)."""


# -- usage and spans (of a complete, and of each of its local steps) -----------------------


def _usage(value: Any, field: str) -> dict[str, Any] | None:
    if value is None:
        return None
    u = check_object(value, field)
    check_keys(u, frozenset({"model", "input_tokens", "output_tokens"}), field)
    out: dict[str, Any] = {}
    if "model" in u:
        out["model"] = optional_name(u["model"], field_path(field, "model"))
    if "input_tokens" in u:
        out["input_tokens"] = check_int(u["input_tokens"], field_path(field, "input_tokens"),
                                        minimum=0, maximum=MAX_TOKENS)
    if "output_tokens" in u:
        out["output_tokens"] = check_int(u["output_tokens"], field_path(field, "output_tokens"),
                                         minimum=0, maximum=MAX_TOKENS)
    return out


_SPAN_KEYS: Final = frozenset(
    {"span_id", "parent_span_id", "name", "start_ms", "end_ms", "attributes", "usage"}
)


def _span(value: Any, field: str) -> dict[str, Any]:
    s = check_object(value, field)
    check_keys(s, _SPAN_KEYS, field)
    out = dict(s)
    out["span_id"] = check_pattern(required(s, "span_id", field), field_path(field, "span_id"), HEX16,
                              "16 lowercase hex digits", 16)
    if s.get("parent_span_id") is not None:
        check_pattern(s["parent_span_id"], field_path(field, "parent_span_id"), HEX16,
                 "16 lowercase hex digits or null", 16)
    name = required(s, "name", field)
    if not isinstance(name, str) or not name:
        raise Invalid("must be a non-empty string", field=field_path(field, "name"))
    out["start_ms"] = check_int(required(s, "start_ms", field), field_path(field, "start_ms"),
                                minimum=0, maximum=MAX_EPOCH_MS)
    out["end_ms"] = check_int(required(s, "end_ms", field), field_path(field, "end_ms"),
                              minimum=0, maximum=MAX_EPOCH_MS)
    if "attributes" in s and not isinstance(s["attributes"], dict):
        raise Invalid("must be an object", field=field_path(field, "attributes"))
    if "usage" in s:
        out["usage"] = _usage(s["usage"], field_path(field, "usage"))
    return out


def _local_body(record: dict[str, Any], field: str) -> dict[str, Any]:
    """A local step's record with its body's ``usage`` and ``spans`` checked as a
    ``complete``'s are (docs/affinity.md "Local steps": same limits, 400 naming
    ``local_steps[i].spans[j]...``)."""
    out = dict(record)
    if "usage" in record:
        out["usage"] = _usage(record["usage"], field_path(field, "usage"))
    if record.get("spans") is not None:
        spans = record["spans"]
        if not isinstance(spans, list):
            raise Invalid("must be an array", field=field_path(field, "spans"))
        out["spans"] = [_span(s, f"{field}.spans[{i}]") for i, s in enumerate(spans)]
    return out


# -- one parser per request body (OpenAPI components/schemas/*Request) ---------------------

_REGISTER_KEYS: Final = frozenset(
    {"name", "worker_id", "build_id", "protocol_version", "concurrency", "definitions",
     "capabilities", "manifest"}
)


def parse_register(body: Any) -> dict[str, Any]:
    """``RegisterRequest`` -> keyword arguments of `Daemon.register_worker`.

    Definitions themselves are validated by the engine's parser (400 naming the
    definition and the field, ``definitions[0].steps[1].kind``).
    """
    b = body_object(body)
    check_keys(b, _REGISTER_KEYS, "")
    definitions = required(b, "definitions", "")
    if not isinstance(definitions, list):
        raise Invalid("must be an array", field="definitions")
    out: dict[str, Any] = {"definitions": definitions}
    if "name" in b:
        out["name"] = check_name(b["name"], "name")
    if "worker_id" in b:
        out["worker_id"] = check_pattern(b["worker_id"], "worker_id", WORKER_ID,
                                    "a worker id returned by an earlier register (w_...)", 64)
    if "build_id" in b:
        out["build_id"] = check_name(b["build_id"], "build_id")
    if "protocol_version" in b:
        out["protocol_version"] = check_pattern(b["protocol_version"], "protocol_version",
                                           PROTOCOL_VERSION, 'a "MAJOR.MINOR" string', 9)
    if "concurrency" in b:
        out["concurrency"] = check_int(b["concurrency"], "concurrency", minimum=1)
    if "capabilities" in b:
        caps = b["capabilities"]
        if not isinstance(caps, list):
            raise Invalid("must be an array", field="capabilities")
        for i, cap in enumerate(caps):
            if cap not in CAPABILITIES:
                raise Invalid(f"must be one of {', '.join(CAPABILITIES)}",
                              field=f"capabilities[{i}]")
        if len(set(caps)) != len(caps):
            raise Invalid("must not repeat a capability", field="capabilities")
        out["capabilities"] = caps
    if "manifest" in b:
        manifest = check_object(b["manifest"], "manifest")
        check_keys(manifest, frozenset(CAPABILITIES), "manifest")
        for cap in CAPABILITIES:
            entry = check_object(required(manifest, cap, "manifest"), f"manifest.{cap}")
            if entry.get("status", MISSING) not in ("supported", "rejected"):
                raise Invalid('must be "supported" or "rejected"', field=f"manifest.{cap}.status")
            if cap == "sticky":
                _manifest_sticky(entry)
        _sessions_entry(manifest["sessions"])
        out["manifest"] = manifest
    return out


def _sessions_entry(entry: dict[str, Any]) -> None:
    """``manifest.sessions``: ``resources`` (names to scalars), ``max_sessions`` (how many
    sessions the worker holds at once, default 1), ``queues`` (names; absent: any)."""
    where = "manifest.sessions"
    check_keys(entry, frozenset({"status", "resources", "max_sessions", "queues"}), where)
    if "resources" in entry:
        resources = check_object(entry["resources"], f"{where}.resources")
        for k, v in resources.items():
            if isinstance(v, (dict, list)) or v is None:
                raise Invalid("must be a string, number or boolean",
                              field=f"{where}.resources.{k}")
    if "max_sessions" in entry:
        check_int(entry["max_sessions"], f"{where}.max_sessions", minimum=0, maximum=10_000)
    if "queues" in entry:
        queues = entry["queues"]
        if not isinstance(queues, list) or not all(isinstance(q, str) and q for q in queues):
            raise Invalid("must be an array of queue names", field=f"{where}.queues")


def parse_session_call(body: Any, connection_worker: str | None) -> str:
    """``SessionCallRequest`` (renew, close): ``{"worker_id"}`` -> the worker id.

    Over a WebSocket the connection's worker is the caller and ``worker_id`` may
    be omitted; given, it must be that worker (else the session is unknown to it).
    """
    b = body_or_empty(body)
    check_keys(b, frozenset({"worker_id"}), "")
    if "worker_id" not in b:
        if connection_worker:
            return connection_worker
        raise Invalid("is required", field="worker_id")
    worker_id = check_pattern(b["worker_id"], "worker_id", WORKER_ID, "a worker id (w_...)", 64)
    if connection_worker is not None and worker_id != connection_worker:
        raise NotFound("the session is not held by this connection's worker")
    return worker_id


_CLAIM_KEYS: Final = frozenset({"worker_id", "max", "wait_ms", "run_id"})


def parse_claim(body: Any) -> dict[str, Any]:
    """``ClaimRequest`` -> ``worker_id, max, wait_ms, run_id`` (``max`` capped at `MAX_CLAIM`).

    A worker sends one per step or so: the common shape (a plain object, known
    keys, int fields, a well-formed id) is checked inline; anything else goes
    through the general checks, which name the field.
    """
    b = body if type(body) is dict else body_object(body)
    if not _CLAIM_KEYS.issuperset(b):
        check_keys(b, _CLAIM_KEYS, "")
    worker_id = b.get("worker_id")
    if type(worker_id) is not str or len(worker_id) > 64 or WORKER_ID.fullmatch(worker_id) is None:
        worker_id = check_pattern(required(b, "worker_id", ""), "worker_id", WORKER_ID,
                             "a worker id (w_...)", 64)
    max_n = b.get("max", 1)
    if type(max_n) is not int or max_n < 1:
        max_n = check_int(max_n, "max", minimum=1)
    wait_ms = b.get("wait_ms", 0)
    if type(wait_ms) is not int or wait_ms < 0:
        wait_ms = check_int(wait_ms, "wait_ms", minimum=0)
    run_id = b.get("run_id")
    if run_id is not None and not is_run_id(run_id):
        raise Invalid("must be a run id (r_...) or null", field="run_id")
    return {"worker_id": worker_id, "max": min(max_n, MAX_CLAIM),
            "wait_ms": wait_ms, "run_id": run_id}


def parse_started(body: Any) -> dict[str, Any]:
    """``StartedRequest``: ``{}`` (or no body)."""
    check_keys(body_or_empty(body), frozenset(), "")
    return {}


def parse_heartbeat(body: Any) -> dict[str, Any]:
    """``HeartbeatRequest``: ``{"progress"?}`` (or no body)."""
    b = body_or_empty(body)
    check_keys(b, frozenset({"progress"}), "")
    return {"progress": b["progress"]} if "progress" in b else {}


_COMPLETE_KEYS: Final = frozenset({"output", "state_patch", "usage", "spans", "started",
                                   "claim_next", "local_steps", "sticky_cursor", "sticky_stats"})


def parse_complete(body: Any) -> dict[str, Any]:
    """``CompleteRequest`` -> the engine's complete body (``output, state_patch, usage, spans``,
    and ``local_steps``, ``sticky_cursor``, ``sticky_stats`` when given: checked here, gated
    by the lease actor, `stepd.sansio.capabilities`)."""
    if type(body) is dict and body.keys() <= _PLAIN_COMPLETE:
        # What nearly every step sends (``output``, a folded ``started``): the same
        # checks and answer as below, in ~4 calls instead of ~25.
        started = body.get("started", False)
        if type(started) is not bool:
            raise Invalid("must be a boolean", field="started")
        plain: dict[str, Any] = {"output": body.get("output"), "state_patch": None,
                                 "usage": None, "spans": []}
        if started:
            plain["started"] = True
        claim_next = body.get("claim_next", False)
        if claim_next is True:
            plain["claim_next"] = True
        elif claim_next is not False:
            raise Invalid("must be a boolean", field="claim_next")
        return plain
    b = body if type(body) is dict else body_object(body)
    if not _COMPLETE_KEYS.issuperset(b):
        check_keys(b, _COMPLETE_KEYS, "")
    get = b.get
    state_patch = get("state_patch")
    if state_patch is not None and type(state_patch) is not dict \
            and not isinstance(state_patch, dict):
        raise Invalid("must be an object or null", field="state_patch")
    spans = get("spans", [])
    if type(spans) is not list and not isinstance(spans, list):
        raise Invalid("must be an array", field="spans")
    usage = get("usage")
    out = {
        "output": get("output"),
        "state_patch": state_patch,
        "usage": None if usage is None else _usage(usage, "usage"),
        "spans": [_span(s, f"spans[{i}]") for i, s in enumerate(spans)] if spans else [],
    }
    started = get("started", False)
    if started is True:
        out["started"] = True
    elif started is not False:
        _folded_started(b)  # raises: not a boolean
    claim_next = get("claim_next", False)
    if claim_next is True:
        out["claim_next"] = True
    elif claim_next is not False:
        raise Invalid("must be a boolean", field="claim_next")
    local_steps = get("local_steps")
    if local_steps is not None:
        parse_records(local_steps)
        out["local_steps"] = [_local_body(r, f"local_steps[{i}]")
                              for i, r in enumerate(local_steps)]
    sticky_cursor = get("sticky_cursor")
    if sticky_cursor is not None:
        out["sticky_cursor"] = _sticky_cursor(sticky_cursor)
    sticky_stats = get("sticky_stats")
    if sticky_stats is not None:
        out["sticky_stats"] = _sticky_stats(sticky_stats)
    return out


_PLAIN_COMPLETE: Final = frozenset({"output", "started", "claim_next"})


def _folded_started(b: dict[str, Any]) -> bool:
    """``"started": true`` on complete/fail: an at_least_once worker's `started`, folded in
    (docs/leases.md "A folded started"). Ignored for at_most_once (``not_started`` holds)."""
    started = b.get("started", False)
    if not isinstance(started, bool):
        raise Invalid("must be a boolean", field="started")
    return started


STICKY_COUNTS: Final = ("hit", "miss", "eviction", "forced_cold_replay")
_HASH: Final = re.compile(r"[0-9a-f]{64}")


def _sticky_cursor(value: Any) -> dict[str, Any]:
    """``StickyCursor``: the history cursor the worker cached for this lease (docs/affinity.md
    "Sticky execution"); its identity is the capability gate's to check against the lease."""
    c = check_object(value, "sticky_cursor")
    check_keys(c, frozenset({"seq", "hash", "workflow", "run_id", "build_id"}), "sticky_cursor")
    build = c.get("build_id")
    return {
        "seq": check_int(required(c, "seq", "sticky_cursor"), "sticky_cursor.seq", minimum=0),
        "hash": check_pattern(required(c, "hash", "sticky_cursor"), "sticky_cursor.hash", _HASH,
                         "64 lowercase hex digits", 64),
        "workflow": check_name(required(c, "workflow", "sticky_cursor"),
                               "sticky_cursor.workflow"),
        "run_id": check_pattern(required(c, "run_id", "sticky_cursor"), "sticky_cursor.run_id",
                           RUN_ID, "a run id (r_...)", 400),
        "build_id": None if build is None else check_name(build, "sticky_cursor.build_id"),
    }


def _sticky_stats(value: Any) -> dict[str, int]:
    """``StickyStats``: the worker's sticky cache counts (cumulative)."""
    st = check_object(value, "sticky_stats")
    check_keys(st, frozenset(STICKY_COUNTS), "sticky_stats")
    return {k: check_int(st.get(k, 0), f"sticky_stats.{k}", minimum=0) for k in STICKY_COUNTS}


_STICKY_SETTINGS: Final = {"capacity": (1, 1_000_000), "max_bytes": (1, 1 << 40),
                           "ttl_ms": (1, 1 << 40), "schedule_ms": (0, 3_600_000)}


def _manifest_sticky(entry: dict[str, Any]) -> None:
    """A supported ``manifest.sticky`` may state the worker's cache settings
    (``capacity``, ``max_bytes``, ``ttl_ms``) and its ``schedule_ms``."""
    check_keys(entry, frozenset({"status", *_STICKY_SETTINGS}), "manifest.sticky")
    for key, (low, high) in _STICKY_SETTINGS.items():
        if key in entry:
            check_int(entry[key], f"manifest.sticky.{key}", minimum=low, maximum=high)


def parse_fail(body: Any) -> dict[str, Any]:
    """``FailRequest`` -> the engine's fail body (wire ``error.class`` is ``error_class``)."""
    b = body_object(body)
    check_keys(b, frozenset({"error", "started"}), "")
    error = check_object(required(b, "error", ""), "error")
    check_keys(error, frozenset({"class", "message"}), "error")
    error_class = check_name(required(error, "class", "error"), "error.class")
    message = error.get("message", "")
    if not isinstance(message, str):
        raise Invalid("must be a string", field="error.message")
    out: dict[str, Any] = {"error_class": error_class, "message": message}
    if _folded_started(b):
        out["started"] = True
    return out
