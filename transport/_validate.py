"""Request validation shared by every transport: strict JSON, ids, bodies, query parameters.

One parser per request body of ``transport/openapi.json`` (``parse_register``,
``parse_claim``, ...). Each refuses what the document refuses: keys it does not
define (at every level except free JSON: ``input``, ``output``, ``payload``,
``progress``, ``correlation``, state patch values, span attributes, the
settings of a manifest capability), wrong types (a bool is not an integer;
``3.0`` is), values out of range, and raises one `Invalid` naming the field
(``error.class``, ``spans[0].usage.model``). Definitions are left to the
engine's own parser (`stepd.sansio.definition.parse_definition`).

Private to `stepd.transport.protocol`, which re-exports what transports use.
"""

from __future__ import annotations

import datetime
import math
import re
from collections.abc import Mapping
from typing import Any, Final, TypeGuard

from stepd.sansio.capabilities import CAPABILITIES
from stepd.sansio.errors import Invalid, NotFound, field_path
from stepd.sansio.local_steps import parse_records

from ._json import copy_json, decode_json

NO_BODY: Final = object()
"""The ``body`` of a call that carried none (an empty HTTP body)."""

MAX_CLAIM: Final = 1000
"""A claim offers at most this many leases at once (``max`` above it is capped: "up to")."""

# --------------------------------------------------------------------------- validation

RUN_ID: Final = re.compile(r"r_[0-9A-Za-z][0-9A-Za-z._@-]*")
LEASE_ID: Final = re.compile(r"l_[0-9A-Za-z]+")
SCHEDULE_ID: Final = re.compile(r"s_[0-9A-Za-z]+")
WORKER_ID: Final = re.compile(r"w_[0-9A-Za-z]+")
PROTOCOL_VERSION: Final = re.compile(r"[0-9]{1,4}\.[0-9]{1,4}")
HEX16: Final = re.compile(r"[0-9a-f]{16}")
_DIGITS: Final = re.compile(r"-?[0-9]{1,18}")
_LONG_DIGITS: Final = re.compile(r"-?[0-9]+")

RUN_STATUSES: Final = frozenset(
    {"running", "waiting", "sleeping", "completed", "failed", "cancelled", "timed_out"}
)
TERMINAL: Final = frozenset({"completed", "failed", "cancelled", "timed_out"})

_MISSING: Final = object()


def is_run_id(value: object) -> TypeGuard[str]:
    return isinstance(value, str) and 3 <= len(value) <= 512 and RUN_ID.fullmatch(value) is not None


def is_schedule_id(value: object) -> TypeGuard[str]:
    return (isinstance(value, str) and 3 <= len(value) <= 64
            and SCHEDULE_ID.fullmatch(value) is not None)


def is_lease_id(value: object) -> TypeGuard[str]:
    # `type() is` first: a plain str (every path id) skips the isinstance call.
    return ((type(value) is str or isinstance(value, str)) and 3 <= len(value) <= 64
            and LEASE_ID.fullmatch(value) is not None)


SESSION_ID: Final = re.compile(r"ws_r_[0-9A-Za-z][0-9A-Za-z._@-]*\.[A-Za-z0-9_-]{1,64}")


def is_session_id(value: object) -> TypeGuard[str]:
    """A worker session id, ``ws_<run id>.<name>`` (docs/affinity.md "Worker sessions")."""
    return isinstance(value, str) and 6 <= len(value) <= 600 \
        and SESSION_ID.fullmatch(value) is not None


def is_worker_id(value: object) -> TypeGuard[str]:
    return isinstance(value, str) and 3 <= len(value) <= 64 and WORKER_ID.fullmatch(value) is not None


def _obj(value: Any, field: str | None) -> dict[str, Any]:
    if not isinstance(value, dict):
        if field is None:
            raise Invalid("the body must be a JSON object")
        raise Invalid("must be an object", field=field)
    return value


def _closed(obj: Mapping[str, Any], allowed: frozenset[str], prefix: str) -> None:
    """Refuse the first key ``obj`` holds that ``allowed`` does not (400 naming it)."""
    for key in obj:
        if key not in allowed:
            raise Invalid("unknown key", field=field_path(prefix, key))


