"""`stepd.sansio.trace.TraceBuilder`: committed run writes in, finished spans out (pure)."""

from __future__ import annotations

from typing import Any

from stepd.sansio.run import span_id_for, trace_id_for
from stepd.sansio.trace import SpanData, TraceBuilder, run_span_id, span_attributes

RUN = "r_1"
RECORD = {"run_id": RUN, "workflow": "wf", "version": "v1", "hash": "h" * 64,
          "created_at": 1_000, "correlation": "c-1", "idempotency_key": "k-1", "parent": None,
          "input_tokens": 12, "output_tokens": 7, "cost_usd": 0.25, "status": "running"}


def offered(lease: str, at: int, attempt: int = 1, fence: int = 1, step: str = "a",
            item: int | None = None) -> dict[str, Any]:
    e = {"type": "step_offered", "at": at, "step_id": step, "attempt": attempt, "fence": fence,
         "lease_id": lease, "worker_id": "w_1", "worker_name": "wk"}
    if item is not None:
        e["item_index"] = item
    return e


def lease_record(lease: str, offered_at: int, delivery: str = "at_least_once") -> dict[str, Any]:
    return {"lease_id": lease, "run_id": RUN, "step_id": "a", "item_index": None, "fence": 1,
            "attempt": 1, "worker_id": "w_1", "worker_name": "wk", "delivery": delivery,
            "status": "offered", "started": False, "offered_at": offered_at, "ended_at": None}


def by_name(spans: list[SpanData]) -> dict[str, SpanData]:
    return {s.name: s for s in spans}


def test_an_attempt_span_runs_from_offer_to_completion_under_the_run_span() -> None:
    b = TraceBuilder()
    assert b.feed(RUN, RECORD, [offered("l_1", 1_010)], [lease_record("l_1", 1_010)]) == []
    assert b.feed(RUN, RECORD, [{"type": "step_started", "at": 1_012, "lease_id": "l_1"}]) == []
    body = [{"span_id": "ab" * 8, "parent_span_id": span_id_for("l_1"), "name": "llm.call",
             "start_ms": 1_013, "end_ms": 1_015, "attributes": {"model": "m", "tags": ["x", "y"],
                                                                 "deep": {"k": 1}},
             "usage": {"model": "m", "input_tokens": 12, "output_tokens": 7, "cost_usd": 0.25}}]
    done = {"type": "step_completed", "at": 1_020, "step_id": "a", "attempt": 1, "fence": 1,
            "lease_id": "l_1", "worker_id": "w_1",
            "usage": {"input_tokens": 12, "output_tokens": 7, "cost_usd": 0.25}, "spans": body}
    end = {"type": "run_completed", "at": 1_021, "result": 3}
    spans = by_name(b.feed(RUN, RECORD, [done, end]))
    step, llm, run = spans["step a"], spans["llm.call"], spans["run wf"]
    assert {s.trace_id for s in spans.values()} == {trace_id_for(RUN)}
    assert run.span_id == run_span_id(RUN) and run.parent_span_id is None
    assert (run.start_ms, run.end_ms, run.error) == (1_000, 1_021, None)
    assert run.attributes["stepd.status"] == "completed"
    assert run.attributes["gen_ai.usage.input_tokens"] == 12
    assert run.attributes["stepd.cost_usd"] == 0.25
    assert run.attributes["stepd.definition_hash"] == "h" * 64
    assert step.span_id == span_id_for("l_1") and step.parent_span_id == run.span_id
    assert (step.start_ms, step.end_ms) == (1_010, 1_020)
    assert step.events == (("started", 1_012, {}),)
    assert {k: step.attributes[k] for k in ("stepd.worker_id", "stepd.attempt", "stepd.fence",
                                            "stepd.delivery", "stepd.outcome")} == {
        "stepd.worker_id": "w_1", "stepd.attempt": 1, "stepd.fence": 1,
        "stepd.delivery": "at_least_once", "stepd.outcome": "completed"}
    assert step.attributes["gen_ai.usage.output_tokens"] == 7
    assert llm.parent_span_id == step.span_id and llm.span_id == "ab" * 8
    assert llm.attributes["gen_ai.request.model"] == "m"
    assert llm.attributes["stepd.cost_usd"] == 0.25
    assert llm.attributes["tags"] == ["x", "y"]
    assert llm.attributes["deep"] == '{"k": 1}'
    assert b.open_attempts() == 0


