"""A definition's worker sessions ("affinity sessions"): the ``sessions`` block and its rules.

AFFINITY.md "Worker sessions". A definition may declare named sessions::

    "sessions": {"gpu": {"requirements": {"gpu": "a100"}, "queue": "gpu",
      "lease_ms": 30000, "ttl_ms": 600000, "max_concurrent": 2,
      "reacquire": "same_requirements"}}

and task or for_each steps opt in with ``"session": "gpu"``: every step of
that session in one run goes to the worker holding it.

Naming: these are *work sessions* (`WorkSession`, ids ``ws_...``), pinned to
one run, not the daemon's per-worker connection sessions of
`stepd.sansio.session` (`SessionMachine`, actors ``/sessions/w_...``). Both
live under the ``/sessions`` supervisor; docs/affinity.md "Worker sessions".

Pure: no I/O. Parsing raises `Invalid` naming the field
(``sessions.gpu.lease_ms``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from .enums import IdentityEnum
from .errors import Invalid

__all__ = [
    "DEFAULT_LEASE_MS",
    "DEFAULT_TTL_MS",
    "Reacquire",
    "SessionSpec",
    "parse_sessions",
    "resources_match",
    "work_session_id",
]

DEFAULT_LEASE_MS: Final = 30_000
DEFAULT_TTL_MS: Final = 600_000
#: Longest lease or TTL a session may name: ten years, as every duration of a definition.
_MAX_MS: Final = 10 * 365 * 24 * 3600 * 1000
_KEYS: Final = ("requirements", "queue", "lease_ms", "ttl_ms", "max_concurrent", "reacquire")
_NAME: Final = re.compile(r"[A-Za-z0-9_-]{1,64}")


class Reacquire(IdentityEnum):
    """What happens when a session's holder is lost (AFFINITY.md)."""

    SAME_REQUIREMENTS = "same_requirements"  # a matching worker takes it over, same TTL
    NEVER = "never"  # the run fails with reason `session_lost`


@dataclass(frozen=True, slots=True)
class SessionSpec:
    """One named session of a definition, every default filled in."""

    name: str
    requirements: Mapping[str, Any] = field(default_factory=dict)
    queue: str | None = None
    lease_ms: int = DEFAULT_LEASE_MS
    ttl_ms: int = DEFAULT_TTL_MS
    max_concurrent: int = 1
    reacquire: Reacquire = Reacquire.SAME_REQUIREMENTS

    def to_json(self) -> dict[str, Any]:
        """The wire form, every default present (part of `definition_hash`)."""
        return {
            "requirements": dict(self.requirements),
            "queue": self.queue,
            "lease_ms": self.lease_ms,
            "ttl_ms": self.ttl_ms,
            "max_concurrent": self.max_concurrent,
            "reacquire": self.reacquire.text,
        }


def work_session_id(run_id: str, name: str) -> str:
    """The id of run `run_id`'s session `name`: derived, so creating it is idempotent.

    One session per run and name; it is also its actor's name under ``/sessions``.
    """
    return f"ws_{run_id}.{name}"


def resources_match(requirements: Mapping[str, Any], resources: Any) -> bool:
    """Every requirement is a resource of the worker's manifest with the same value."""
    if not isinstance(resources, Mapping):
        return not requirements
    return all(k in resources and resources[k] == v for k, v in requirements.items())


def parse_sessions(obj: Any) -> dict[str, SessionSpec]:
    """Validate a definition's ``sessions`` object.

    Raises:
        Invalid: the first problem, ``field`` as ``sessions.<name>.<key>``.
    """
    if not isinstance(obj, Mapping):
        raise Invalid("must be an object of named sessions", field="sessions")
    out: dict[str, SessionSpec] = {}
    for name, raw in obj.items():
        where = f"sessions.{name}"
        if not isinstance(name, str) or _NAME.fullmatch(name) is None:
            raise Invalid("a session name is 1 to 64 letters, digits, '_' or '-'",
                          field=where)
        if not isinstance(raw, Mapping):
            raise Invalid("must be an object", field=where)
        for key in raw:
            if key not in _KEYS:
                raise Invalid(f"unknown key; expected one of {', '.join(_KEYS)}",
                              field=f"{where}.{key}")
        out[name] = SessionSpec(
            name=name,
            requirements=_requirements(raw.get("requirements", {}), f"{where}.requirements"),
            queue=_queue(raw.get("queue"), f"{where}.queue"),
            lease_ms=_int(raw.get("lease_ms", DEFAULT_LEASE_MS), f"{where}.lease_ms"),
            ttl_ms=_int(raw.get("ttl_ms", DEFAULT_TTL_MS), f"{where}.ttl_ms"),
            max_concurrent=_int(raw.get("max_concurrent", 1), f"{where}.max_concurrent",
                                maximum=10_000),
            reacquire=_reacquire(raw.get("reacquire", "same_requirements"),
                                 f"{where}.reacquire"),
        )
    return out


def _requirements(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise Invalid("must be an object of resource names to values", field=where)
    out: dict[str, Any] = {}
    for k, v in value.items():
        if not isinstance(k, str) or not k:
            raise Invalid("a resource name is a non-empty string", field=where)
        if isinstance(v, (dict, list)) or v is None:
            raise Invalid("must be a string, number or boolean", field=f"{where}.{k}")
        out[k] = v
    return out


def _queue(value: Any, where: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or _NAME.fullmatch(value) is None:
        raise Invalid("must be 1 to 64 letters, digits, '_' or '-'", field=where)
    return value


def _int(value: Any, where: str, *, maximum: int = _MAX_MS) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= maximum:
        raise Invalid(f"must be an integer from 1 to {maximum}", field=where)
    return value


def _reacquire(value: Any, where: str) -> Reacquire:
    for member in Reacquire:
        if member.text == value:
            return member
    raise Invalid('must be "same_requirements" or "never"', field=where)