def _required(obj: Mapping[str, Any], key: str, prefix: str) -> Any:
    value = obj.get(key, _MISSING)
    if value is _MISSING:
        raise Invalid("is required", field=field_path(prefix, key))
    return value


def check_int(value: Any, field: str, *, minimum: int | None = None,
              maximum: int | None = None) -> int:
    """A JSON integer (``3`` or ``3.0``; never a bool) within bounds."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise Invalid("must be an integer", field=field)
    if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
        raise Invalid("must be an integer", field=field)
    number = int(value)
    if minimum is not None and number < minimum:
        raise Invalid(f"must be >= {minimum}", field=field)
    if maximum is not None and number > maximum:
        raise Invalid(f"must be <= {maximum}", field=field)
    return number


def check_name(value: Any, field: str) -> str:
    """A non-empty name of at most 128 characters and 128 bytes of UTF-8 (OpenAPI ``Name``)."""
    if not isinstance(value, str):
        raise Invalid("must be a string", field=field)
    if not value:
        raise Invalid("must not be empty", field=field)
    if len(value) > 128 or len(value.encode("utf-8", "surrogatepass")) > 128:
        raise Invalid("must be at most 128 bytes of UTF-8", field=field)
    return value


def optional_name(value: Any, field: str) -> str | None:
    return None if value is None else check_name(value, field)


def _pattern(value: Any, field: str, pattern: re.Pattern[str], what: str, max_len: int) -> str:
    if not isinstance(value, str) or len(value) > max_len or pattern.fullmatch(value) is None:
        raise Invalid(f"must be {what}", field=field)
    return value


MAX_TOKENS: Final = 1 << 40
"""The most tokens one usage object may report (~1.1e12, far beyond any model call).

