"""The capability gate: may this worker send this capability-specific data? (pure)

AFFINITY.md "Version negotiation and the capability manifest": before the
daemon accepts capability-specific data in a completion (local step records,
a sticky cursor, a session id) it checks, in this order, the negotiated
protocol version, the flat capability, the structured manifest and, for a
sticky cursor, the exact sticky cache identity. A mismatch is a 400 at the
protocol boundary, raised before anything of the completion is applied: the
lease actor calls `check_completion` before it touches its lease or asks the
run. That is what keeps mixed-version fleets safe: a 1.17 worker (or one that
re-registered without the capability) cannot slip a 1.20 payload in.

`GATED_FIELDS` is the one table of which completion field needs which
capability; a new capability-specific field is a row here, nothing else.
Nothing here does I/O: the worker's registration comes in as a mapping.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from .errors import Invalid

__all__ = [
    "CAPABILITIES",
    "GATED_FIELDS",
    "MIN_CAPABILITY_VERSION",
    "WorkerCapabilities",
    "check_completion",
    "gated",
    "version_tuple",
]

#: The three capabilities a 1.18+ manifest must declare (AFFINITY.md).
CAPABILITIES: Final = ("local_steps", "sessions", "sticky")

#: The lowest negotiated version that may declare (and use) a capability.
MIN_CAPABILITY_VERSION: Final = (1, 18)

#: Completion field -> the capability it needs.
GATED_FIELDS: Final[Mapping[str, str]] = {
    "local_steps": "local_steps",
    "session_id": "sessions",
    "sticky_cursor": "sticky",
}

#: The fields of a sticky cursor that name its cache identity (AFFINITY.md
#: "Sticky execution": keyed by exact workflow name, run id and build id).
_STICKY_IDENTITY: Final = ("workflow", "run_id", "build_id")


def version_tuple(version: str) -> tuple[int, int]:
    """``"1.20"`` -> ``(1, 20)`` (a negotiated version, already validated)."""
    major, minor = version.split(".")
    return int(major), int(minor)


@dataclass(frozen=True, slots=True)
class WorkerCapabilities:
    """What a worker's registration says it may send (its ``workers`` record).

    A record written before capabilities existed reads as version 1.0 with none.
    """

    worker_id: str
    protocol_version: str = "1.0"
    capabilities: frozenset[str] = frozenset()
    manifest: Mapping[str, Any] | None = None
    build_id: str | None = None

    @classmethod
    def from_record(cls, raw: Mapping[str, Any]) -> WorkerCapabilities:
        """From the worker's stored registration."""
        manifest = raw.get("manifest")
        return cls(str(raw.get("worker_id") or ""), str(raw.get("protocol_version") or "1.0"),
                   frozenset(raw.get("capabilities") or ()),
                   manifest if isinstance(manifest, Mapping) else None, raw.get("build_id"))

    def supports(self, capability: str) -> bool:
        """Negotiated >= 1.18, declared flat, and marked supported in the manifest."""
        if version_tuple(self.protocol_version) < MIN_CAPABILITY_VERSION:
            return False
        entry = (self.manifest or {}).get(capability)
        return (capability in self.capabilities and isinstance(entry, Mapping)
                and entry.get("status") == "supported")


def gated(body: Mapping[str, Any]) -> bool:
    """Whether a completion carries any capability-specific field (else the gate is free).

    A plain loop: it runs for every ``complete``, and a generator would cost a
    frame per call on the hot path.
    """
    for name in GATED_FIELDS:
        if body.get(name) is not None:
            return True
    return False


def check_completion(worker: WorkerCapabilities, body: Mapping[str, Any], *,
                     sticky_identity: Mapping[str, Any] | None = None) -> None:
    """The gate. Raises on the first mismatch; returns None when the body may be applied.

    Args:
        worker: the registration of the worker that holds the lease.
        body: the parsed completion.
        sticky_identity: the cache identity the lease was issued under
            (``workflow``, ``run_id``, ``build_id``); a sticky cursor must name
            exactly it. None: the caller has no sticky identity to offer, and
            any cursor is refused.

    Raises:
        Invalid: naming the field, and saying which check failed.
    """
    for name, capability in GATED_FIELDS.items():
        if body.get(name) is None:
            continue
        version = version_tuple(worker.protocol_version)
        if version < MIN_CAPABILITY_VERSION:
            raise Invalid(f"{name} needs protocol version 1.18 or later; worker "
                          f"{worker.worker_id} negotiated {worker.protocol_version}", field=name)
        if capability not in worker.capabilities:
            raise Invalid(f"{name} needs the {capability!r} capability, which worker "
                          f"{worker.worker_id} did not declare at register", field=name)
        entry = (worker.manifest or {}).get(capability)
        if not isinstance(entry, Mapping) or entry.get("status") != "supported":
            raise Invalid(f"{name} needs {capability!r} marked supported in worker "
                          f"{worker.worker_id}'s manifest", field=name)
    cursor = body.get("sticky_cursor")
    if cursor is not None:
        if sticky_identity is None or not isinstance(cursor, Mapping):
            raise Invalid("no sticky cache identity matches this lease", field="sticky_cursor")
        for key in _STICKY_IDENTITY:
            if cursor.get(key) != sticky_identity.get(key):
                raise Invalid(f"names {key} {cursor.get(key)!r}, the lease's cache identity has "
                              f"{sticky_identity.get(key)!r}", field=f"sticky_cursor.{key}")
