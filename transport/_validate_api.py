"""The bodies an API client sends, one parser each (``transport/openapi.json``):
starting, signalling, cancelling, retrying and forking a run, pruning runs,
pausing and resuming a schedule, killing an actor.

Each refuses what the document refuses (`_validate_fields`) with one `Invalid`
naming the field.
"""

from __future__ import annotations

from typing import Any, Final

from stepd.sansio.errors import Invalid

from ._validate_fields import (
    body_object,
    body_or_empty,
    check_int,
    check_keys,
    check_name,
    optional_name,
    query_int,
    query_time,
    required,
)

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
    """``StartRunRequest`` -> arguments of `Daemon.start_run`.

    Every start pays for this, so the usual body (short names and key, no
    deadline) is checked here in a few C calls: a string of at most 32
    characters is at most 128 bytes of UTF-8 (64 and 256 for the key), so no
    encoding is needed to know it fits. Anything else, and every refusal, takes
    `_parse_start_run`'s checks, field by field.
    """
    if type(body) is dict:
        for name in body:
            if name not in _START_KEYS:
                break
        else:
            workflow = body.get("workflow")
            version = body.get("version")
            key = body.get("idempotency_key")
            if (type(workflow) is str and 0 < len(workflow) <= 32 and "input" in body
                    and (version is None or (type(version) is str and 0 < len(version) <= 32))
                    and (key is None or (type(key) is str and 0 < len(key) <= 64))
                    and body.get("deadline_ms") is None):
                return {
                    "workflow": workflow,
                    "input": body["input"],
                    "version": version,
                    "correlation": body.get("correlation"),
                    "idempotency_key": key,
                    "deadline_ms": None,
                }
    return _parse_start_run(body)


def _parse_start_run(body: Any) -> dict[str, Any]:
    """`parse_start_run`, each field checked by its helper (the refusals name it)."""
    b = body_object(body)
    check_keys(b, _START_KEYS, "")
    workflow = check_name(required(b, "workflow", ""), "workflow")
    input_ = required(b, "input", "")
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
    b = body_object(body)
    check_keys(b, frozenset({"name", "payload"}), "")
    return {"name": check_name(required(b, "name", ""), "name"), "payload": b.get("payload")}


#: The longest cancel reason (characters): it is journaled and shown in the run's status.
MAX_REASON_CHARS: Final = 1000


def parse_cancel(body: Any) -> dict[str, Any]:
    """``CancelRequest``: ``{"reason"?}`` (or no body)."""
    b = body_or_empty(body)
    check_keys(b, frozenset({"reason"}), "")
    reason = b.get("reason")
    if reason is not None and (not isinstance(reason, str) or not reason
                               or len(reason) > MAX_REASON_CHARS):
        raise Invalid(f"must be a non-empty string of at most {MAX_REASON_CHARS} characters, "
                      "or null", field="reason")
    return {"reason": reason}


def parse_retry(body: Any) -> None:
    """``RetryRequest``: ``{}`` (or no body)."""
    check_keys(body_or_empty(body), frozenset(), "")


def parse_fork(body: Any) -> dict[str, Any]:
    """``ForkRequest``: ``{"from_step", "idempotency_key"?}``."""
    b = body_object(body)
    check_keys(b, frozenset({"from_step", "idempotency_key"}), "")
    return {"from_step": check_name(required(b, "from_step", ""), "from_step"),
            "idempotency_key": _idempotency_key(b.get("idempotency_key"))}


def parse_kill(body: Any) -> str:
    """``KillRequest`` -> the actor path."""
    b = body_object(body)
    check_keys(b, frozenset({"path"}), "")
    path = required(b, "path", "")
    if not isinstance(path, str) or not path.startswith("/") or len(path) > 1024:
        raise Invalid("must be an actor path such as /runs/r_...", field="path")
    return path


def parse_prune(body: Any) -> dict[str, Any]:
    """``PruneRequest`` -> ``before``, ``idempotency_keys_before`` (epoch ms) and ``limit``."""
    b = body_object(body)
    check_keys(b, frozenset({"before", "idempotency_keys_before", "limit"}), "")
    if b.get("before") is None:
        raise Invalid("is required: epoch milliseconds or an ISO-8601 timestamp", field="before")
    before = query_time(b, "before")
    keys = query_time(b, "idempotency_keys_before")
    limit = query_int(b, "limit", 10_000, minimum=1, maximum=100_000)
    return {"before": before, "idempotency_keys_before": keys, "limit": limit}


def parse_schedule_action(body: Any) -> None:
    """``ScheduleActionRequest`` (pause, resume): ``{}`` or no body."""
    check_keys(body_or_empty(body), frozenset(), "")