Why a bound: the daemon sums usage into the run's totals, and a sum past what
the storage codec holds (2**64-1) failed the run's write on every retry: a
poison run. Refused here with a 400 naming the field, nothing of the call is applied.
"""

MAX_EPOCH_MS: Final = 1 << 53
"""Span times are epoch milliseconds: at most 2**53 (exact in a double, the year 287396)."""


def _usage(value: Any, field: str) -> dict[str, Any] | None:
    if value is None:
        return None
    u = _obj(value, field)
    _closed(u, frozenset({"model", "input_tokens", "output_tokens"}), field)
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
    s = _obj(value, field)
    _closed(s, _SPAN_KEYS, field)
    out = dict(s)
    out["span_id"] = _pattern(_required(s, "span_id", field), field_path(field, "span_id"), HEX16,
                              "16 lowercase hex digits", 16)
    if s.get("parent_span_id") is not None:
        _pattern(s["parent_span_id"], field_path(field, "parent_span_id"), HEX16,
                 "16 lowercase hex digits or null", 16)
    name = _required(s, "name", field)
    if not isinstance(name, str) or not name:
        raise Invalid("must be a non-empty string", field=field_path(field, "name"))
    out["start_ms"] = check_int(_required(s, "start_ms", field), field_path(field, "start_ms"),
                                minimum=0, maximum=MAX_EPOCH_MS)
    out["end_ms"] = check_int(_required(s, "end_ms", field), field_path(field, "end_ms"),
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


def _body_or_empty(body: Any) -> dict[str, Any]:
    """The body of a call whose body may be omitted (``started``, ``heartbeat``, ``cancel``)."""
    if body is NO_BODY:
        return {}
    return _obj(body, None)


def _body(body: Any) -> dict[str, Any]:
    if body is NO_BODY:
        raise Invalid("a JSON object body is required")
    return _obj(body, None)


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
    b = _body(body)
    _closed(b, _REGISTER_KEYS, "")
    definitions = _required(b, "definitions", "")
    if not isinstance(definitions, list):
        raise Invalid("must be an array", field="definitions")
    out: dict[str, Any] = {"definitions": definitions}
    if "name" in b:
        out["name"] = check_name(b["name"], "name")
    if "worker_id" in b:
        out["worker_id"] = _pattern(b["worker_id"], "worker_id", WORKER_ID,
                                    "a worker id returned by an earlier register (w_...)", 64)
    if "build_id" in b:
        out["build_id"] = check_name(b["build_id"], "build_id")
    if "protocol_version" in b:
        out["protocol_version"] = _pattern(b["protocol_version"], "protocol_version",
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
        manifest = _obj(b["manifest"], "manifest")
        _closed(manifest, frozenset(CAPABILITIES), "manifest")
        for cap in CAPABILITIES:
            entry = _obj(_required(manifest, cap, "manifest"), f"manifest.{cap}")
            if entry.get("status", _MISSING) not in ("supported", "rejected"):
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
    _closed(entry, frozenset({"status", "resources", "max_sessions", "queues"}), where)
    if "resources" in entry:
        resources = _obj(entry["resources"], f"{where}.resources")
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
    b = _body_or_empty(body)
    _closed(b, frozenset({"worker_id"}), "")
    if "worker_id" not in b:
        if connection_worker:
            return connection_worker
        raise Invalid("is required", field="worker_id")
    worker_id = _pattern(b["worker_id"], "worker_id", WORKER_ID, "a worker id (w_...)", 64)
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
    b = body if type(body) is dict else _body(body)
    if not _CLAIM_KEYS.issuperset(b):
        _closed(b, _CLAIM_KEYS, "")
    worker_id = b.get("worker_id")
    if type(worker_id) is not str or len(worker_id) > 64 or WORKER_ID.fullmatch(worker_id) is None:
        worker_id = _pattern(_required(b, "worker_id", ""), "worker_id", WORKER_ID,
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
    _closed(_body_or_empty(body), frozenset(), "")
    return {}


def parse_heartbeat(body: Any) -> dict[str, Any]:
    """``HeartbeatRequest``: ``{"progress"?}`` (or no body)."""
    b = _body_or_empty(body)
    _closed(b, frozenset({"progress"}), "")
    return {"progress": b["progress"]} if "progress" in b else {}


_COMPLETE_KEYS: Final = frozenset({"output", "state_patch", "usage", "spans", "started",
                                   "local_steps", "sticky_cursor", "sticky_stats"})


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
        return plain
    b = body if type(body) is dict else _body(body)
    if not _COMPLETE_KEYS.issuperset(b):
        _closed(b, _COMPLETE_KEYS, "")
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


_PLAIN_COMPLETE: Final = frozenset({"output", "started"})


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
    c = _obj(value, "sticky_cursor")
    _closed(c, frozenset({"seq", "hash", "workflow", "run_id", "build_id"}), "sticky_cursor")
    build = c.get("build_id")
    return {
        "seq": check_int(_required(c, "seq", "sticky_cursor"), "sticky_cursor.seq", minimum=0),
        "hash": _pattern(_required(c, "hash", "sticky_cursor"), "sticky_cursor.hash", _HASH,
                         "64 lowercase hex digits", 64),
        "workflow": check_name(_required(c, "workflow", "sticky_cursor"),
                               "sticky_cursor.workflow"),
        "run_id": _pattern(_required(c, "run_id", "sticky_cursor"), "sticky_cursor.run_id",
                           RUN_ID, "a run id (r_...)", 400),
        "build_id": None if build is None else check_name(build, "sticky_cursor.build_id"),
    }


def _sticky_stats(value: Any) -> dict[str, int]:
    """``StickyStats``: the worker's sticky cache counts (cumulative)."""
    st = _obj(value, "sticky_stats")
    _closed(st, frozenset(STICKY_COUNTS), "sticky_stats")
    return {k: check_int(st.get(k, 0), f"sticky_stats.{k}", minimum=0) for k in STICKY_COUNTS}


_STICKY_SETTINGS: Final = {"capacity": (1, 1_000_000), "max_bytes": (1, 1 << 40),
                           "ttl_ms": (1, 1 << 40), "schedule_ms": (0, 3_600_000)}


def _manifest_sticky(entry: dict[str, Any]) -> None:
    """A supported ``manifest.sticky`` may state the worker's cache settings
    (``capacity``, ``max_bytes``, ``ttl_ms``) and its ``schedule_ms``."""
    _closed(entry, frozenset({"status", *_STICKY_SETTINGS}), "manifest.sticky")
    for key, (low, high) in _STICKY_SETTINGS.items():
        if key in entry:
            check_int(entry[key], f"manifest.sticky.{key}", minimum=low, maximum=high)


