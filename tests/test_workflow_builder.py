"""The Python builder (WORKFLOWS.md "Python SDK shape") and durations."""

from __future__ import annotations

import datetime
from typing import Any

import pytest

from stepd.sansio.definition import (
    Delivery,
    ForEachStep,
    RetryPolicy,
    StartWorkflowsStep,
    TaskStep,
    definition_hash,
    parse_definition,
)
from stepd.sansio.durations import parse_duration
from stepd.sansio.errors import Invalid
from stepd.workflow import BodyConfig, Retry, Workflow, body, body_config


def classify(ctx: Any, data: Any) -> Any:
    return data


def draft(ctx: Any, data: Any) -> Any:
    return data


def execute_task(ctx: Any, data: Any) -> Any:
    return data


def send(ctx: Any, data: Any) -> Any:
    return data


def _retry(**changes: Any) -> dict[str, Any]:
    return {
        "max_attempts": 3,
        "initial_backoff_ms": 200,
        "backoff_factor": 2.0,
        "max_backoff_ms": 30000,
        "retry_on": [],
        **changes,
    }


def _task(step_id: str, **changes: Any) -> dict[str, Any]:
    return {
        "id": step_id,
        "kind": "task",
        "body": step_id,
        "input": "${input}",
        "retry": _retry(),
        "timeout_ms": None,
        "delivery": "at_least_once",
        "cost_units": 1,
        "_next_step": None,
        **changes,
    }


def support() -> Workflow:
    return (
        Workflow("support", version="support.v2")
        .then(classify)
        .then(draft, retry=Retry(max_attempts=5), timeout="2m")
        .for_each("${state.tasks}", execute_task, into="results", max_parallel=4)
        .wait("approved", timeout="1h", into="approval")
        .then(send, delivery="at_most_once")
        .budget(max_transitions=20, max_cost_units=40)
    )


def test_the_sdk_example_produces_the_expected_json() -> None:
    assert support().to_json() == {
        "name": "support",
        "version": "support.v2",
        "steps": [
            _task("classify"),
            _task("draft", retry=_retry(max_attempts=5), timeout_ms=120000),
            {
                "id": "execute_task",
                "kind": "for_each",
                "body": "execute_task",
                "items": "${state.tasks}",
                "into": "results",
                "max_parallel": 4,
                "input": "${item}",
                "retry": _retry(),
                "timeout_ms": None,
                "delivery": "at_least_once",
                "cost_units": 1,
                "_next_step": None,
            },
            {
                "id": "approved",
                "kind": "wait",
                "event": "approved",
                "timeout_ms": 3600000,
                "into": "approval",
                "_next_step": None,
            },
            _task("send", delivery="at_most_once"),
        ],
        "budgets": {
            "max_transitions": 20,
            "max_for_each_items": None,
            "max_state_bytes": None,
            "max_cost_units": 40,
            "max_started_workflows": None,
        },
        "deadline_ms": None,
    }


def test_the_builder_hash_is_the_daemons() -> None:
    w = support()
    assert w.definition_hash == definition_hash(w.to_json())
    assert w.definition == parse_definition(w.to_json())
    assert (w.name, w.version) == ("support", "support.v2")
    assert w.bodies == {
        "classify": classify,
        "draft": draft,
        "execute_task": execute_task,
        "send": send,
    }


RESEARCH_RUN = {
    "name": "research_run",
    "version": "research.v2",
    "steps": [
        {"id": "plan", "kind": "task", "body": "plan_research", "input": "${input}"},
        {
            "id": "tasks",
            "kind": "for_each",
            "items": "${state.tasks}",
            "body": "execute_task",
            "into": "results",
            "max_parallel": 4,
        },
        {
            "id": "approval",
            "kind": "wait",
            "event": "approved",
            "timeout_ms": 3600000,
            "into": "approval",
        },
        {"id": "pause", "kind": "sleep", "duration_ms": 1000},
        {
            "id": "children",
            "kind": "start_workflows",
            "workflow": "summarise",
            "items": "${state.results}",
            "wait": True,
            "into": "summaries",
        },
        {
            "id": "send",
            "kind": "task",
            "body": "send_summary",
            "delivery": "at_most_once",
            "retry": {"max_attempts": 1},
        },
    ],
    "budgets": {
        "max_transitions": 20,
        "max_for_each_items": 12,
        "max_state_bytes": 32768,
        "max_cost_units": 40,
        "max_started_workflows": 8,
    },
    "deadline_ms": 86400000,
}


