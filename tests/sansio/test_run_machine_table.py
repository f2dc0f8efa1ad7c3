"""The transition table tells the truth: random event sequences never leave it.

Hypothesis drives a run machine through random but plausible event sequences
(offers of queued slots, starts, completions with jumps and patches, failures
of every class, losses, signals, ticks at random times, cancels, retries) and checks,
after every event:

* the resulting status is one `TRANSITIONS` declares for (status, event);
* the journal's sequence numbers are contiguous;
* the record survives a round trip through its stored form;
* an event that raised changed nothing.
"""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stepd.sansio.definition import parse_definition
from stepd.sansio.errors import Conflict, Invalid
from stepd.sansio.events import (
    AttemptCompleted,
    AttemptFailed,
    AttemptLost,
    AttemptOffered,
    AttemptStarted,
    AttemptUnservable,
    Cancel,
    Retry,
    SignalReceived,
    Tick,
)
from stepd.sansio.record import RunRecord
from stepd.sansio.run import TRANSITIONS, RunMachine
from stepd.sansio.status import SlotPhase

DEFINITION = parse_definition(
    {
        "name": "mix",
        "steps": [
            {"id": "a", "kind": "task", "body": "a", "retry": {"max_attempts": 3, "initial_backoff_ms": 5},
             "timeout_ms": 50},
            {"id": "fan", "kind": "for_each", "items": "${input.xs}", "body": "f", "into": "out",
             "max_parallel": 2},
            {"id": "gate", "kind": "wait", "event": "go", "timeout_ms": 200, "into": "gate"},
            {"id": "nap", "kind": "sleep", "duration_ms": 10},
            {"id": "b", "kind": "task", "body": "b", "delivery": "at_most_once"},
        ],
        "budgets": {"max_transitions": 12, "max_state_bytes": 400, "max_cost_units": 12},
        "deadline_ms": 5000,
    }
)

choices = st.lists(
    st.tuples(st.integers(0, 9), st.integers(0, 1000), st.integers(0, 4)), min_size=1, max_size=60
)


def _event(m: RunMachine, kind: int, r: int, n: int, now: int) -> tuple[Any, int]:
    f = m.record.frame
    slots = [] if f is None else f.slots
    queued = [s for s in slots if s.phase is SlotPhase.QUEUED]
    live = [s for s in slots if s.phase in (SlotPhase.OFFERED, SlotPhase.STARTED)]
    step = "a" if f is None else f.step_id
    if kind <= 1 and queued:
        s = queued[r % len(queued)]
        return AttemptOffered(step, s.item_index, f"l{n}", f"w{r % 3}"), now
    if kind == 2 and live:
        s = live[r % len(live)]
        return AttemptStarted(step, s.item_index, s.fence), now
    if kind in (3, 4) and live:
        s = live[r % len(live)]
        output: Any = r
        if r % 7 == 0:
            output = {"_next_step": ["a", "gate", "$end", "fan"][r % 4]}
        patch = {"k": "x" * (r % 50)} if r % 3 == 0 else None
        return AttemptCompleted(step, s.item_index, s.fence, output, patch), now
    if kind == 5 and live:
        s = live[r % len(live)]
        cls = ["retryable", "fatal", "template", "unservable", "typed"][r % 5]
        return AttemptFailed(step, s.item_index, s.fence, cls, "m"), now
    if kind == 6 and live:
        s = live[r % len(live)]
        if r % 2:
            return AttemptLost(step, s.item_index, s.fence, s.phase is SlotPhase.STARTED), now
        return AttemptUnservable(step, s.item_index, s.fence, "w9"), now
    if kind == 7:
        return SignalReceived(["go", "other"][r % 2], "p" * (r % 500)), now
    if kind == 8:
        deadline = m.next_deadline()
        return Tick(), (deadline if deadline is not None and r % 2 else now + r)
    if kind == 9 and r % 10 == 0:
        return Cancel(), now
    if kind == 9 and r % 10 == 5:
        return Retry(), now  # refused unless failed; a retried run goes on with the script
    # a stale or random attempt event, to exercise the rejections
    return AttemptCompleted(step, None, r % 4, None), now


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(xs=st.lists(st.integers(0, 3), max_size=4), script=choices)
def test_every_transition_is_one_the_table_declares(xs: list[int], script: list[tuple[int, int, int]]) -> None:
    m, tr = RunMachine.start(run_id="r_t", definition=DEFINITION, input={"xs": xs}, now_ms=0)
    seq = m.record.seq
    now = 0
    for n, (kind, r, dt) in enumerate(script):
        now += dt
        event, at = _event(m, kind, r, n, now)
        now = max(now, at)
        before_status = m.status
        before = m.record.to_dict()
        try:
            tr = m.handle(event, at)
        except (Conflict, Invalid):
            assert m.record.to_dict() == before, f"{event!r} raised but changed the record"
            continue
        entry = TRANSITIONS[(before_status, type(event))]
        assert m.status in entry[1], (
            f"{before_status.value} --{type(event).__name__}--> {m.status.value} "
            f"is not declared (declared: {[s.value for s in entry[1]]})"
        )
        for e in tr.journal:
            seq += 1
            assert e["seq"] == seq
        assert RunRecord.from_dict(m.record.to_dict()).to_dict() == m.record.to_dict()
        if m.status.terminal:
            assert m.record.frame is None
