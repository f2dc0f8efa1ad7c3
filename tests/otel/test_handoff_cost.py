"""What span export costs the daemon's process, counted (not timed): calls per write.

The event loop's whole share is `SpanExport.committed`: it packs the write
(one msgpack call, in C) onto a buffer and keeps nothing of it. Counted with
a profile hook on this thread, over writes as the run actor hands them over:
its Python calls must not grow with what a write holds (a journal of 20
entries costs what one of 1 costs), and what reaches the child is every
write, whole, in order. docs/otel.md, "What export costs", has the figures
per step.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import pytest

from stepd._otel_child import writes_of
from stepd._otel_wire import RUN_FIELDS
from stepd.actors.daemon.store import RunWrite
from stepd.otel import SpanExport

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
                                             "status": "completed" if ends else "running",
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


def test_handing_a_write_over_packs_it_in_c_whatever_it_holds(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Per write: `committed` itself, and C calls a fixed number: the status look-up, the
    pack, the buffer's length; a run's end adds its fields (map, tuple). No flush here (not
    started, and the buffer's bound raised), so what is counted is the hand-off alone."""
    monkeypatch.setattr("stepd.otel.FLUSH_BYTES", 1 << 30)
    found = {}
    for entries in (1, 20):
        export = SpanExport("http://127.0.0.1:4318")  # not started: nothing leaves
        writes = [write(i, entries, ends=i % 3 == 0) for i in range(WRITES)]

        def hand_over(export: SpanExport = export, writes: list[RunWrite] = writes) -> None:
            for w in writes:
                export.committed(w)

        python, c, _ = counted(hand_over)
        ended = -(-WRITES // 3)
        assert python <= WRITES + 2  # `committed`, and arming its one flush (not started)
        assert c <= 3 * WRITES + 2 * ended + 2
        found[entries] = (python, c)
        assert export.statistics().queued == WRITES
        # ...and what is packed is what the child reads: every write, whole, in order
        got = writes_of(bytes(export._buf))
        assert [w[0] for w in got] == [f"r_{i}" for i in range(WRITES)]
        assert [len(w[2]) for w in got] == [entries + (i % 3 == 0) for i in range(WRITES)]
        assert got[0][2] == writes[0].journal and got[0][3] == writes[0].leases
        assert dict(zip(RUN_FIELDS, got[0][1])) == {
            "workflow": "wf", "version": None, "hash": "h", "created_at": 900,
            "correlation": None, "idempotency_key": None, "parent": None,
            "input_tokens": None, "output_tokens": None, "cost_usd": None}
        assert got[1][1] is None  # the run goes on: no run fields
    assert found[1] == found[20]  # nothing per journal entry


def test_a_full_pipe_keeps_the_rest_for_the_next_flush() -> None:
    """A pipe that takes part of what is packed: the rest stays packed, in order, and goes
    at a later flush; nothing is dropped, nothing waits."""
    export = SpanExport("http://127.0.0.1:4318")
    for i in range(WRITES):
        export.committed(write(i, 5, ends=False))
    packed = bytes(export._buf)
    read, written = os.pipe()
    try:
        os.set_blocking(written, False)
        export._fd = written  # a pipe nobody reads yet, in place of the child's
        export._flush()
        left = bytes(export._buf)
        assert 0 < len(left) < len(packed)  # the pipe (64 KiB) took part...
        assert packed.endswith(left)  # ...and the rest waits, in order
        export._flush()  # full: nothing taken, nothing lost
        assert bytes(export._buf) == left
        first = os.read(read, len(packed))
        assert first == packed[:len(packed) - len(left)]
        rest = b""
        while export._buf:
            export._flush()
            rest += os.read(read, 1 << 20)
        assert first + rest == packed
        assert [w[0] for w in writes_of(first + rest)] == [f"r_{i}" for i in range(WRITES)]
        assert export.statistics().dropped == 0
    finally:
        export._fd = None
        os.close(read)
        os.close(written)


def test_past_its_bound_the_buffer_goes_down_the_pipe_without_the_timer(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`FLUSH_BYTES` packed: written at once, without waiting for the period's timer."""
    monkeypatch.setattr("stepd.otel.FLUSH_BYTES", 4096)
    export = SpanExport("http://127.0.0.1:4318")
    read, written = os.pipe()
    try:
        os.set_blocking(written, False)
        export._fd = written
        export._loop = object()  # type: ignore[assignment]  # an event loop never reached:
        export._armed = True     # the period's timer is pending, and not what flushes here
        for i in range(40):
            export.committed(write(i, 5, ends=False))
            assert len(export._buf) < 4096  # it went down the pipe once past the bound
        sent = os.read(read, 1 << 20)
        assert sent  # without the timer
        assert [w[0] for w in writes_of(sent + bytes(export._buf))] == [
            f"r_{i}" for i in range(40)]
    finally:
        export._fd = None
        os.close(read)
        os.close(written)
