"""Local steps and the capability gate, pure: definitions, the lease plan, records, the run
machine journaling them, and the gate's checks in order. No loop, no storage.

AFFINITY.md "Local steps" and "Version negotiation and the capability manifest".
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from stepd.sansio.capabilities import WorkerCapabilities, check_completion, gated
from stepd.sansio.definition import Definition, parse_definition
from stepd.sansio.errors import Invalid
from stepd.sansio.events import AttemptCompleted, AttemptOffered, AttemptStarted, Runnable
from stepd.sansio.local_steps import local_plan, local_span_id, parse_records
from stepd.sansio.run import RunMachine, span_id_for
from stepd.sansio.status import RunStatus
from stepd.sansio.trace import TraceBuilder


def task(id: str, **kw: Any) -> dict[str, Any]:
    return {"id": id, "kind": "task", "body": kw.pop("body", id), **kw}


def chain(**local_kw: Any) -> Definition:
    """prep -> norm (local) -> check (local) -> tally."""
    return parse_definition({"name": "wf", "steps": [
        task("prep"), task("norm", input="${steps.prep.n}", local=True, **local_kw),
        task("check", input="${steps.norm}", local=True), task("tally")]})


def record(step_id: str, *attempts: dict[str, Any], **extra: Any) -> dict[str, Any]:
    rec: dict[str, Any] = {"step_id": step_id, "input": None, "attempts": list(attempts)}
    rec.update(extra)
    return rec


def ok(n: int, output: Any) -> dict[str, Any]:
    return {"attempt": n, "started_ms": 0, "ended_ms": 1, "output": output}


def err(n: int, cls: str = "retryable") -> dict[str, Any]:
    return {"attempt": n, "started_ms": 0, "ended_ms": 1, "error": {"class": cls, "message": "x"}}


def started_parent(d: Definition, *, local: bool = True) -> tuple[RunMachine, dict[str, Any]]:
    m, _ = RunMachine.start(run_id="r_1", definition=d, input={"n": 1}, now_ms=0)
    tr = m.handle(AttemptOffered("prep", None, "l_1", "w_1", "one", local), 1)
    m.handle(AttemptStarted("prep", None, 1), 2)
    assert tr.lease is not None
    return m, tr.lease


# --------------------------------------------------------------------------- definitions


def test_local_is_in_the_wire_form_only_when_true_so_old_hashes_hold() -> None:
    plain = parse_definition({"name": "wf", "steps": [task("a")]})
    assert "local" not in plain.steps[0].to_json()
    explicit = parse_definition({"name": "wf", "steps": [task("a", local=False)]})
    assert explicit.definition_hash == plain.definition_hash
    local = parse_definition({"name": "wf", "steps": [task("a", local=True)]})
    assert local.steps[0].to_json()["local"] is True
    assert local.definition_hash != plain.definition_hash


@pytest.mark.parametrize(("step", "field"), [
    (task("a", local="yes"), "steps[0].local"),
    (task("a", total_timeout_ms=5), "steps[0].total_timeout_ms"),
    (task("a", local=True, total_timeout_ms=0), "steps[0].total_timeout_ms"),
    (task("a", local=True, delivery="at_most_once"), "steps[0].delivery"),
])
def test_bad_local_options_name_the_field(step: dict[str, Any], field: str) -> None:
    with pytest.raises(Invalid) as exc:
        parse_definition({"name": "wf", "steps": [step]})
    assert exc.value.field == field


# --------------------------------------------------------------------------- the plan


def test_plan_follows_local_steps_until_an_ordinary_one() -> None:
    d = chain(timeout_ms=50, total_timeout_ms=500)
    plan = local_plan(d, "prep")
    assert [p["step_id"] for p in plan] == ["norm", "check"]
    assert plan[0]["input"] == "${steps.prep.n}"
    assert (plan[0]["timeout_ms"], plan[0]["total_timeout_ms"]) == (50, 500)
    assert local_plan(d, "norm") == []  # a local step carries no plan
    assert local_plan(d, "tally") == []


def test_plan_stops_at_a_loop() -> None:
    d = parse_definition({"name": "wf", "steps": [
        task("a"), task("b", local=True, _next_step="b")]})
    assert [p["step_id"] for p in local_plan(d, "a")] == ["b"]


def test_lease_carries_the_plan_only_for_a_worker_that_declared_local_steps() -> None:
    d = chain()
    _, lease = started_parent(d, local=True)
    assert [p["step_id"] for p in lease["local_steps"]] == ["norm", "check"]
    assert lease["run_input"] == {"n": 1}
    assert lease["local_steps"][0]["idempotency_key"] == "r_1/norm"
    _, plain = started_parent(d, local=False)
    assert "local_steps" not in plain and "run_input" not in plain


# --------------------------------------------------------------------------- records


@pytest.mark.parametrize(("records", "field"), [
    ({}, "local_steps"),
    ([{"attempts": [ok(1, 1)]}], "local_steps[0].step_id"),
    ([record("norm")], "local_steps[0].attempts"),
    ([record("norm", ok(2, 1))], "local_steps[0].attempts[0].attempt"),
    ([record("norm", ok(1, 1), ok(2, 1))], "local_steps[0].attempts[0]"),
    ([record("norm", err(1))], "local_steps[0].error"),
    ([record("norm", ok(1, 1), error={"class": "fatal"})], "local_steps[0].error"),
    ([record("norm", ok(1, 1), surprise=1)], "local_steps[0]"),
    ([record("norm", {"attempt": 1, "error": {"klass": "x"}})], "local_steps[0].attempts[0].error"),
])
def test_malformed_records_name_the_field(records: Any, field: str) -> None:
    with pytest.raises(Invalid) as exc:
        parse_records(records)
    assert exc.value.field == field


def complete(m: RunMachine, records: list[dict[str, Any]], now: int = 10) -> Any:
    return m.handle(AttemptCompleted("prep", None, 1, {"n": 5}, None, None, None,
                                     parse_records(records)), now)


def test_records_are_journaled_as_local_history_in_the_parent_transition() -> None:
    m, _ = started_parent(chain())
    tr = complete(m, [record("norm", err(1), ok(2, 10), progress={"p": 1}),
                      record("check", ok(1, {"ok": True}), state_patch={"checked": True})])
    local = [e for e in tr.journal if e.get("execution_mode") == "local"]
    assert [(e["type"], e["step_id"], e.get("attempt")) for e in local] == [
        ("step_scheduled", "norm", None), ("step_started", "norm", 1),
        ("step_failed", "norm", 1), ("step_started", "norm", 2),
        ("step_completed", "norm", 2), ("step_scheduled", "check", None),
        ("step_started", "check", 1), ("step_completed", "check", 1)]
    assert all(e["lease_id"] == "l_1" and e["parent_step_id"] == "prep" for e in local)
    assert local[4]["progress"] == {"p": 1}
    assert m.record.steps["norm"] == 10 and m.record.state == {"checked": True}
    # The run went on to the ordinary step after them: one Runnable, for tally.
    runnable = [e for e in tr.effects if isinstance(e, Runnable)]
    assert [s.step_id for r in runnable for s in r.attempts] == ["tally"]
    assert m.record.cost_units == 3


def test_a_terminal_local_error_fails_the_run() -> None:
    m, _ = started_parent(chain(retry={"max_attempts": 2}))
    complete(m, [record("norm", err(1), err(2), error={"class": "retryable", "message": "x"})])
    assert m.record.status is RunStatus.FAILED
    assert m.record.error is not None and m.record.error["step_id"] == "norm"


@pytest.mark.parametrize(("records", "field"), [
    # Not the step the run goes on to.
    ([record("check", ok(1, 1))], "local_steps[0].step_id"),
    # A later record out of order.
    ([record("norm", ok(1, 1)), record("tally", ok(1, 1))], "local_steps[1].step_id"),
    # Retried class with budget left: not terminal.
    ([record("norm", err(1), error={"class": "retryable", "message": "x"})], "local_steps[0].error"),
    # More attempts than the policy allows.
    ([record("norm", err(1), err(2), err(3), ok(4, 1))], "local_steps[0].attempts"),
])
def test_records_the_run_does_not_take_change_nothing(records: list[dict[str, Any]],
                                                       field: str) -> None:
    m, _ = started_parent(chain())
    before = copy.deepcopy(m.record)
    with pytest.raises(Invalid) as exc:
        complete(m, records)
    assert exc.value.field == field
    assert m.record == before  # nothing of the completion applied
    complete(m, [])  # and the parent alone still completes
    assert m.record.frame is not None and m.record.frame.step_id == "norm"


def test_records_after_the_run_ended_with_its_parent_are_ignored() -> None:
    d = parse_definition({"name": "wf", "budgets": {"max_transitions": 1}, "steps": [
        task("prep"), task("norm", local=True)]})
    m, _ = started_parent(d)
    complete(m, [record("norm", ok(1, 1))])
    assert m.record.status is RunStatus.FAILED
    assert "norm" not in m.record.steps


# --------------------------------------------------------------------------- the gate


SUPPORTED = {"local_steps": {"status": "supported"}, "sessions": {"status": "rejected"},
             "sticky": {"status": "rejected"}}


def worker(version: str = "1.20", caps: tuple[str, ...] = ("local_steps",),
           manifest: dict[str, Any] | None = None) -> WorkerCapabilities:
    return WorkerCapabilities("w_1", version, frozenset(caps),
                              SUPPORTED if manifest is None else manifest, "b1")


def test_gate_is_free_for_ordinary_completions() -> None:
    assert not gated({"output": 1, "state_patch": None})
    check_completion(worker("1.0", (), {}), {"output": 1})


@pytest.mark.parametrize(("w", "body", "field", "words"), [
    (worker("1.17", ()), {"local_steps": []}, "local_steps", "1.18"),
    (worker("1.20", ()), {"local_steps": []}, "local_steps", "did not declare"),
    (worker("1.20", ("local_steps",), {**SUPPORTED, "local_steps": {"status": "rejected"}}),
     {"local_steps": []}, "local_steps", "manifest"),
    (worker(), {"session_id": "s_1"}, "session_id", "sessions"),
    (worker("1.20", ("sticky",), {**SUPPORTED, "sticky": {"status": "supported"}}),
     {"sticky_cursor": {"workflow": "wf", "run_id": "r_1", "build_id": "b1"}}, "sticky_cursor",
     "identity"),
])
def test_gate_names_the_field_and_the_check(w: WorkerCapabilities, body: dict[str, Any],
                                            field: str, words: str) -> None:
    with pytest.raises(Invalid) as exc:
        check_completion(w, body)
    assert exc.value.field == field
    assert words in str(exc.value)


def test_gate_checks_the_exact_sticky_identity() -> None:
    w = worker("1.20", ("sticky",), {**SUPPORTED, "sticky": {"status": "supported"}})
    ident = {"workflow": "wf", "run_id": "r_1", "build_id": "b1"}
    check_completion(w, {"sticky_cursor": dict(ident)}, sticky_identity=ident)
    with pytest.raises(Invalid) as exc:
        check_completion(w, {"sticky_cursor": {**ident, "build_id": "b2"}}, sticky_identity=ident)
    assert exc.value.field == "sticky_cursor.build_id"


def test_old_worker_records_read_as_version_one_without_capabilities() -> None:
    w = WorkerCapabilities.from_record({"worker_id": "w_1", "protocol_version": "1.0"})
    assert not w.supports("local_steps")
    assert worker().supports("local_steps")


# --------------------------------------------------------------------------- usage and spans


def priced(i: int, o: int, cost: float) -> dict[str, Any]:
    return {"model": "m", "input_tokens": i, "output_tokens": o, "cost_usd": cost}


def body_span(span_id: str, parent: str | None, usage: dict[str, Any]) -> dict[str, Any]:
    return {"span_id": span_id, "parent_span_id": parent, "name": "llm.call",
            "start_ms": 1_000, "end_ms": 1_005, "usage": usage}


def test_the_plan_names_each_local_steps_span() -> None:
    _, lease = started_parent(chain())
    assert [p["span_id"] for p in lease["local_steps"]] == [
        local_span_id("l_1", "norm"), local_span_id("l_1", "check")]
    assert len({p["span_id"] for p in lease["local_steps"]} | {lease["span_id"]}) == 3


def test_a_local_steps_usage_joins_the_runs_totals_and_its_spans_ride_its_entry() -> None:
    m, _ = started_parent(chain(retry={"max_attempts": 2}))
    norm_span = local_span_id("l_1", "norm")
    spans = [body_span("a" * 16, norm_span, priced(100, 10, 0.5))]
    tr = m.handle(AttemptCompleted(
        "prep", None, 1, {"n": 5}, None, priced(1000, 100, 2.0), None,
        parse_records([record("norm", err(1), ok(2, 10), usage=priced(300, 30, 1.0),
                              spans=spans)])), 10)
    r = m.record
    assert (r.input_tokens, r.output_tokens, r.cost_usd) == (1300, 130, 3.0)
    done = [e for e in tr.journal if e["type"] == "step_completed" and e["step_id"] == "norm"]
    assert done[0]["usage"] == priced(300, 30, 1.0) and done[0]["spans"] == spans
    # The failed attempt's entry carries nothing: one entry per record holds it.
    failed = [e for e in tr.journal if e["type"] == "step_failed"]
    assert "usage" not in failed[0] and "spans" not in failed[0]


def test_a_failed_local_steps_usage_still_counts() -> None:
    m, _ = started_parent(chain(retry={"max_attempts": 1}))
    tr = m.handle(AttemptCompleted(
        "prep", None, 1, {"n": 5}, None, None, None,
        parse_records([record("norm", err(1, "fatal"), error={"class": "fatal", "message": "x"},
                              usage=priced(7, 3, 0.25))])), 10)
    assert m.record.status is RunStatus.FAILED
    assert (m.record.input_tokens, m.record.output_tokens, m.record.cost_usd) == (7, 3, 0.25)
    [last] = [e for e in tr.journal if e["type"] == "step_failed" and e.get("attempt") == 1]
    assert last["usage"] == priced(7, 3, 0.25)


@pytest.mark.parametrize("local", [True, False])
def test_a_local_step_past_max_cost_units_ends_the_run_as_a_remote_one_would(
        local: bool) -> None:
    """Budgets count cost units (WORKFLOWS.md "Budgets"); a local step's count in the
    parent's transaction, and the breach is the same run failure either way."""
    d = parse_definition({"name": "wf", "budgets": {"max_cost_units": 2}, "steps": [
        task("prep"), task("norm", local=local, cost_units=5), task("tally")]})
    m, _ = started_parent(d)
    if local:
        complete(m, [record("norm", ok(1, 1), usage=priced(9, 9, 9.0))])
    else:
        complete(m, [])
        tr = m.handle(AttemptOffered("norm", None, "l_2", "w_1", "one"), 11)
        assert tr.lease is not None
        m.handle(AttemptCompleted("norm", None, tr.lease["fence"], 1, None,
                                  priced(9, 9, 9.0), None), 12)
    assert m.record.status is RunStatus.FAILED
    assert m.record.error is not None
    assert (m.record.error["reason"], m.record.error.get("budget")) == ("budget_exceeded",
                                                                        "max_cost_units")
    assert m.record.cost_usd == 9.0  # its usage is on record all the same