def parse_fail(body: Any) -> dict[str, Any]:
    """``FailRequest`` -> the engine's fail body (wire ``error.class`` is ``error_class``)."""
    b = _body(body)
    _closed(b, frozenset({"error", "started"}), "")
    error = _obj(_required(b, "error", ""), "error")
    _closed(error, frozenset({"class", "message"}), "error")
    error_class = check_name(_required(error, "class", "error"), "error.class")
    message = error.get("message", "")
    if not isinstance(message, str):
        raise Invalid("must be a string", field="error.message")
    out: dict[str, Any] = {"error_class": error_class, "message": message}
    if _folded_started(b):
        out["started"] = True
    return out


_START_KEYS: Final = frozenset(
    {"workflow", "version", "input", "correlation", "idempotency_key", "deadline_ms"}
)


def _idempotency_key(key: Any) -> str | None:
    """An ``idempotency_key`` field: null, or 1 to 256 bytes of UTF-8."""
    if key is None:
        return None
    if not isinstance(key, str) or not key:
        raise Invalid("must be a non-empty string or null", field="idempotency_key")
    if len(key) > 256 or len(key.encode("utf-8", "surrogatepass")) > 256:
        raise Invalid("must be at most 256 bytes of UTF-8", field="idempotency_key")
    return key


def parse_start_run(body: Any) -> dict[str, Any]:
    """``StartRunRequest`` -> arguments of `Daemon.start_run`."""
    b = _body(body)
    _closed(b, _START_KEYS, "")
    workflow = check_name(_required(b, "workflow", ""), "workflow")
    input_ = _required(b, "input", "")
    key = _idempotency_key(b.get("idempotency_key"))
    deadline = b.get("deadline_ms")
    if deadline is not None:
        deadline = check_int(deadline, "deadline_ms", minimum=1)
    return {
        "workflow": workflow,
        "input": input_,
        "version": optional_name(b.get("version"), "version"),
        "correlation": b.get("correlation"),
        "idempotency_key": key,
        "deadline_ms": deadline,
    }


def parse_signal(body: Any) -> dict[str, Any]:
    """``SignalRequest``: ``{"name", "payload"?}``."""
    b = _body(body)
    _closed(b, frozenset({"name", "payload"}), "")
    return {"name": check_name(_required(b, "name", ""), "name"), "payload": b.get("payload")}


#: The longest cancel reason (characters): it is journaled and shown in the run's status.
MAX_REASON_CHARS: Final = 1000


def parse_cancel(body: Any) -> dict[str, Any]:
    """``CancelRequest``: ``{"reason"?}`` (or no body)."""
    b = _body_or_empty(body)
    _closed(b, frozenset({"reason"}), "")
    reason = b.get("reason")
    if reason is not None and (not isinstance(reason, str) or not reason
                               or len(reason) > MAX_REASON_CHARS):
        raise Invalid(f"must be a non-empty string of at most {MAX_REASON_CHARS} characters, "
                      "or null", field="reason")
    return {"reason": reason}


def parse_retry(body: Any) -> None:
    """``RetryRequest``: ``{}`` (or no body)."""
    _closed(_body_or_empty(body), frozenset(), "")


def parse_fork(body: Any) -> dict[str, Any]:
    """``ForkRequest``: ``{"from_step", "idempotency_key"?}``."""
    b = _body(body)
    _closed(b, frozenset({"from_step", "idempotency_key"}), "")
    return {"from_step": check_name(_required(b, "from_step", ""), "from_step"),
            "idempotency_key": _idempotency_key(b.get("idempotency_key"))}


def parse_kill(body: Any) -> str:
    """``KillRequest`` -> the actor path."""
    b = _body(body)
    _closed(b, frozenset({"path"}), "")
    path = _required(b, "path", "")
    if not isinstance(path, str) or not path.startswith("/") or len(path) > 1024:
        raise Invalid("must be an actor path such as /runs/r_...", field="path")
    return path


# -- query parameters (strings over HTTP; ints or strings in process) -----------------------


