"""Request validation shared by every transport: strict JSON, ids, bodies, query parameters.

One parser per request body of ``transport/openapi.json`` (``parse_register``,
``parse_claim``, ...). Each refuses what the document refuses: keys it does not
define (at every level except free JSON: ``input``, ``output``, ``payload``,
``progress``, ``correlation``, state patch values, span attributes, the
settings of a manifest capability), wrong types (a bool is not an integer;
``3.0`` is), values out of range, and raises one `Invalid` naming the field
(``error.class``, ``spans[0].usage.model``). Definitions are left to the
engine's own parser (`stepd.sansio.definition.parse_definition`).

The one name the transports import validation by; it is kept in three
modules by what they check:

* `_validate_fields`: ids, integers, names, closed objects, query parameters
  (what every parser is made of);
* `_validate_worker`: what a worker sends (register, claim, session calls,
  ``started``, ``heartbeat``, ``complete``, ``fail``);
* `_validate_api`: what an API client sends (a run's start, signal, cancel,
  retry and fork; prune; a schedule's pause and resume; kill).

Private to `stepd.transport.protocol`, which re-exports what transports use.
"""

from __future__ import annotations

from ._validate_api import (
    MAX_REASON_CHARS,
    parse_cancel,
    parse_fork,
    parse_kill,
    parse_prune,
    parse_retry,
    parse_schedule_action,
    parse_signal,
    parse_start_run,
)
from ._validate_fields import (
    HEX16,
    LEASE_ID,
    NO_BODY,
    PROTOCOL_VERSION,
    RUN_ID,
    RUN_STATUSES,
    SCHEDULE_ID,
    SESSION_ID,
    TERMINAL,
    WORKER_ID,
    check_int,
    check_name,
    is_lease_id,
    is_run_id,
    is_schedule_id,
    is_session_id,
    is_worker_id,
    optional_name,
    query_int,
    query_json,
    query_str,
    query_time,
)
from ._validate_worker import (
    MAX_CLAIM,
    MAX_EPOCH_MS,
    MAX_TOKENS,
    STICKY_COUNTS,
    parse_claim,
    parse_complete,
    parse_fail,
    parse_heartbeat,
    parse_register,
    parse_session_call,
    parse_started,
)

__all__ = [
    "HEX16",
    "LEASE_ID",
    "MAX_CLAIM",
    "MAX_EPOCH_MS",
    "MAX_REASON_CHARS",
    "MAX_TOKENS",
    "NO_BODY",
    "PROTOCOL_VERSION",
    "RUN_ID",
    "RUN_STATUSES",
    "SCHEDULE_ID",
    "SESSION_ID",
    "STICKY_COUNTS",
    "TERMINAL",
    "WORKER_ID",
    "check_int",
    "check_name",
    "is_lease_id",
    "is_run_id",
    "is_schedule_id",
    "is_session_id",
    "is_worker_id",
    "optional_name",
    "parse_cancel",
    "parse_claim",
    "parse_complete",
    "parse_fail",
    "parse_fork",
    "parse_heartbeat",
    "parse_kill",
    "parse_prune",
    "parse_register",
    "parse_retry",
    "parse_schedule_action",
    "parse_session_call",
    "parse_signal",
    "parse_start_run",
    "parse_started",
    "query_int",
    "query_json",
    "query_str",
    "query_time",
]
