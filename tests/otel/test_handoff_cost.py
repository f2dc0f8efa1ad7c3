"""What span export costs the daemon's process, counted (not timed): calls per write.

The event loop's share (`SpanExport.committed`) and the export thread's
(`SpanExport._frame`, packing what is queued) are counted with a profile
hook on this thread, over writes as the run actor hands them over. Both
must not grow with what a write holds: a journal of 20 entries costs the
same Python calls as one of 1 (the entries are packed by msgpack, in C).
docs/otel.md, "What export costs", has the figures per step.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import pytest

from stepd._otel_child import writes_of
from stepd.actors.daemon.store import RunWrite
from stepd.otel import PACK_CHUNK, SpanExport

pytestmark = pytest.mark.timeout(60)

WRITES = 600


def write(i: int, entries: int, ends: bool) -> RunWrite:
    journal: list[dict[str, Any]] = [
        {"seq": n, "type": "step_completed", "at": 1_000 + n, "step_id": f"s{n}", "attempt": 1,
         "fence": 1, "lease_id": f"l_{i}_{n}", "worker_id": "w_1", "output": n}
        for n in range(entries)]
    if ends:
        journal.append({"seq": entries, "type": "run_completed", "at": 2_000, "result": i})
    leases = [{"lease_id": f"l_{i}_0", "delivery": "at_least_once", "offered_at": 999}]
    return RunWrite(run_id=f"r_{i}", record={"workflow": "wf", "created_at": 900, "hash": "h",
                                             "steps": {"s0": {"output": "x" * 50}}},
                    journal=journal, leases=leases)


def counted(fn: Callable[[], Any]) -> tuple[int, int, Any]:
    """(Python calls, C calls, result) of ``fn()`` on this thread, ``fn`` itself not counted."""
    counts = {"call": 0, "c_call": 0}

    def hook(_frame: Any, event: str, _arg: Any) -> None:
        if event in counts:
            counts[event] += 1

    sys.setprofile(hook)
    try:
        result = fn()
    finally:
        sys.setprofile(None)
    return counts["call"] - 1, counts["c_call"] - 1, result  # minus fn, minus setprofile


def test_handing_a_write_over_is_one_call_and_two_c_calls_whatever_it_holds() -> None:
    for entries in (1, 20):
        export = SpanExport("http://127.0.0.1:4318")  # not started: nothing drains
        writes = [write(i, entries, ends=i % 3 == 0) for i in range(WRITES)]

        def hand_over(export: SpanExport = export, writes: list[RunWrite] = writes) -> None:
            for w in writes:
                export.committed(w)

        python, c, _ = counted(hand_over)
        assert python == WRITES  # `committed` itself, nothing under it
        assert c <= 2 * WRITES + 1  # len() and deque.append (and one wake)
        assert export.statistics().queued == WRITES


def test_packing_costs_one_python_call_per_write_not_per_entry() -> None:
    """One Python call per write (and per ended run, and per chunk); per journal entry only
    the C call that looks at its type (``dict.get``)."""
    found, c_calls = {}, {}
    for entries in (1, 20):
        export = SpanExport("http://127.0.0.1:4318")
        for i in range(WRITES):
            export.committed(write(i, entries, ends=i % 3 == 0))
        python, c_calls[entries], (frame, taken) = counted(export._frame)
        assert taken == WRITES and export.statistics().queued == 0
        chunks = -(-WRITES // PACK_CHUNK)
        ended = -(-WRITES // 3)
        # `_wire` per write, the record's few fields per ended run, a comprehension per chunk
        assert python <= WRITES + ended + chunks + 1
        found[entries] = python
        # ...and what crossed is what the child reads: every write, whole, in order
        got = writes_of(frame[4:])
        assert int.from_bytes(frame[:4], "big") == len(frame) - 4
        assert [w[0] for w in got] == [f"r_{i}" for i in range(WRITES)]
        assert [len(w[2]) for w in got] == [entries + (i % 3 == 0) for i in range(WRITES)]
        assert got[0][1] == {"workflow": "wf", "version": None, "hash": "h", "created_at": 900,
                             "correlation": None, "idempotency_key": None, "parent": None,
                             "input_tokens": None, "output_tokens": None, "cost_usd": None}
        assert got[1][1] is None  # no run end: no record
    assert found[1] == found[20]  # no Python per journal entry
    assert c_calls[20] - c_calls[1] <= 19 * WRITES  # one C call per entry, no more


def test_a_frame_stops_taking_writes_past_its_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """Outputs cross whole: past `FRAME_BYTES` a frame ends after its current chunk, and the
    rest waits for the next frame (nothing dropped)."""
    monkeypatch.setattr("stepd.otel.FRAME_BYTES", 1)
    export = SpanExport("http://127.0.0.1:4318")
    for i in range(WRITES):
        export.committed(write(i, 1, ends=False))
    sizes = []
    while export.statistics().queued:
        frame, taken = export._frame()
        sizes.append(taken)
        assert len(writes_of(frame[4:])) == taken
    assert sizes == [PACK_CHUNK, PACK_CHUNK, WRITES - 2 * PACK_CHUNK]