def test_the_research_run_example_parses_and_round_trips() -> None:
    d = parse_definition(RESEARCH_RUN)
    assert [s.id for s in d.steps] == ["plan", "tasks", "approval", "pause", "children", "send"]
    assert parse_definition(d.to_json()) == d
    send_step = d.step("send")
    assert isinstance(send_step, TaskStep)
    assert send_step.delivery is Delivery.AT_MOST_ONCE
    assert send_step.retry == RetryPolicy(max_attempts=1)
    tasks = d.step("tasks")
    assert isinstance(tasks, ForEachStep) and tasks.max_parallel == 4
    children = d.step("children")
    assert isinstance(children, StartWorkflowsStep) and children.wait is True


def test_the_builder_can_write_the_research_run_example() -> None:
    w = (
        Workflow("research_run", version="research.v2")
        .then("plan_research", id="plan")
        .for_each("${state.tasks}", "execute_task", id="tasks", into="results", max_parallel=4)
        .wait("approved", id="approval", timeout=datetime.timedelta(hours=1), into="approval")
        .sleep("1s", id="pause")
        .start_workflows("summarise", "${state.results}", id="children", into="summaries")
        .then(
            "send_summary", id="send", delivery=Delivery.AT_MOST_ONCE, retry=Retry(max_attempts=1)
        )
        .budget(max_transitions=20, max_for_each_items=12, max_state_bytes=32768)
        .budget(max_cost_units=40, max_started_workflows=8)
        .deadline("1d")
    )
    assert w.definition == parse_definition(RESEARCH_RUN)
    assert w.definition_hash == definition_hash(RESEARCH_RUN)
    assert w.bodies == {}  # string bodies are served by whoever registers them


# --- bodies and cost units ----------------------------------------------------------------


def test_body_decorator_bare_and_called() -> None:
    @body
    def plain(ctx: Any, data: Any) -> Any:
        return data

    @body(name="renamed", cost_units=3)
    def configured(ctx: Any, data: Any) -> Any:
        return data

    assert plain(None, 1) == 1  # still a plain function
    assert body_config(plain) == BodyConfig()
    assert body_config(configured) == BodyConfig(name="renamed", cost_units=3)
    assert body_config(classify) == BodyConfig()
    w = Workflow("w").then(plain).then(configured)
    assert [s.id for s in w.definition.steps] == ["plain", "renamed"]
    assert w.bodies == {"plain": plain, "renamed": configured}


def test_cost_units_explicit_then_declared_then_one() -> None:
    @body(cost_units=5)
    def pricey(ctx: Any, data: Any) -> Any:
        return data

    w = (
        Workflow("w")
        .then(pricey)
        .then(pricey, id="free", cost_units=0)
        .then(pricey, id="more", cost_units=9)
        .then(classify)
        .for_each("${input}", pricey, id="each")
    )
    costs = {s.id: s.cost_units for s in w.definition.steps}  # type: ignore[union-attr]
    assert costs == {"pricey": 5, "free": 0, "more": 9, "classify": 1, "each": 5}


@pytest.mark.parametrize("units", [0, -1, True, 1.5, "2"])
def test_a_body_may_only_declare_positive_cost_units(units: Any) -> None:
    with pytest.raises(Invalid) as info:
        body(cost_units=units)
    assert info.value.field == "cost_units"


@pytest.mark.parametrize("name", ["", 3, "x" * 129])
def test_a_body_name_must_be_a_non_empty_string(name: Any) -> None:
    with pytest.raises(Invalid) as info:
        body(name=name)
    assert info.value.field == "name"


