"""The garbage-collector settings a stepd daemon runs with.

CPython's cyclic GC runs a *full* collection, walking every live object,
each time the objects that survived two young collections reach a quarter of
the long-lived heap. A daemon under load keeps thousands of runs in flight,
each living for a few seconds: nearly all of their objects survive the young
collections (700 allocations apart by default), so full collections come
every few thousand steps, and each walks the whole heap. Measured with
``python -m bench --only B --transport websocket``: the daemon spent about a
third of its CPU in the collector, and throughput rose by about a third with
it switched off.

`tune_gc` keeps the collector on (reference cycles still get collected) but
makes full passes rare and cheaper:

* ``gc.freeze()`` moves everything alive at startup (modules, classes,
  functions: ~50,000 objects) out of the collector's sight for good;
* the young generation's threshold goes from 700 to 10,000 allocations, so
  most objects of a request or a step are freed by reference counting before
  any collection sees them, and fewer reach the old generation.

Memory is bounded the same way as before: only cyclic garbage waits longer
(stepd's actors leave none when they end, see `Runtime.release`), and RSS
under bench B and E is unchanged within noise.

``stepd serve`` calls it at startup (``--gc default`` keeps CPython's
settings).

An embedded daemon lives in your process, so it does only the half that
cannot hurt a host: `young_threshold` raises the young generation's
threshold while the daemon is open and puts the host's back when it closes
(``stepd.embedded(path, gc="young")``, the default). Cyclic garbage of the
host is still collected, at most 10,000 allocations later; nothing is frozen.
The freeze stays a choice of the application (``gc="tuned"``, or
`tune_gc` at its own startup): it is what made the difference in bench B
(issue 16: CPU per embedded B ~10 % lower with either, and a freeze is
permanent for what is alive at that moment, a host's objects included).
``gc="default"`` leaves the collector alone.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["GC_POLICIES", "YOUNG_THRESHOLD", "gc_policy", "tune_gc", "young_threshold"]

GC_POLICIES = ("young", "tuned", "default")
"""What ``stepd.embedded(gc=...)`` accepts: the young threshold while open (default),
`tune_gc` (freeze too, for good), or the collector left as it is."""

YOUNG_THRESHOLD = 10_000
"""Allocations (minus deallocations) between two young collections."""


def tune_gc() -> None:
    """Freeze what is alive now and raise the young generation's threshold.

    Process-wide; call it once, after imports and startup, before the work.
    """
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, older, oldest)


@contextlib.contextmanager
def young_threshold() -> Iterator[None]:
    """The young generation's threshold at `YOUNG_THRESHOLD` inside, the host's after.

    Restored only if nobody changed it meanwhile (a host that set its own wins).
    Nothing is frozen and the older generations keep their thresholds.
    """
    before = gc.get_threshold()
    if before[0] == 0 or before[0] >= YOUNG_THRESHOLD:  # collection off, or higher already
        yield
        return
    ours = (YOUNG_THRESHOLD, *before[1:])
    gc.set_threshold(*ours)
    try:
        yield
    finally:
        if gc.get_threshold() == ours:
            gc.set_threshold(*before)


@contextlib.contextmanager
def gc_policy(policy: str) -> Iterator[None]:
    """One of `GC_POLICIES` for the duration of an embedded daemon (`tune_gc` stays)."""
    if policy == "young":
        with young_threshold():
            yield
        return
    if policy == "tuned":
        tune_gc()
    yield