def test_the_trace_shows_a_local_step_under_its_parent_and_its_spans_under_it() -> None:
    m, _ = started_parent(chain())
    norm_span = local_span_id("l_1", "norm")
    spans = [body_span("b" * 16, norm_span, priced(5, 1, 0.1)),
             body_span("c" * 16, "b" * 16, priced(2, 2, 0.2))]
    tr = m.handle(AttemptCompleted(
        "prep", None, 1, {"n": 5}, None, None, None,
        parse_records([record("norm", err(1), {"attempt": 2, "started_ms": 4, "ended_ms": 9,
                                               "output": 10}, usage=priced(7, 3, 0.3),
                              spans=spans),
                       record("check", ok(1, True))])), 1_000)
    builder = TraceBuilder()
    out = {s.span_id: s for s in builder.feed("r_1", m.record.to_dict(), tr.journal)}
    parent = span_id_for("l_1")
    assert out[parent].attributes["stepd.outcome"] == "completed"
    norm = out[norm_span]
    assert norm.parent_span_id == parent and norm.name == "step norm"
    assert norm.attributes["stepd.execution_mode"] == "local"
    assert norm.attributes["gen_ai.usage.input_tokens"] == 7
    assert (norm.start_ms, norm.end_ms) == (1_000 - 9, 1_000)
    assert [e[0] for e in norm.events] == ["started", "attempt_failed", "started"]
    assert out["b" * 16].parent_span_id == norm_span
    assert out["c" * 16].parent_span_id == "b" * 16
    assert out[local_span_id("l_1", "check")].parent_span_id == parent