def test_a_negative_step_cost_is_refused_at_the_call() -> None:
    w = Workflow("w")
    with pytest.raises(Invalid) as info:
        w.then(classify, cost_units=-1)
    assert (info.value.definition, info.value.field) == ("w", "steps[0].cost_units")


def test_a_lambda_needs_a_name() -> None:
    with pytest.raises(Invalid) as info:
        Workflow("w").then(lambda ctx, data: data)
    assert info.value.field == "steps[0].body"
    assert "@stepd.body(name=" in info.value.message
    named = body(name="inline")(lambda ctx, data: data)
    assert Workflow("w").then(named).definition.steps[0].id == "inline"


def test_two_callables_under_one_body_name_are_refused() -> None:
    def classify(ctx: Any, data: Any) -> Any:
        return None

    w = Workflow("w").then(globals()["classify"])
    with pytest.raises(Invalid) as info:
        w.then(classify, id="again")
    assert (info.value.field, info.value.definition) == ("steps[1].body", "w")
    assert len(w.definition.steps) == 1


def test_one_callable_may_serve_two_steps() -> None:
    w = Workflow("w").then(classify).then(classify, id="again")
    assert w.bodies == {"classify": classify}
    assert [s.body for s in w.definition.steps] == ["classify", "classify"]  # type: ignore[union-attr]


def test_a_body_must_be_callable_or_a_name() -> None:
    with pytest.raises(Invalid) as info:
        Workflow("w").then(3)  # type: ignore[arg-type]
    assert info.value.field == "steps[0].body"


# --- ids ------------------------------------------------------------------------------------


def test_a_duplicate_id_is_refused_at_the_call_with_a_hint() -> None:
    w = Workflow("w").then(classify)
    with pytest.raises(Invalid) as info:
        w.then(classify)
    assert info.value.field == "steps[1].id"
    assert info.value.definition == "w"
    assert "steps[0]" in info.value.message and "id=" in info.value.message
    # the refused call left nothing behind
    assert [s.id for s in w.definition.steps] == ["classify"]
    w.then(classify, id="classify_again")
    assert [s.id for s in w.definition.steps] == ["classify", "classify_again"]


def test_duplicates_across_kinds() -> None:
    w = Workflow("w").wait("approved")
    with pytest.raises(Invalid) as info:
        w.then("approved")
    assert info.value.field == "steps[1].id"
    with pytest.raises(Invalid):
        w.start_workflows("approved", [1])


def test_a_body_name_that_is_not_an_id_needs_id() -> None:
    with pytest.raises(Invalid) as info:
        Workflow("w").then("billing.charge")
    assert info.value.field == "steps[0].id"
    assert "pass id=" in info.value.message
    w = Workflow("w").then("billing.charge", id="charge")
    assert w.definition.steps[0].body == "billing.charge"  # type: ignore[union-attr]


def test_default_ids() -> None:
    child = Workflow("summarise", version="summarise.v3").then(classify)
    w = (
        Workflow("w")
        .sleep(0)
        .wait("approved")
        .sleep("1s")
        .sleep(5, id="sleep_3")
        .sleep(5)
        .start_workflows(child, "${input}")
        .start_workflows("other", [1, 2], version="other.v1", wait=False)
    )
    assert [s.id for s in w.definition.steps] == [
        "sleep",
        "approved",
        "sleep_2",
        "sleep_3",
        "sleep_4",
        "summarise",
        "other",
    ]
    summarise = w.definition.step("summarise")
    other = w.definition.step("other")
    assert isinstance(summarise, StartWorkflowsStep) and isinstance(other, StartWorkflowsStep)
    assert (summarise.workflow, summarise.version, summarise.wait) == (
        "summarise",
        "summarise.v3",
        True,
    )
    assert (other.version, other.wait) == ("other.v1", False)


def test_an_explicit_version_beats_the_child_builders() -> None:
    child = Workflow("summarise", version="summarise.v3")
    w = Workflow("w").start_workflows(child, [1], version="summarise.v1")
    assert w.definition.steps[0].version == "summarise.v1"  # type: ignore[union-attr]


