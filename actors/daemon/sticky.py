"""Sticky execution at the protocol boundary: a worker's sticky settings and the check of a
completion's sticky data (AFFINITY.md "Sticky execution"; docs/affinity.md).

`register` keeps a worker's sticky settings in its `workers` record when the
negotiated version is at least 1.18, the flat capabilities name ``sticky`` and
the manifest marks it supported. Before a completion's ``sticky`` part reaches
the run, `check_completion` holds it against that record: the capability, and
the exact cache identity (the cursor's run is the lease's, its build id the
worker's registered one). The run machine then checks the workflow and the
cursor itself (`stepd.sansio.sticky`). Any mismatch is a 400 naming the field,
and nothing of the completion is applied.

This is a local check: the shared capability gate of issue 14 (negotiated
version, flat capability, manifest, for every capability-specific completion
field) takes its place when it lands; `check_completion` is then its sticky row.
"""

from __future__ import annotations

from typing import Any, Final

from stepd.sansio.errors import Invalid
from stepd.sansio.sticky import StickyClaim, StickyWorker

__all__ = ["DEFAULT_SCHEDULE_MS", "check_completion", "settings_of", "worker_of"]

#: How long a run's next step waits for the worker that ran its previous one
#: when the worker's manifest does not say (Temporal's sticky schedule-to-start).
DEFAULT_SCHEDULE_MS: Final = 5000


def _at_least_1_18(version: Any) -> bool:
    try:
        major, minor = (int(p) for p in str(version).split("."))
    except ValueError:
        return False
    return (major, minor) >= (1, 18)


def settings_of(negotiated: str, capabilities: list[str], manifest: Any) -> dict[str, Any] | None:
    """The sticky settings a registration declares, or None (no sticky execution)."""
    if "sticky" not in capabilities or not _at_least_1_18(negotiated) \
            or not isinstance(manifest, dict):
        return None
    entry = manifest.get("sticky")
    if not isinstance(entry, dict) or entry.get("status") != "supported":
        return None
    out = {k: entry[k] for k in ("capacity", "max_bytes", "ttl_ms") if k in entry}
    out["schedule_ms"] = int(entry.get("schedule_ms", DEFAULT_SCHEDULE_MS))
    return out


def worker_of(worker_id: str, raw: Any) -> StickyWorker | None:
    """What an offer needs of a registered worker (its `workers` record), or None."""
    if not isinstance(raw, dict) or not isinstance(raw.get("sticky"), dict):
        return None
    return StickyWorker(worker_id, raw.get("build_id"), int(raw["sticky"]["schedule_ms"]))


def check_completion(raw_worker: Any, run_id: str, cursor: dict[str, Any] | None
                     ) -> StickyClaim | None:
    """A completion's sticky cursor, checked against the worker and the lease.

    Raises:
        Invalid: the worker did not negotiate sticky execution (``sticky``), or
            the cursor names another run or build (``sticky.cursor.*``).
    """
    if not isinstance(raw_worker, dict) or not isinstance(raw_worker.get("sticky"), dict) \
            or not _at_least_1_18(raw_worker.get("protocol_version")):
        raise Invalid("this worker did not negotiate sticky execution (protocol 1.18 or "
                      "later, the sticky capability, the manifest marking it supported)",
                      field="sticky")
    if cursor is None:
        return None
    if cursor["run_id"] != run_id:
        raise Invalid("names another run than the lease's", field="sticky.cursor.run_id")
    if cursor["build_id"] != raw_worker.get("build_id"):
        raise Invalid("is not the build id this worker registered",
                      field="sticky.cursor.build_id")
    return StickyClaim(cursor["seq"], cursor["hash"], cursor["workflow"], cursor["build_id"],
                       int(raw_worker["sticky"]["schedule_ms"]))