_QUERY_INT_MAX: Final = 10**18 - 1  # what `_DIGITS` reads: 18 digits at most


def parse_prune(body: Any) -> dict[str, Any]:
    """``PruneRequest`` -> ``before``, ``idempotency_keys_before`` (epoch ms) and ``limit``."""
    b = _body(body)
    _closed(b, frozenset({"before", "idempotency_keys_before", "limit"}), "")
    if b.get("before") is None:
        raise Invalid("is required: epoch milliseconds or an ISO-8601 timestamp", field="before")
    before = query_time(b, "before")
    keys = query_time(b, "idempotency_keys_before")
    limit = query_int(b, "limit", 10_000, minimum=1, maximum=100_000)
    return {"before": before, "idempotency_keys_before": keys, "limit": limit}


def parse_schedule_action(body: Any) -> None:
    """``ScheduleActionRequest`` (pause, resume): ``{}`` or no body."""
    _closed(_body_or_empty(body), frozenset(), "")


def query_int(query: Mapping[str, Any], key: str, default: int, *, minimum: int,
               maximum: int | None = None) -> int:
    """An integer query parameter within ``minimum`` .. ``maximum`` (18 digits at most).

    Raises:
        Invalid: not an integer, or out of range: the message gives the range
            (never the value: a query string may be 64 KiB).
    """
    raw = query.get(key)
    if raw is None:
        return default
    if isinstance(raw, str):
        top = _QUERY_INT_MAX if maximum is None else maximum
        if _DIGITS.fullmatch(raw) is None:
            if _LONG_DIGITS.fullmatch(raw) is None:
                raise Invalid("must be an integer", field=key)
            raise Invalid(f"must be an integer from {minimum} to {top}", field=key)
        number = int(raw)
        if not minimum <= number <= top:
            raise Invalid(f"must be an integer from {minimum} to {top}", field=key)
        return number
    return check_int(raw, key, minimum=minimum, maximum=maximum)


def query_str(query: Mapping[str, Any], key: str) -> str | None:
    raw = query.get(key)
    if raw is None:
        return None
    if not isinstance(raw, str):
        raise Invalid("must be a string", field=key)
    return raw


_EPOCH_MS_MAX: Final = 2**63 - 1


def query_time(query: Mapping[str, Any], key: str) -> int | None:
    """A time query parameter as epoch ms: an integer, or an ISO-8601 timestamp
    (``2026-12-01T10:00:00Z``; one without an offset is read as UTC).

    Raises:
        Invalid: neither, or out of range.
    """
    raw = query.get(key)
    if raw is None:
        return None
    if isinstance(raw, str) and _DIGITS.fullmatch(raw) is None:
        try:
            when = datetime.datetime.fromisoformat(raw)
        except ValueError:
            raise Invalid("must be epoch milliseconds or an ISO-8601 timestamp such as "
                          "2026-12-01T10:00:00Z", field=key) from None
        if when.tzinfo is None:
            when = when.replace(tzinfo=datetime.UTC)
        ms = (when - _EPOCH) // datetime.timedelta(milliseconds=1)
        if not 0 <= ms <= _EPOCH_MS_MAX:
            raise Invalid("must be a time after 1970-01-01", field=key)
        return ms
    return query_int(query, key, 0, minimum=0, maximum=_EPOCH_MS_MAX)


_EPOCH: Final = datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)


def query_json(query: Mapping[str, Any], key: str, *, max_len: int = 4096) -> Any:
    """A query parameter holding a JSON value other than null (text that is not
    JSON is taken as a JSON string, so ``?correlation=T-42`` means ``"T-42"``).

    Raises:
        Invalid: JSON null, text over `max_len` characters, or a value storage
            could not hold.
    """
    raw = query.get(key)
    if raw is None:
        return None
    if isinstance(raw, str) and len(raw) > max_len:
        raise Invalid(f"must be at most {max_len} characters", field=key)
    if not isinstance(raw, str):
        value = copy_json(raw)
    else:
        try:
            value = decode_json(raw)
        except Invalid:
            value = raw
    if value is None:
        raise Invalid("must be a JSON value other than null", field=key)
    return value