# --- references and whole-definition checks -----------------------------------------------------


def test_forward_references_are_checked_by_definition() -> None:
    w = Workflow("w").then(classify, next="send", input={"p": "${steps.send}"})
    with pytest.raises(Invalid) as info:
        _ = w.definition
    assert info.value.field == "steps[0].input.p"
    w.then(send)
    assert w.definition.steps[0].next == "send"


def test_next_may_end_the_run() -> None:
    w = Workflow("w").then(classify, next="$end").then(send)
    assert w.definition.successor("classify") == "$end"


def test_an_unknown_next_is_refused_by_definition() -> None:
    w = Workflow("w").then(classify, next="nope")
    with pytest.raises(Invalid) as info:
        w.to_json()
    assert (info.value.field, info.value.definition) == ("steps[0]._next_step", "w")


def test_an_empty_workflow_has_no_definition() -> None:
    with pytest.raises(Invalid) as info:
        _ = Workflow("w").definition
    assert info.value.field == "steps"


def test_the_definition_is_cached_until_the_builder_changes() -> None:
    w = Workflow("w").then(classify)
    first = w.definition
    assert w.definition is first
    w.then(send)
    assert w.definition is not first
    second = w.definition
    w.budget(max_cost_units=1)
    assert w.definition is not second
    third = w.definition
    w.deadline("1m")
    assert w.definition is not third


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda w: w.then(classify, timeout="0s"), "steps[0].timeout"),
        (lambda w: w.then(classify, timeout="soon"), "steps[0].timeout"),
        (lambda w: w.then(classify, delivery="twice"), "steps[0].delivery"),
        (lambda w: w.then(classify, retry={"max_attempts": 2}), "steps[0].retry"),
        (lambda w: w.then(classify, input={"x": "${oops"}), "steps[0].input.x"),
        (lambda w: w.then(classify, input="${item}"), "steps[0].input"),
        (lambda w: w.for_each(3, classify), "steps[0].items"),
        (lambda w: w.for_each("${input}", classify, max_parallel=0), "steps[0].max_parallel"),
        (lambda w: w.for_each("${input}", classify, into=""), "steps[0].into"),
        (lambda w: w.wait("", id="w"), "steps[0].event"),
        (lambda w: w.wait("e", timeout=-5), "steps[0].timeout"),
        (lambda w: w.sleep(-1), "steps[0].duration"),
        (lambda w: w.sleep(None), "steps[0].duration"),
        (lambda w: w.start_workflows("", [1], id="c"), "steps[0].workflow"),
        (lambda w: w.start_workflows("child", 5), "steps[0].items"),
        (lambda w: w.start_workflows("child", [1], wait="yes"), "steps[0].wait"),
        (lambda w: w.budget(max_cost=1), "budgets.max_cost"),
        (lambda w: w.budget(max_cost_units=-1), "budgets.max_cost_units"),
        (lambda w: w.budget(max_transitions=True), "budgets.max_transitions"),
        (lambda w: w.deadline(0), "deadline"),
        (lambda w: w.deadline("later"), "deadline"),
    ],
)
def test_bad_arguments_are_refused_at_the_call(call: Any, field: str) -> None:
    w = Workflow("w")
    before = w._raw()  # the builder's own state, to check nothing was half-applied
    with pytest.raises(Invalid) as info:
        call(w)
    assert info.value.field == field
    assert info.value.definition == "w"
    assert w._raw() == before


def test_unknown_budget_names_the_budget() -> None:
    with pytest.raises(Invalid) as info:
        Workflow("w").budget(max_costs=3)
    assert "unknown budget 'max_costs'" in info.value.message


def test_budgets_merge_and_none_lifts() -> None:
    w = Workflow("w").then(classify).budget(max_cost_units=4, max_transitions=9)
    w.budget(max_cost_units=None)
    assert w.definition.budgets.limits()["max_cost_units"] is None
    assert w.definition.budgets.max_transitions == 9


