"""What the worker declares at register: its protocol version and capability manifest.

AFFINITY.md "Version negotiation and the capability manifest": from 1.18 a
worker declares each of ``local_steps``, ``sessions`` and ``sticky`` as
``supported`` or ``rejected``, and lists in the flat ``capabilities`` only
what it supports. A worker declares only what is implemented *and enabled*
(the manifest's truthfulness is a scenario of tests/affinity/scenarios.toml):
this SDK marks ``local_steps`` supported only on a worker started with
``local_steps=True``, ``sessions`` only on one started with ``max_sessions``
above 0 (its entry then carries ``resources`` and ``max_sessions``), and
``sticky`` only on one with a sticky cache (``sticky_cache_capacity > 0``; its
entry then states the cache settings, `stepd._sticky`). Below 1.18 it declares
nothing, as a 1.17 worker does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from stepd._errors import Invalid
from stepd.sansio.capabilities import CAPABILITIES, MIN_CAPABILITY_VERSION

__all__ = ["PROTOCOL_VERSION", "capability_declaration", "check_protocol_version"]

#: The newest protocol version this SDK speaks (and registers with by default).
PROTOCOL_VERSION: Final = "1.20"


def _version(value: str) -> tuple[int, int] | None:
    parts = value.split(".") if isinstance(value, str) else []
    if len(parts) != 2 or not all(p.isdigit() and len(p) <= 4 for p in parts):
        return None
    return int(parts[0]), int(parts[1])


def check_protocol_version(value: Any, local_steps: bool, sessions: bool = False,
                           sticky: bool = False) -> str:
    """Validate the worker's ``protocol_version`` option against what it enables.

    Raises:
        Invalid: not ``"MAJOR.MINOR"``, or a capability enabled below 1.18.
    """
    version = _version(value)
    if version is None:
        raise Invalid('must be a "MAJOR.MINOR" string such as "1.20"', field="protocol_version")
    for name, on in (("local_steps", local_steps), ("max_sessions", sessions),
                     ("sticky execution", sticky)):
        if on and version < MIN_CAPABILITY_VERSION:
            raise Invalid(f"{name} needs protocol version 1.18 or later",
                          field="protocol_version")
    return str(value)


def capability_declaration(protocol_version: str, *, local_steps: bool,
                           sessions: Mapping[str, Any] | None = None,
                           sticky: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The ``capabilities`` and ``manifest`` fields of the register body (empty below 1.18).

    Args:
        sessions: the ``sessions`` manifest entry's details (``resources``,
            ``max_sessions``) on a worker that holds worker sessions; None: it
            holds none, and ``sessions`` is declared rejected.
        sticky: the worker's sticky cache settings (``capacity``, ``max_bytes``,
            ``ttl_ms``, maybe ``schedule_ms``), or None: sticky execution is off.
    """
    version = _version(protocol_version)
    if version is None or version < MIN_CAPABILITY_VERSION:
        return {}
    details = {"sessions": sessions, "sticky": sticky}
    enabled = {"local_steps": local_steps, "sessions": sessions is not None,
               "sticky": sticky is not None}
    manifest: dict[str, dict[str, Any]] = {
        cap: {"status": "supported" if enabled.get(cap) else "rejected"} for cap in CAPABILITIES}
    for cap, entry in details.items():
        if entry is not None:
            manifest[cap].update(entry)
    return {"capabilities": [cap for cap in CAPABILITIES if enabled.get(cap)],
            "manifest": manifest}