def test_a_failed_attempt_and_a_failed_run_carry_an_error_status() -> None:
    b = TraceBuilder()
    b.feed(RUN, RECORD, [offered("l_1", 1_010)])
    failed = {"type": "step_failed", "at": 1_030, "step_id": "a", "attempt": 1, "fence": 1,
              "lease_id": "l_1", "worker_id": "w_1", "error_class": "fatal", "message": "boom"}
    run_failed = {"type": "run_failed", "at": 1_031,
                  "error": {"reason": "step_failed", "message": "boom", "step_id": "a"}}
    spans = by_name(b.feed(RUN, RECORD, [failed, run_failed]))
    assert spans["step a"].error == "fatal: boom"
    assert spans["step a"].attributes["stepd.outcome"] == "failed"
    assert spans["step a"].attributes["stepd.error_class"] == "fatal"
    assert spans["run wf"].error == "step_failed: boom"
    assert spans["run wf"].attributes["stepd.error_reason"] == "step_failed"


def test_a_lease_fenced_without_an_entry_of_its_own_ends_once() -> None:
    b = TraceBuilder()
    b.feed(RUN, RECORD, [offered("l_1", 1_010), offered("l_2", 1_011, item=1)])
    # The step timed out: a journaled failure for l_1, and the same lease in lease_status.
    timeout = {"type": "step_failed", "at": 1_050, "step_id": "a", "attempt": 1, "fence": 1,
               "lease_id": "l_1", "error_class": "timeout", "message": "late"}
    spans = b.feed(RUN, RECORD, [timeout], lease_status=[("l_1", "fenced", 1_050),
                                                         ("l_2", "run_terminal", 1_051)])
    assert [(s.name, s.attributes["stepd.outcome"]) for s in spans] == [
        ("step a", "failed"), ("step a[1]", "run_terminal")]
    # Unknown leases (offered before a restart) ended only by status are not invented.
    assert b.feed(RUN, RECORD, [], lease_status=[("l_9", "fenced", 1_060)]) == []


def test_after_a_restart_the_start_comes_from_the_lease_record_or_is_marked_unknown() -> None:
    b = TraceBuilder()
    lost = {"type": "step_recovered", "at": 2_000, "step_id": "a", "attempt": 2, "fence": 3,
            "lease_id": "l_1", "started": True}
    [span] = b.feed(RUN, RECORD, [lost], [lease_record("l_1", 1_500, "at_most_once")])
    assert (span.start_ms, span.end_ms) == (1_500, 2_000)
    assert span.attributes["stepd.outcome"] == "lost"
    assert span.attributes["stepd.delivery"] == "at_most_once"
    assert span.attributes["stepd.fence"] == 3
    released = {"type": "step_recovered", "at": 2_100, "step_id": "a", "attempt": 2, "fence": 4,
                "lease_id": "l_2", "started": False, "released": True}
    [span] = b.feed(RUN, RECORD, [released])
    assert (span.start_ms, span.end_ms) == (2_100, 2_100)
    assert span.attributes["stepd.start_unknown"] is True
    assert span.attributes["stepd.outcome"] == "released"


def test_open_attempts_are_bounded_and_the_forgotten_are_counted() -> None:
    b = TraceBuilder(max_open=2)
    b.feed(RUN, RECORD, [offered("l_1", 10), offered("l_2", 11), offered("l_3", 12)])
    assert b.open_attempts() == 2 and b.forgotten == 1
    done = {"type": "step_completed", "at": 20, "step_id": "a", "attempt": 1, "fence": 1,
            "lease_id": "l_1"}
    [span] = b.feed(RUN, RECORD, [done])
    assert span.attributes.get("stepd.start_unknown") is True  # l_1 was the one forgotten


def test_a_child_run_links_to_its_parent_run() -> None:
    child = {**RECORD, "run_id": "r_1.s.0", "parent": {"run_id": RUN, "step_id": "s"}}
    [span] = TraceBuilder().feed("r_1.s.0", child, [{"type": "run_cancelled", "at": 1_100,
                                                     "error": None}])
    assert span.trace_id == trace_id_for("r_1.s.0")
    assert span.links == ((trace_id_for(RUN), run_span_id(RUN)),)
    assert span.attributes["stepd.parent_run_id"] == RUN
    assert span.error == "cancelled"


def test_attributes_keep_plain_values_and_turn_the_rest_into_json() -> None:
    assert span_attributes({"a": 1, "b": None, "c": [1, "x"], "d": (True, False), "e": []}) == {
        "a": 1, "c": '[1, "x"]', "d": [True, False], "e": "[]"}