def test_deadline_and_none() -> None:
    w = Workflow("w").then(classify).deadline(datetime.timedelta(minutes=90))
    assert w.definition.deadline_ms == 5_400_000
    w.deadline(None)
    assert w.definition.deadline_ms is None


@pytest.mark.parametrize(("name", "version"), [("", None), (3, None), ("w", ""), ("w", 2)])
def test_workflow_name_and_version_are_checked(name: Any, version: Any) -> None:
    with pytest.raises(Invalid) as info:
        Workflow(name, version=version)
    assert info.value.field == ("name" if name in ("", 3) else "version")


def test_repr() -> None:
    assert (
        repr(Workflow("w", "v").then(classify)) == "Workflow('w', version='v', steps=['classify'])"
    )


# --- Retry ------------------------------------------------------------------------------------


def test_retry_takes_durations() -> None:
    assert Retry() == RetryPolicy()
    policy = Retry(
        max_attempts=4,
        initial_backoff="1s",
        backoff_factor=3,
        max_backoff=datetime.timedelta(minutes=1),
        retry_on=("timeout", "rate_limited"),
    )
    assert policy == RetryPolicy(4, 1000, 3.0, 60000, ("timeout", "rate_limited"))
    assert Retry(initial_backoff=0, max_backoff="0ms").backoff_ms(3) == 0


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_attempts": 0}, "retry.max_attempts"),
        ({"backoff_factor": 0.5}, "retry.backoff_factor"),
        ({"initial_backoff": "-1s"}, "retry.initial_backoff"),
        ({"max_backoff": 1.5}, "retry.max_backoff"),
        ({"retry_on": "timeout"}, "retry.retry_on"),
        ({"retry_on": ["a", "a"]}, "retry.retry_on[1]"),
    ],
)
def test_retry_is_checked_when_built(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(Invalid) as info:
        Retry(**kwargs)
    assert info.value.field == field


def test_timeouts_in_every_form() -> None:
    w = (
        Workflow("w")
        .then(classify, timeout=1500)
        .then(draft, timeout=datetime.timedelta(seconds=2))
        .then(send, timeout="1h30m")
    )
    assert [s.timeout_ms for s in w.definition.steps] == [1500, 2000, 5_400_000]  # type: ignore[union-attr]


# --- durations -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "ms"),
    [
        (1, 1),
        (250, 250),
        ("500ms", 500),
        ("30s", 30_000),
        ("2m", 120_000),
        ("1h", 3_600_000),
        ("1d", 86_400_000),
        ("1h30m", 5_400_000),
        ("1d12h", 129_600_000),
        ("1m30s250ms", 90_250),
        ("90s", 90_000),
        ("0010s", 10_000),
        (datetime.timedelta(milliseconds=7), 7),
        (datetime.timedelta(days=1, seconds=1), 86_401_000),
    ],
)
def test_durations(value: Any, ms: int) -> None:
    assert parse_duration(value, field="d") == ms


@pytest.mark.parametrize("value", [0, "0s", "0ms", datetime.timedelta(0)])
def test_zero_only_where_allowed(value: Any) -> None:
    assert parse_duration(value, field="d", allow_zero=True) == 0
    with pytest.raises(Invalid):
        parse_duration(value, field="d")


@pytest.mark.parametrize(
    "value",
    [
        "",
        "30",
        "s",
        "1.5s",
        "-1s",
        "+1s",
        " 30s",
        "30s ",
        "30 s",
        "1m1h",
        "1h1h",
        "1ms1s",
        "1S",
        "1w",
        1.5,
        True,
        None,
        -1,
        datetime.timedelta(microseconds=1500),
        datetime.timedelta(seconds=-1),
        [30],
    ],
    ids=repr,
)
def test_bad_durations(value: Any) -> None:
    with pytest.raises(Invalid) as info:
        parse_duration(value, field="steps[0].timeout", allow_zero=True)
    assert info.value.field == "steps[0].timeout"
