"""The checks every request body and query parameter is made of: ids, integers,
names, patterns, closed objects, and the query parameters themselves.

Each raises one `Invalid` naming the field (a 400); the parsers of the bodies
(`_validate_worker`, `_validate_api`) are built from these, and
`stepd.transport._validate` re-exports what the protocol uses.
"""

from __future__ import annotations

import datetime
import math
import re
from collections.abc import Mapping
from typing import Any, Final, TypeGuard

from stepd.sansio.errors import Invalid, field_path

from ._json import copy_json, decode_json

NO_BODY: Final = object()
"""The ``body`` of a call that carried none (an empty HTTP body)."""

# -- ids and fields -------------------------------------------------------------------------

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

MISSING: Final = object()
"""A key absent from a body (`None` is a value the wire may carry)."""


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


def check_object(value: Any, field: str | None) -> dict[str, Any]:
    if not isinstance(value, dict):
        if field is None:
            raise Invalid("the body must be a JSON object")
        raise Invalid("must be an object", field=field)
    return value


def check_keys(obj: Mapping[str, Any], allowed: frozenset[str], prefix: str) -> None:
    """Refuse the first key ``obj`` holds that ``allowed`` does not (400 naming it)."""
    for key in obj:
        if key not in allowed:
            raise Invalid("unknown key", field=field_path(prefix, key))


def required(obj: Mapping[str, Any], key: str, prefix: str) -> Any:
    value = obj.get(key, MISSING)
    if value is MISSING:
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


def check_pattern(value: Any, field: str, pattern: re.Pattern[str], what: str,
                  max_len: int) -> str:
    if not isinstance(value, str) or len(value) > max_len or pattern.fullmatch(value) is None:
        raise Invalid(f"must be {what}", field=field)
    return value


# -- a body as a whole -----------------------------------------------------------------------


def body_or_empty(body: Any) -> dict[str, Any]:
    """The body of a call whose body may be omitted (``started``, ``heartbeat``, ``cancel``)."""
    if body is NO_BODY:
        return {}
    return check_object(body, None)


def body_object(body: Any) -> dict[str, Any]:
    if body is NO_BODY:
        raise Invalid("a JSON object body is required")
    return check_object(body, None)


# -- query parameters (strings over HTTP; ints or strings in process) -----------------------

_QUERY_INT_MAX: Final = 10**18 - 1  # what `_DIGITS` reads: 18 digits at most


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
