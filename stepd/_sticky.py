"""Sticky execution in the worker (mixed into `stepd.Worker`; AFFINITY.md "Sticky execution",
docs/affinity.md).

Off unless the worker is built with ``sticky_cache_capacity > 0``. Then its
register (`stepd._manifest.capability_declaration`) adds the flat capability
``sticky`` and marks it supported in the manifest, stating the cache settings
(`_sticky_manifest`); that needs protocol 1.18 or later. A lease with a ``sticky``
part gets its history from the cache (`stepd.sansio.sticky_cache`) before the
body runs; a delta the cache cannot serve is replaced by the full history
fetched for that lease (``history``, fenced to it), counted as a forced cold
replay. The body sees exactly what a lease without sticky execution carries:
``steps`` (its third argument) and ``ctx.state``. Its ``complete`` reports the
cursor it cached (so the daemon sends it the next delta) and the counts.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Final

from stepd._errors import Invalid
from stepd.sansio.sticky_cache import Fetch, StickyCache

if TYPE_CHECKING:
    from stepd._bodies import Active

log = logging.getLogger("stepd.worker")

DEFAULT_CACHE_BYTES: Final = 64 << 20
DEFAULT_CACHE_TTL_S: Final = 600.0


def _now_ms() -> int:
    return time.monotonic_ns() // 1_000_000


class StickyHistory:
    """The worker's sticky half; it reads the worker's state below."""

    name: str
    build_id: str | None
    _lease_ttl_s: float

    if TYPE_CHECKING:  # `stepd._calls.LeaseCalls`
        async def _call(self, op: str, lease_id: str, body: dict[str, Any], *,
                        give_up_s: float | None = None, after: Active | None = None,
                        started: Active | None = None) -> dict[str, Any]: ...

    def _init_sticky(self, capacity: int, max_bytes: int, ttl: float,
                     schedule_ms: int | None) -> None:
        for name, value in (("sticky_cache_capacity", capacity),
                            ("sticky_cache_bytes", max_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise Invalid("must be an integer >= 0", field=name)
        if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not ttl > 0:
            raise Invalid("must be a number of seconds > 0", field="sticky_cache_ttl")
        if schedule_ms is not None and (isinstance(schedule_ms, bool)
                                        or not isinstance(schedule_ms, int)
                                        or not 0 <= schedule_ms <= 3_600_000):
            raise Invalid("must be an integer from 0 to 3600000", field="sticky_schedule_ms")
        self._sticky_schedule_ms = schedule_ms
        self.sticky_cache: StickyCache | None = None
        if capacity > 0:
            if max_bytes < 1:
                raise Invalid("must be > 0 with a sticky cache", field="sticky_cache_bytes")
            self.sticky_cache = StickyCache(capacity, max_bytes, max(1, int(ttl * 1000)),
                                            self.build_id)

    def _sticky_manifest(self) -> dict[str, Any] | None:
        """The cache settings the manifest's ``sticky`` entry states (None when it is off)."""
        cache = self.sticky_cache
        if cache is None:
            return None
        sticky: dict[str, Any] = {"capacity": cache.capacity, "max_bytes": cache.max_bytes,
                                  "ttl_ms": cache.ttl_ms}
        if self._sticky_schedule_ms is not None:
            sticky["schedule_ms"] = self._sticky_schedule_ms
        return sticky

    async def _sticky_history(self, active: Active) -> None:
        """Fill the lease's ``steps`` and ``state`` from the cache (or a fetch) before the body.

        Raises:
            the answer of the history fetch (a conflict, NotFound...) or Lost.
        """
        cache = self.sticky_cache
        lease = active.lease
        if cache is None:
            return
        found = cache.resolve(lease, _now_ms())
        if isinstance(found, Fetch):
            log.info("worker %s: lease %s of run %s: sticky cache cannot serve it (%s); "
                     "fetching the full history", self.name, lease["lease_id"], lease["run_id"],
                     found.why)
            answer = await self._call("history", lease["lease_id"], {},
                                      give_up_s=max(30.0, 2 * self._lease_ttl_s))
            found = cache.fetched(lease, answer, _now_ms())
        lease["steps"], lease["state"] = found.steps, found.state
        active.sticky_cursor = found.cursor

    def _sticky_complete(self, active: Active, body: dict[str, Any]) -> None:
        """Add the cursor cached for this lease and the counts to a complete body."""
        cache = self.sticky_cache
        if cache is not None:
            if active.sticky_cursor is not None:
                body["sticky_cursor"] = active.sticky_cursor
            body["sticky_stats"] = cache.stats.as_dict()

    def _sticky_forget(self, run_id: str) -> None:
        if self.sticky_cache is not None:
            self.sticky_cache.forget_run(run_id)
