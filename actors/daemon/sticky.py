"""Sticky execution at the protocol boundary: a worker's sticky settings and the check of a
completion's sticky data (AFFINITY.md "Sticky execution"; docs/affinity.md).

`register` keeps a worker's sticky settings in its `workers` record when the
negotiated version is at least 1.18, the flat capabilities name ``sticky`` and
the manifest marks it supported. A completion's ``sticky_cursor`` and
``sticky_stats`` pass the shared capability gate (`stepd.sansio.capabilities`:
negotiated version, flat capability, manifest) before anything of it applies;
for the cursor the gate also checks the exact cache identity, which
`sticky_identity` gives it (the lease's run and its workflow, the worker's
registered build id). The run machine then checks the cursor itself against
the run's history (`stepd.sansio.sticky`). Any mismatch is a 400 naming the
field, and nothing of the completion is applied.
"""

from __future__ import annotations

from typing import Any, Final

from stepd.sansio.sticky import StickyClaim, StickyWorker

from .tables import RUN_SUMMARIES

__all__ = ["DEFAULT_SCHEDULE_MS", "claim_of", "settings_of", "sticky_identity", "worker_of"]

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


def sticky_identity(storage: Any, run_id: str, build_id: str | None) -> dict[str, Any]:
    """The cache identity a lease of run `run_id` is issued under, for the capability gate
    (`stepd.sansio.capabilities.check_completion`): the run's workflow, its id, and the
    build id the worker registered.

    The workflow comes from the run's small listing summary, not its record: the
    record holds the very history sticky execution avoids decoding per step.
    """
    summary = storage.get(RUN_SUMMARIES, run_id)
    workflow = summary.get("workflow") if isinstance(summary, dict) else None
    return {"workflow": workflow, "run_id": run_id, "build_id": build_id}


def claim_of(raw_worker: Any, cursor: dict[str, Any]) -> StickyClaim:
    """A completion's sticky cursor, which passed the gate, as the run machine's claim."""
    settings = raw_worker.get("sticky") if isinstance(raw_worker, dict) else None
    schedule = settings.get("schedule_ms") if isinstance(settings, dict) else None
    return StickyClaim(cursor["seq"], cursor["hash"], cursor["workflow"], cursor["build_id"],
                       DEFAULT_SCHEDULE_MS if schedule is None else int(schedule))
