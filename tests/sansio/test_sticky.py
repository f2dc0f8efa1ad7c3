"""Sticky execution's pure parts: the history hash, deltas, the run machine's sticky leases and
the worker's cache (`stepd.sansio.sticky`, `stepd.sansio.sticky_cache`). No loop, no clock:
time is passed in."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from stepd.sansio.definition import parse_definition
from stepd.sansio.errors import Invalid
from stepd.sansio.events import (
    AttemptCompleted,
    AttemptOffered,
    SessionChanged,
    SignalReceived,
)
from stepd.sansio.run import RunMachine
from stepd.sansio.session_spec import work_session_id
from stepd.sansio.sticky import (
    MISSING,
    StickyClaim,
    StickyWorker,
    apply_delta,
    update_hash,
    view_hash,
)
from stepd.sansio.sticky_cache import Fetch, Ready, StickyCache

W1 = StickyWorker("w1", "b1", 500)


# --------------------------------------------------------------------------- the hash


def test_the_hash_depends_on_content_only_and_updates_incrementally() -> None:
    a = view_hash({"s0": 1, "s1": [2]}, {"k": "v"})
    assert a == view_hash({"s1": [2], "s0": 1}, {"k": "v"})  # not on order
    assert a != view_hash({"s0": 1, "s1": [2]}, {"k": "w"})
    assert a != view_hash({"k": "v"}, {"s0": 1, "s1": [2]})  # the kind is part of an entry
    h = view_hash({}, {})
    h = update_hash(h, "steps", "s0", MISSING, 1)
    h = update_hash(h, "steps", "s1", MISSING, [2])
    h = update_hash(h, "state", "k", MISSING, "old")
    h = update_hash(h, "state", "k", "old", "v")  # a replaced entry
    assert h == a


def test_apply_delta_keeps_the_order_a_full_lease_has() -> None:
    steps: dict[str, Any] = {"a": 1, "b": 2}
    state: dict[str, Any] = {"x": 1}
    h = apply_delta(steps, state, view_hash(steps, state),
                    {"steps": {"a": 9, "c": 3}, "state": {"y": 2}})
    assert list(steps) == ["a", "b", "c"] and steps["a"] == 9
    assert h == view_hash(steps, state)


# --------------------------------------------------------------------------- the run machine


def machine(*ids: str) -> RunMachine:
    d = parse_definition({"name": "wf", "steps": [
        {"id": i, "kind": "task", "body": i} for i in ids]})
    m, _ = RunMachine.start(run_id="r_1", definition=d, input=None, now_ms=0)
    return m


def offer(m: RunMachine, step: str, lease: str, sticky: StickyWorker | None = W1,
          worker: str = "w1") -> dict[str, Any]:
    tr = m.handle(AttemptOffered(step, None, lease, worker, "n", sticky=sticky), 1)
    assert tr.lease is not None
    return tr.lease


def complete(m: RunMachine, step: str, lease: dict[str, Any], output: Any,
             patch: dict[str, Any] | None = None, claim: StickyClaim | None = None) -> None:
    m.handle(AttemptCompleted(step, None, lease["fence"], output, patch, None, None,
                              sticky=claim), 2)


def claim_of(lease: dict[str, Any], **change: Any) -> StickyClaim:
    c = {**lease["sticky"]["cursor"], **change}
    return StickyClaim(c["seq"], c["hash"], c["workflow"], "b1", 500)


def test_a_run_no_sticky_worker_took_stays_as_it_was() -> None:
    m = machine("a", "b")
    lease = offer(m, "a", "l1", sticky=None)
    assert "sticky" not in lease and lease["steps"] == {} and lease["state"] == {}
    complete(m, "a", lease, {"x": 1}, {"k": 1})
    assert "sticky" not in m.record.to_dict()
    (spec,) = m.runnable()
    assert spec.prefer is None and spec.prefer_until is None


def test_full_then_delta_to_the_holder_and_cold_to_anyone_else() -> None:
    m = machine("a", "b", "c")
    first = offer(m, "a", "l1")
    assert first["sticky"]["mode"] == "full" and first["steps"] == {}
    complete(m, "a", first, {"x": 1}, {"k": "v"}, claim_of(first))
    second = offer(m, "b", "l2")
    s = second["sticky"]
    assert s["mode"] == "delta" and "steps" not in second and "state" not in second
    assert s["base"]["hash"] == first["sticky"]["cursor"]["hash"]
    assert (s["steps"], s["state"]) == ({"a": {"x": 1}}, {"k": "v"})
    assert s["cursor"]["hash"] == view_hash({"a": {"x": 1}}, {"k": "v"})
    complete(m, "b", second, 2, None, claim_of(second))
    # The next step prefers the holder for its schedule_ms, from when it was queued.
    (spec,) = m.runnable()
    assert (spec.prefer, spec.prefer_until) == ("w1", 2 + 500)
    # w1 did not take it: the optimisation is lost. No history in the lease, a reason.
    other = offer(m, "c", "l3", StickyWorker("w2", "b1", 500), worker="w2")
    assert (other["sticky"]["mode"], other["sticky"]["reason"]) == ("cold", "holder_unavailable")
    assert other["sticky"]["cursor"]["build_id"] == "b1" and "base" not in other["sticky"]
    assert "steps" not in other and "state" not in other
    assert other["sticky"]["cursor"]["hash"] == view_hash({"a": {"x": 1}, "b": 2}, {"k": "v"})


def test_a_run_whose_holder_never_cached_is_a_cold_start_not_a_cold_replay() -> None:
    m = machine("a", "b")
    lease = offer(m, "a", "l1")
    assert lease["sticky"]["mode"] == "full"  # the first step: no holder ever
    complete(m, "a", lease, 1, None, None)  # cached nothing: no holder
    assert offer(m, "b", "l2", StickyWorker("w2", "b1", 500), worker="w2")["sticky"]["mode"] \
        == "full"


def session_machine() -> RunMachine:
    d = parse_definition({"name": "wf", "sessions": {"gpu": {}}, "steps": [
        {"id": "pre", "kind": "task", "body": "pre"},
        {"id": "a", "kind": "task", "body": "a", "session": "gpu"},
        {"id": "b", "kind": "task", "body": "b", "session": "gpu"}]})
    m, _ = RunMachine.start(run_id="r_1", definition=d, input=None, now_ms=0)
    return m


def session_note(m: RunMachine, kind: str, worker: str, generation: int) -> None:
    m.handle(SessionChanged("gpu", work_session_id("r_1", "gpu"), kind, worker, generation,
                            reacquire=True), 3)


def test_a_session_moved_on_holder_loss_sends_a_cold_lease() -> None:
    m = session_machine()
    w2 = StickyWorker("w2", "b1", 500)
    pre = offer(m, "pre", "l0")
    complete(m, "pre", pre, 0, None, claim_of(pre))
    # The session's holder w2 is not the sticky holder w1: routing, not a loss (a miss).
    session_note(m, "acquired", "w2", 1)
    first = offer(m, "a", "l1", w2, worker="w2")
    assert first["sticky"]["mode"] == "full"
    complete(m, "a", first, 1, None, StickyClaim(**{
        k: first["sticky"]["cursor"][k] for k in ("seq", "hash", "workflow")},
        build_id="b1", schedule_ms=500))
    # w2 loses the session; w3 takes it over: a cold lease naming why.
    session_note(m, "lost", "w2", 1)
    session_note(m, "acquired", "w3", 2)
    moved = offer(m, "b", "l2", StickyWorker("w3", "b1", 500), worker="w3")
    assert moved["sticky"]["mode"] == "cold"
    assert moved["sticky"]["reason"] == "session_holder_lost"
    assert "steps" not in moved and "state" not in moved


def test_a_claim_that_is_not_the_current_cursor_changes_nothing() -> None:
    m = machine("a", "b")
    lease = offer(m, "a", "l1")
    before = copy.deepcopy(m.record.to_dict())
    for bad in (claim_of(lease, hash="1" * 64), claim_of(lease, seq=99),
                claim_of(lease, workflow="other")):
        with pytest.raises(Invalid) as err:
            complete(m, "a", lease, 1, None, bad)
        assert err.value.field == "sticky_cursor"
        assert m.record.to_dict() == before


def test_a_completion_without_cursor_clears_the_holder() -> None:
    m = machine("a", "b")
    lease = offer(m, "a", "l1")
    complete(m, "a", lease, 1, None, None)
    assert m.record.sticky is not None and m.record.sticky["hold"] is None
    assert offer(m, "b", "l2")["sticky"]["mode"] == "full"


def test_signals_and_state_written_between_steps_are_in_the_delta() -> None:
    d = parse_definition({"name": "wf", "steps": [
        {"id": "a", "kind": "task", "body": "a"},
        {"id": "go", "kind": "wait", "event": "go", "into": "got"},
        {"id": "b", "kind": "task", "body": "b"}]})
    m, _ = RunMachine.start(run_id="r_1", definition=d, input=None, now_ms=0)
    first = offer(m, "a", "l1")
    complete(m, "a", first, "A", None, claim_of(first))
    m.handle(SignalReceived("go", {"p": 1}), 3)
    s = offer(m, "b", "l2")["sticky"]
    assert s["steps"] == {"a": "A", "go": {"p": 1}} and s["state"] == {"got": {"p": 1}}
    assert s["cursor"]["hash"] == view_hash(m.record.steps, m.record.state)


# --------------------------------------------------------------------------- the cache


def full_lease(run: str, steps: dict[str, Any], state: dict[str, Any], seq: int = 1
               ) -> dict[str, Any]:
    return {"workflow": "wf", "run_id": run, "lease_id": "l", "steps": steps, "state": state,
            "sticky": {"mode": "full", "cursor": {"seq": seq, "hash": view_hash(steps, state)}}}


def delta_lease(run: str, base: tuple[int, str], seq: int, steps: dict[str, Any],
                state: dict[str, Any], result: str, build: str | None = "b1") -> dict[str, Any]:
    return {"workflow": "wf", "run_id": run, "lease_id": "l",
            "sticky": {"mode": "delta", "steps": steps, "state": state,
                       "base": {"seq": base[0], "hash": base[1], "build_id": build},
                       "cursor": {"seq": seq, "hash": result}}}


def test_a_delta_on_the_right_base_is_a_hit_and_the_body_gets_fresh_objects() -> None:
    cache = StickyCache(4, 1 << 20, 1000, "b1")
    got = cache.resolve(full_lease("r1", {"a": {"n": 1}}, {}), 0)
    assert isinstance(got, Ready) and got.cursor is not None and cache.stats.miss == 1
    got.steps["a"]["n"] = 666  # a body mutating what it was given
    base = (1, view_hash({"a": {"n": 1}}, {}))
    result = view_hash({"a": {"n": 1}, "b": 2}, {"k": 1})
    hit = cache.resolve(delta_lease("r1", base, 5, {"b": 2}, {"k": 1}, result), 10)
    assert isinstance(hit, Ready) and cache.stats.hit == 1
    assert hit.steps == {"a": {"n": 1}, "b": 2} and hit.state == {"k": 1}
    assert cache.entry_cursor("wf", "r1") == (5, result)


@pytest.mark.parametrize("why", ["no_entry", "build_mismatch", "base_mismatch",
                                 "result_mismatch"])
def test_what_the_cache_cannot_serve_is_fetched(why: str) -> None:
    cache = StickyCache(4, 1 << 20, 1000, "b1")
    cache.resolve(full_lease("r1", {"a": 1}, {}), 0)
    base = (1, view_hash({"a": 1}, {}))
    result = view_hash({"a": 1, "b": 2}, {})
    lease = {
        "no_entry": delta_lease("r2", base, 3, {"b": 2}, {}, result),
        "build_mismatch": delta_lease("r1", base, 3, {"b": 2}, {}, result, build="b0"),
        "base_mismatch": delta_lease("r1", (1, "1" * 64), 3, {"b": 2}, {}, result),
        "result_mismatch": delta_lease("r1", base, 3, {"b": 3}, {}, result),  # tampered
    }[why]
    got = cache.resolve(lease, 1)
    assert got == Fetch(why)
    assert cache.stats.hit == 0
    answer = {"cursor": {"seq": 3, "hash": result}, "steps": {"a": 1, "b": 2}, "state": {}}
    ready = cache.fetched(lease, answer, 2)
    assert ready.steps == {"a": 1, "b": 2} and cache.stats.forced_cold_replay == 1


def test_a_cold_lease_is_fetched_whatever_the_cache_holds() -> None:
    cache = StickyCache(4, 1 << 20, 1000, "b1")
    cache.resolve(full_lease("r1", {"a": 1}, {}), 0)
    result = view_hash({"a": 1, "b": 2}, {})
    lease = {"workflow": "wf", "run_id": "r1", "lease_id": "l",
             "sticky": {"mode": "cold", "reason": "holder_unavailable",
                        "cursor": {"seq": 3, "hash": result}}}
    assert cache.resolve(lease, 1) == Fetch("cold:holder_unavailable")
    answer = {"cursor": {"seq": 3, "hash": result}, "steps": {"a": 1, "b": 2}, "state": {}}
    ready = cache.fetched(lease, answer, 2)
    assert ready.cursor is not None and ready.cursor["seq"] == 3
    assert cache.stats.as_dict() == {"hit": 0, "miss": 1, "eviction": 0,
                                     "forced_cold_replay": 1}


def test_entries_expire_after_the_ttl() -> None:
    cache = StickyCache(4, 1 << 20, 1000, "b1")
    cache.resolve(full_lease("r1", {"a": 1}, {}), 0)
    base = (1, view_hash({"a": 1}, {}))
    lease = delta_lease("r1", base, 3, {"b": 2}, {}, view_hash({"a": 1, "b": 2}, {}))
    assert isinstance(cache.resolve(lease, 999), Ready)  # stored again at 999
    later = delta_lease("r1", (3, view_hash({"a": 1, "b": 2}, {})), 4, {}, {},
                        view_hash({"a": 1, "b": 2}, {}))
    assert cache.resolve(later, 999 + 1000) == Fetch("no_entry")
    assert cache.stats.eviction == 1 and len(cache) == 0


def test_capacity_and_bytes_bound_the_cache() -> None:
    cache = StickyCache(2, 1 << 20, 10_000, "b1")
    for run in ("r1", "r2", "r3"):
        cache.resolve(full_lease(run, {"a": run}, {}), 0)
    assert len(cache) == 2 and cache.entry_cursor("wf", "r1") is None  # least recent out
    assert cache.stats.eviction == 1
    small = StickyCache(10, 300, 10_000, "b1")
    small.resolve(full_lease("r1", {"a": "x" * 100}, {}), 0)
    small.resolve(full_lease("r2", {"a": "y" * 100}, {}), 0)
    small.resolve(full_lease("r3", {"a": "z" * 100}, {}), 0)
    assert small.bytes <= 300 and small.stats.eviction == 1
    too_big = small.resolve(full_lease("r4", {"a": "w" * 400}, {}), 0)
    assert isinstance(too_big, Ready) and too_big.cursor is None  # served, not cached


def test_a_full_history_that_does_not_match_its_cursor_is_not_cached() -> None:
    cache = StickyCache(4, 1 << 20, 1000, "b1")
    lease = full_lease("r1", {"a": 1}, {})
    lease["sticky"]["cursor"]["hash"] = "1" * 64
    got = cache.resolve(lease, 0)
    assert isinstance(got, Ready) and got.cursor is None and len(cache) == 0
