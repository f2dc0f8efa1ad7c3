"""Definitions: strict parsing with exact field paths, defaults, the wire form.

WORKFLOWS.md "Definition" and docs/definitions.md "Validation". Every rule is
checked through `parse_definition`, asserting the field path the error names.
"""

from __future__ import annotations

import copy
import json
import pickle
import types
from collections.abc import Callable
from typing import Any

import pytest

from stepd.sansio.definition import (
    BUDGET_NAMES,
    END,
    MAX_NAME_BYTES,
    STEP_TYPES,
    Budgets,
    Definition,
    Delivery,
    ForEachStep,
    RetryPolicy,
    SleepStep,
    StartWorkflowsStep,
    StepKind,
    TaskStep,
    WaitStep,
    definition_hash,
    parse_budgets,
    parse_definition,
    parse_retry,
    parse_step,
)
from stepd.sansio.errors import Invalid, field_path


def base() -> dict[str, Any]:
    """A valid definition with one step of each kind (indexes 0..4)."""
    return {
        "name": "support",
        "steps": [
            {"id": "plan", "kind": "task", "body": "plan"},
            {"id": "tasks", "kind": "for_each", "body": "execute", "items": "${state.tasks}"},
            {"id": "approval", "kind": "wait", "event": "approved"},
            {"id": "pause", "kind": "sleep", "duration_ms": 0},
            {"id": "children", "kind": "start_workflows", "workflow": "child", "items": [1, 2]},
        ],
    }


def refused(mutate: Callable[[dict[str, Any]], object]) -> Invalid:
    obj = base()
    mutate(obj)
    with pytest.raises(Invalid) as info:
        parse_definition(obj)
    return info.value


def step(i: int, **changes: Any) -> Callable[[dict[str, Any]], None]:
    def apply(obj: dict[str, Any]) -> None:
        obj["steps"][i].update(changes)

    return apply


def drop(i: int, key: str) -> Callable[[dict[str, Any]], None]:
    def apply(obj: dict[str, Any]) -> None:
        del obj["steps"][i][key]

    return apply


def top(**changes: Any) -> Callable[[dict[str, Any]], None]:
    def apply(obj: dict[str, Any]) -> None:
        obj.update(changes)

    return apply


def retry(i: int, **values: Any) -> Callable[[dict[str, Any]], None]:
    return step(i, retry=values)


NAN = float("nan")
INF = float("inf")

# (case id, mutation, expected field, a fragment of the message)
CASES: list[tuple[str, Callable[[dict[str, Any]], object], str, str]] = [
    # top level
    ("unknown top key", top(foo=1), "foo", "unknown key"),
    ("next spelled as python at top", top(budget={}), "budget", "unknown key"),
    ("version empty", top(version=""), "version", "non-empty string"),
    ("version not a string", top(version=2), "version", "non-empty string"),
    ("steps missing", lambda o: o.pop("steps"), "steps", "required"),
    ("steps not a list", top(steps={"a": 1}), "steps", "list of steps"),
    ("steps empty", top(steps=[]), "steps", "at least one step"),
    ("deadline zero", top(deadline_ms=0), "deadline_ms", "integer >= 1"),
    ("deadline negative", top(deadline_ms=-5), "deadline_ms", "integer >= 1"),
    ("deadline bool", top(deadline_ms=True), "deadline_ms", "integer >= 1"),
    ("deadline float", top(deadline_ms=1.5), "deadline_ms", "integer >= 1"),
    ("deadline text", top(deadline_ms="1h"), "deadline_ms", "integer >= 1"),
    # budgets
    ("budgets not an object", top(budgets=[1]), "budgets", "object"),
    ("budgets null", top(budgets=None), "budgets", "object"),
    ("unknown budget", top(budgets={"max_cost": 3}), "budgets.max_cost", "unknown key"),
    ("negative budget", top(budgets={"max_cost_units": -1}), "budgets.max_cost_units", ">= 0"),
    ("bool budget", top(budgets={"max_transitions": True}), "budgets.max_transitions", ">= 0"),
    ("float budget", top(budgets={"max_state_bytes": 1.5}), "budgets.max_state_bytes", ">= 0"),
    (
        "text budget",
        top(budgets={"max_started_workflows": "8"}),
        "budgets.max_started_workflows",
        ">= 0",
    ),
    # step shape
    ("step not an object", top(steps=["plan"]), "steps[0]", "JSON object"),
    ("id missing", drop(0, "id"), "steps[0].id", "required"),
    ("id empty", step(0, id=""), "steps[0].id", "letters, digits"),
    ("id with a dot", step(0, id="a.b"), "steps[0].id", "letters, digits"),
    ("id with a space", step(0, id="a b"), "steps[0].id", "letters, digits"),
    ("id starting with $", step(0, id="$end"), "steps[0].id", "reserved"),
    ("id a number", step(0, id=5), "steps[0].id", "letters, digits"),
    ("id a bool", step(0, id=True), "steps[0].id", "letters, digits"),
    ("id too long", step(0, id="a" * (MAX_NAME_BYTES + 1)), "steps[0].id", "at most"),
    ("duplicate id", step(2, id="plan"), "steps[2].id", "steps[0]"),
    ("kind missing", drop(0, "kind"), "steps[0].kind", "required"),
    ("kind unknown", step(0, kind="job"), "steps[0].kind", "one of task, for_each"),
    ("kind not a string", step(0, kind=1), "steps[0].kind", "one of"),
    ("unknown step key", step(0, bodyy="x"), "steps[0].bodyy", "unknown key"),
    ("next spelled as python", step(0, next="tasks"), "steps[0].next", "unknown key"),
    ("key of another kind", step(0, items=[]), "steps[0].items", "unknown key"),
    ("sleep with retry", step(3, retry={}), "steps[3].retry", "unknown key"),
    ("wait with body", step(2, body="x"), "steps[2].body", "unknown key"),
    ("task without body", drop(0, "body"), "steps[0].body", "required for a task"),
    ("for_each without items", drop(1, "items"), "steps[1].items", "required"),
    ("for_each without body", drop(1, "body"), "steps[1].body", "required"),
    ("wait without event", drop(2, "event"), "steps[2].event", "required"),
    ("sleep without duration", drop(3, "duration_ms"), "steps[3].duration_ms", "required"),
    ("start without workflow", drop(4, "workflow"), "steps[4].workflow", "required"),
    ("start without items", drop(4, "items"), "steps[4].items", "required"),
    # names
    ("body empty", step(0, body=""), "steps[0].body", "non-empty string"),
    ("body not a string", step(0, body=["plan"]), "steps[0].body", "non-empty string"),
    ("body too long", step(0, body="é" * 65), "steps[0].body", "at most 128 bytes"),
    ("event empty", step(2, event=""), "steps[2].event", "non-empty string"),
    ("workflow empty", step(4, workflow=""), "steps[4].workflow", "non-empty string"),
    ("child version empty", step(4, version=""), "steps[4].version", "non-empty string"),
    ("for_each into empty", step(1, into=""), "steps[1].into", "non-empty string"),
    ("wait into a number", step(2, into=3), "steps[2].into", "non-empty string"),
    ("start into empty", step(4, into=""), "steps[4].into", "non-empty string"),
    # retry
    ("retry not an object", step(0, retry=3), "steps[0].retry", "object"),
    ("retry null", step(0, retry=None), "steps[0].retry", "object"),
    ("retry unknown key", retry(0, max_attempt=2), "steps[0].retry.max_attempt", "unknown"),
    ("max_attempts zero", retry(0, max_attempts=0), "steps[0].retry.max_attempts", ">= 1"),
    ("max_attempts bool", retry(0, max_attempts=True), "steps[0].retry.max_attempts", ">= 1"),
    ("max_attempts float", retry(0, max_attempts=3.0), "steps[0].retry.max_attempts", ">= 1"),
    ("max_attempts text", retry(0, max_attempts="3"), "steps[0].retry.max_attempts", ">= 1"),
    (
        "initial backoff negative",
        retry(0, initial_backoff_ms=-1),
        "steps[0].retry.initial_backoff_ms",
        ">= 0",
    ),
    ("factor below one", retry(0, backoff_factor=0.5), "steps[0].retry.backoff_factor", "1.0"),
    ("factor bool", retry(0, backoff_factor=True), "steps[0].retry.backoff_factor", "1.0"),
    ("factor nan", retry(0, backoff_factor=NAN), "steps[0].retry.backoff_factor", "finite"),
    ("factor inf", retry(0, backoff_factor=INF), "steps[0].retry.backoff_factor", "finite"),
    ("factor text", retry(0, backoff_factor="2"), "steps[0].retry.backoff_factor", "number"),
    ("max backoff negative", retry(0, max_backoff_ms=-1), "steps[0].retry.max_backoff_ms", ">= 0"),
    ("retry_on text", retry(0, retry_on="timeout"), "steps[0].retry.retry_on", "list"),
    ("retry_on empty name", retry(0, retry_on=[""]), "steps[0].retry.retry_on[0]", "non-empty"),
    ("retry_on number", retry(0, retry_on=["a", 1]), "steps[0].retry.retry_on[1]", "non-empty"),
    ("retry_on duplicate", retry(0, retry_on=["a", "a"]), "steps[0].retry.retry_on[1]", "dupl"),
    ("for_each retry", retry(1, max_attempts=0), "steps[1].retry.max_attempts", ">= 1"),
    # task options
    ("timeout zero", step(0, timeout_ms=0), "steps[0].timeout_ms", ">= 1"),
    ("timeout negative", step(0, timeout_ms=-1), "steps[0].timeout_ms", ">= 1"),
    ("timeout bool", step(0, timeout_ms=True), "steps[0].timeout_ms", ">= 1"),
    ("timeout float", step(0, timeout_ms=1.5), "steps[0].timeout_ms", ">= 1"),
    ("for_each timeout", step(1, timeout_ms=0), "steps[1].timeout_ms", ">= 1"),
    ("wait timeout", step(2, timeout_ms=0), "steps[2].timeout_ms", ">= 1"),
    ("delivery unknown", step(0, delivery="sometimes"), "steps[0].delivery", "at_least_once"),
    ("delivery null", step(0, delivery=None), "steps[0].delivery", "at_most_once"),
    ("cost negative", step(0, cost_units=-1), "steps[0].cost_units", ">= 0"),
    ("cost bool", step(0, cost_units=False), "steps[0].cost_units", ">= 0"),
    ("cost null", step(0, cost_units=None), "steps[0].cost_units", ">= 0"),
    ("for_each cost negative", step(1, cost_units=-2), "steps[1].cost_units", ">= 0"),
    ("max_parallel zero", step(1, max_parallel=0), "steps[1].max_parallel", ">= 1"),
    ("max_parallel bool", step(1, max_parallel=True), "steps[1].max_parallel", ">= 1"),
    ("duration negative", step(3, duration_ms=-1), "steps[3].duration_ms", ">= 0"),
    ("duration bool", step(3, duration_ms=False), "steps[3].duration_ms", ">= 0"),
    ("duration float", step(3, duration_ms=0.5), "steps[3].duration_ms", ">= 0"),
    ("duration null", step(3, duration_ms=None), "steps[3].duration_ms", ">= 0"),
    ("wait flag text", step(4, wait="yes"), "steps[4].wait", "true or false"),
    ("wait flag number", step(4, wait=1), "steps[4].wait", "true or false"),
    # jumps
    ("next unknown", step(0, _next_step="nope"), "steps[0]._next_step", "no step has id"),
    ("next unknown $", step(0, _next_step="$stop"), "steps[0]._next_step", "reserved"),
    ("next empty", step(0, _next_step=""), "steps[0]._next_step", "step id or '$end'"),
    ("next a number", step(3, _next_step=1), "steps[3]._next_step", "step id or '$end'"),
    ("wait next unknown", step(2, _next_step="x"), "steps[2]._next_step", "no step"),
    # items
    ("items a number", step(1, items=3), "steps[1].items", "list or a single template"),
    ("items an object", step(1, items={"a": 1}), "steps[1].items", "list or a single"),
    ("items plain text", step(1, items="state.tasks"), "steps[1].items", "single template"),
    ("items interpolated", step(1, items="a ${state.x}"), "steps[1].items", "single template"),
    ("items escaped", step(1, items="$${state.x}"), "steps[1].items", "single template"),
    ("items null", step(4, items=None), "steps[4].items", "list or a single template"),
    ("items unclosed", step(1, items="${state.x"), "steps[1].items", "unclosed"),
    ("items use item", step(1, items="${item}"), "steps[1].items", "only defined"),
    ("start items use item_index", step(4, items=["${item_index}"]), "steps[4].items[0]", "only"),
    ("start items unknown step", step(4, items="${steps.ghost}"), "steps[4].items", "ghost"),
    # templates and JSON in inputs
    ("unknown root", step(0, input="${inputs}"), "steps[0].input", "unknown root"),
    ("unknown step", step(0, input={"a": ["${steps.ghost.x}"]}), "steps[0].input.a[0]", "ghost"),
    ("item in a task", step(0, input="${item}"), "steps[0].input", "only defined"),
    ("item_index in a task", step(0, input="n=${item_index}"), "steps[0].input", "only defined"),
    ("unclosed", step(0, input="${state.x"), "steps[0].input", "unclosed"),
    ("empty path", step(0, input="${}"), "steps[0].input", "empty path"),
    ("empty segment", step(0, input="${input..a}"), "steps[0].input", "empty segment"),
    ("bad segment", step(0, input="${input.a b}"), "steps[0].input", "segment"),
    ("spaces in path", step(0, input="${ input }"), "steps[0].input", "segment"),
    ("steps without id", step(0, input="${steps}"), "steps[0].input", "steps.<step id>"),
    ("run alone", step(0, input="${run}"), "steps[0].input", "run.id"),
    ("run unknown", step(0, input="${run.name}"), "steps[0].input", "run.id"),
    ("run.id deeper", step(0, input="${run.id.x}"), "steps[0].input", "string"),
    ("odd key path", step(0, input={"a b": "${nope}"}), "steps[0].input['a b']", "root"),
    ("for_each input", step(1, input={"x": "${steps.ghost}"}), "steps[1].input.x", "ghost"),
    ("input nan", step(0, input={"x": NAN}), "steps[0].input.x", "JSON"),
    ("input set", step(0, input={"x": {1, 2}}), "steps[0].input.x", "JSON"),
    ("input int key", step(0, input={1: "x"}), "steps[0].input", "not a string"),
    ("input bytes", step(0, input=[b"x"]), "steps[0].input[0]", "JSON"),
]


@pytest.mark.parametrize(
    ("mutate", "field", "fragment"),
    [pytest.param(m, f, frag, id=name) for name, m, f, frag in CASES],
)
def test_each_rule_names_the_exact_field(
    mutate: Callable[[dict[str, Any]], object], field: str, fragment: str
) -> None:
    exc = refused(mutate)
    assert exc.field == field
    assert exc.definition == "support"
    assert fragment in exc.message
    assert str(exc) == f"definition 'support': {field}: {exc.message}"


@pytest.mark.parametrize("name", [None, "", 3, True, ["support"], "é" * 65], ids=repr)
def test_a_bad_name_is_refused_without_a_definition_name(name: Any) -> None:
    obj = base()
    obj["name"] = name
    with pytest.raises(Invalid) as info:
        parse_definition(obj)
    assert info.value.field == "name"
    assert info.value.definition is None
    assert str(info.value).startswith("name: ")


def test_a_missing_name_is_refused() -> None:
    obj = base()
    del obj["name"]
    with pytest.raises(Invalid) as info:
        parse_definition(obj)
    assert (info.value.field, info.value.message) == ("name", "is required")


@pytest.mark.parametrize("obj", [None, [], "support", 3])
def test_a_definition_must_be_an_object(obj: Any) -> None:
    with pytest.raises(Invalid) as info:
        parse_definition(obj)
    assert info.value.field is None
    assert "JSON object" in info.value.message


def test_the_message_reads_well() -> None:
    exc = refused(retry(2 - 2, max_attempts=0))
    assert str(exc) == (
        "definition 'support': steps[0].retry.max_attempts: must be an integer >= 1, got 0"
    )
    assert repr(exc).startswith("Invalid('must be an integer >= 1, got 0'")


def test_the_first_problem_in_order_is_named() -> None:
    obj = base()
    obj["steps"][3]["duration_ms"] = -1
    obj["steps"][1]["max_parallel"] = 0
    obj["budgets"] = {"max_cost_units": -1}
    with pytest.raises(Invalid) as info:
        parse_definition(obj)
    assert info.value.field == "steps[1].max_parallel"


def test_within_a_step_the_id_is_checked_before_unknown_keys() -> None:
    exc = refused(step(0, id="a.b", bodyy=1))
    assert exc.field == "steps[0].id"


def test_unknown_keys_are_named_in_input_order() -> None:
    exc = refused(step(0, zz=1, aa=2))
    assert exc.field == "steps[0].zz"
    assert "expected one of id, kind, body, input, retry" in exc.message


def test_error_messages_show_json_spellings() -> None:
    assert refused(step(3, duration_ms=None)).message.endswith("got null")
    assert refused(step(3, duration_ms=True)).message.endswith("got true")
    long = refused(step(0, body=["x" * 100])).message
    assert long.endswith("...")
    assert len(long) < 120


# --- what is accepted -------------------------------------------------------------------


def test_defaults_are_filled_in() -> None:
    d = parse_definition(base())
    assert d.version is None
    assert d.budgets == Budgets()
    assert d.deadline_ms is None
    plan, tasks, approval, pause, children = d.steps
    assert plan == TaskStep(id="plan", body="plan")
    assert plan.input == "${input}"
    assert plan.retry == RetryPolicy(3, 200, 2.0, 30000, ())
    assert (plan.timeout_ms, plan.delivery, plan.cost_units, plan.next) == (
        None,
        Delivery.AT_LEAST_ONCE,
        1,
        None,
    )
    assert tasks == ForEachStep(id="tasks", body="execute", items="${state.tasks}")
    assert (tasks.into, tasks.max_parallel, tasks.input) == (None, None, "${item}")
    assert approval == WaitStep(id="approval", event="approved")
    assert pause == SleepStep(id="pause", duration_ms=0)
    assert children == StartWorkflowsStep(id="children", workflow="child", items=[1, 2])
    assert (children.version, children.wait, children.into) == (None, True, None)


FILLED_BASE = {
    "name": "support",
    "version": None,
    "steps": [
        {
            "id": "plan",
            "kind": "task",
            "body": "plan",
            "input": "${input}",
            "retry": {
                "max_attempts": 3,
                "initial_backoff_ms": 200,
                "backoff_factor": 2.0,
                "max_backoff_ms": 30000,
                "retry_on": [],
            },
            "timeout_ms": None,
            "delivery": "at_least_once",
            "cost_units": 1,
            "_next_step": None,
        },
        {
            "id": "tasks",
            "kind": "for_each",
            "body": "execute",
            "items": "${state.tasks}",
            "into": None,
            "max_parallel": None,
            "input": "${item}",
            "retry": {
                "max_attempts": 3,
                "initial_backoff_ms": 200,
                "backoff_factor": 2.0,
                "max_backoff_ms": 30000,
                "retry_on": [],
            },
            "timeout_ms": None,
            "delivery": "at_least_once",
            "cost_units": 1,
            "_next_step": None,
        },
        {
            "id": "approval",
            "kind": "wait",
            "event": "approved",
            "timeout_ms": None,
            "into": None,
            "_next_step": None,
        },
        {"id": "pause", "kind": "sleep", "duration_ms": 0, "_next_step": None},
        {
            "id": "children",
            "kind": "start_workflows",
            "workflow": "child",
            "items": [1, 2],
            "version": None,
            "wait": True,
            "into": None,
            "_next_step": None,
        },
    ],
    "budgets": {
        "max_transitions": None,
        "max_for_each_items": None,
        "max_state_bytes": None,
        "max_cost_units": None,
        "max_started_workflows": None,
    },
    "deadline_ms": None,
}


def test_to_json_writes_every_default() -> None:
    filled = parse_definition(base()).to_json()
    assert filled == FILLED_BASE
    # key for key, nothing more: the wire keys are the field names plus "kind"
    assert json.dumps(filled, sort_keys=True) == json.dumps(FILLED_BASE, sort_keys=True)


def full() -> dict[str, Any]:
    """A definition that sets every optional field to a non-default value."""
    return {
        "name": "full",
        "version": "full.v1",
        "steps": [
            {
                "id": "plan",
                "kind": "task",
                "body": "plan",
                "input": {"brief": "${input.brief}", "n": 3, "raw": "$${literal}"},
                "retry": {
                    "max_attempts": 5,
                    "initial_backoff_ms": 0,
                    "backoff_factor": 1.5,
                    "max_backoff_ms": 1000,
                    "retry_on": ["timeout", "rate_limited"],
                },
                "timeout_ms": 60000,
                "delivery": "at_most_once",
                "cost_units": 0,
                "_next_step": "tasks",
            },
            {
                "id": "tasks",
                "kind": "for_each",
                "body": "execute",
                "items": ["${steps.plan.tasks.0}", {"k": "${state.x}"}],
                "into": "results",
                "max_parallel": 2,
                "input": {"task": "${item}", "i": "${item_index}", "run": "${run.id}"},
                "retry": {"max_attempts": 1},
                "timeout_ms": 5,
                "delivery": "at_least_once",
                "cost_units": 7,
                "_next_step": "children",
            },
            {
                "id": "approval",
                "kind": "wait",
                "event": "approved",
                "timeout_ms": 3600000,
                "into": "approval",
                "_next_step": "$end",
            },
            {"id": "pause", "kind": "sleep", "duration_ms": 1000, "_next_step": "approval"},
            {
                "id": "children",
                "kind": "start_workflows",
                "workflow": "child",
                "items": "${steps.tasks}",
                "version": "child.v3",
                "wait": False,
                "into": "kids",
                "_next_step": "pause",
            },
        ],
        "budgets": {
            "max_transitions": 20,
            "max_for_each_items": 12,
            "max_state_bytes": 32768,
            "max_cost_units": 0,
            "max_started_workflows": 8,
        },
        "deadline_ms": 86400000,
    }


@pytest.mark.parametrize("make", [base, full])
def test_round_trip(make: Callable[[], dict[str, Any]]) -> None:
    d = parse_definition(make())
    again = parse_definition(d.to_json())
    assert again == d
    assert again.to_json() == d.to_json()
    assert again.definition_hash == d.definition_hash
    # through real JSON text too
    assert parse_definition(json.loads(json.dumps(d.to_json()))) == d


def test_every_optional_field_is_read() -> None:
    d = parse_definition(full())
    plan, tasks, approval, pause, children = d.steps
    assert isinstance(plan, TaskStep)
    assert plan.retry == RetryPolicy(5, 0, 1.5, 1000, ("timeout", "rate_limited"))
    assert (plan.timeout_ms, plan.delivery, plan.cost_units, plan.next) == (
        60000,
        Delivery.AT_MOST_ONCE,
        0,
        "tasks",
    )
    assert isinstance(tasks, ForEachStep)
    assert (tasks.into, tasks.max_parallel, tasks.cost_units) == ("results", 2, 7)
    assert tasks.retry == RetryPolicy(max_attempts=1)
    assert approval == WaitStep("approval", "approved", 3600000, "approval", END)
    assert pause == SleepStep("pause", 1000, "approval")
    assert children == StartWorkflowsStep(
        "children", "child", "${steps.tasks}", "child.v3", False, "kids", "pause"
    )
    assert d.budgets.limits() == {
        "max_transitions": 20,
        "max_for_each_items": 12,
        "max_state_bytes": 32768,
        "max_cost_units": 0,
        "max_started_workflows": 8,
    }
    assert d.deadline_ms == 86400000
    assert d.version == "full.v1"


def test_explicit_nulls_mean_the_default() -> None:
    obj = base()
    obj.update(version=None, deadline_ms=None, budgets={n: None for n in BUDGET_NAMES})
    obj["steps"][0].update(timeout_ms=None, _next_step=None)
    obj["steps"][1].update(into=None, max_parallel=None)
    obj["steps"][4].update(version=None)
    assert parse_definition(obj) == parse_definition(base())


def test_null_input_is_a_value_not_the_default() -> None:
    obj = base()
    obj["steps"][0]["input"] = None
    assert parse_definition(obj).steps[0].input is None  # type: ignore[union-attr]


def test_backoff_factor_may_be_written_as_an_integer() -> None:
    obj = base()
    obj["steps"][0]["retry"] = {"backoff_factor": 2}
    d = parse_definition(obj)
    factor = d.steps[0].retry.backoff_factor  # type: ignore[union-attr]
    assert factor == 2.0 and isinstance(factor, float)
    assert d.definition_hash == parse_definition(base()).definition_hash


def test_references_may_point_forward_and_loop() -> None:
    obj = base()
    obj["steps"][0]["input"] = {"later": "${steps.children.0}"}
    obj["steps"][0]["_next_step"] = "plan"  # a static self-loop: budgets bound it
    obj["steps"][2]["_next_step"] = END
    d = parse_definition(obj)
    assert d.steps[0].next == "plan"
    assert d.steps[2].next == END


def test_item_and_item_index_are_allowed_in_a_for_each_input() -> None:
    obj = base()
    obj["steps"][1]["input"] = {"x": "${item.a.0}", "i": "${item_index}", "s": "n=${item_index}"}
    parse_definition(obj)


def test_every_root_is_accepted() -> None:
    obj = base()
    obj["steps"][0]["input"] = [
        "${input}",
        "${input.a.b}",
        "${state}",
        "${state.x.0}",
        "${steps.plan}",
        "${steps.tasks.3.k}",
        "${run.id}",
        "${run.correlation}",
        "${run.correlation.ticket}",
        "a $ b $$ c $${not.a.path} ${input.x-y_z}",
    ]
    parse_definition(obj)


def test_a_name_at_the_byte_limit_is_accepted() -> None:
    obj = base()
    obj["name"] = "é" * (MAX_NAME_BYTES // 2)
    obj["steps"][0]["id"] = "a" * MAX_NAME_BYTES
    parse_definition(obj)


def test_any_mapping_is_accepted_and_nothing_is_shared() -> None:
    obj = base()
    obj["steps"][0]["input"] = {"nested": [{"a": 1}]}
    before = copy.deepcopy(obj)
    d = parse_definition(types.MappingProxyType(obj))
    assert obj == before
    obj["steps"][0]["input"]["nested"][0]["a"] = 2
    assert d.steps[0].input == {"nested": [{"a": 1}]}  # type: ignore[union-attr]
    out = d.to_json()
    out["steps"][0]["input"]["nested"].append(3)
    assert d.steps[0].input == {"nested": [{"a": 1}]}  # type: ignore[union-attr]


def test_tuples_are_accepted_as_lists() -> None:
    obj = base()
    obj["steps"] = tuple(obj["steps"])
    obj["steps"][4]["items"] = (1, (2, 3))
    d = parse_definition(obj)
    assert d.steps[4].items == [1, [2, 3]]  # type: ignore[union-attr]


# --- the model -----------------------------------------------------------------------------


def test_lookups() -> None:
    d = parse_definition(base())
    assert d.step("approval") is d.steps[2]
    assert d.index_of("children") == 4
    with pytest.raises(KeyError):
        d.step("nope")
    with pytest.raises(KeyError):
        d.index_of("nope")


def test_successor_follows_order_then_static_jumps() -> None:
    d = parse_definition(full())
    assert d.successor("plan") == "tasks"
    assert d.successor("approval") == END
    assert d.successor("pause") == "approval"
    plain = parse_definition(base())
    assert [plain.successor(s.id) for s in plain.steps] == [
        "tasks",
        "approval",
        "pause",
        "children",
        END,
    ]


def test_kinds_and_step_types() -> None:
    assert [cls.kind for cls in STEP_TYPES.values()] == list(StepKind)
    assert TaskStep.kind is StepKind.TASK
    assert {k.value for k in StepKind} == {"task", "for_each", "wait", "sleep", "start_workflows"}
    assert [d.value for d in Delivery] == ["at_least_once", "at_most_once"]
    assert all(STEP_TYPES[k].kind is k for k in StepKind)


def test_steps_are_frozen() -> None:
    d = parse_definition(base())
    with pytest.raises(AttributeError):
        d.steps[0].id = "x"  # type: ignore[misc]
    with pytest.raises(AttributeError):
        d.name = "x"  # type: ignore[misc]


def test_budgets_limits_follow_budget_names() -> None:
    assert list(Budgets().limits()) == list(BUDGET_NAMES)
    assert Budgets(max_cost_units=4).limits()["max_cost_units"] == 4


def test_definitions_hash_equal_when_equal_and_pickle() -> None:
    d1 = parse_definition(full())
    d2 = parse_definition(full())
    assert d1 == d2 and hash(d1) == hash(d2)
    assert {d1: 1}[d2] == 1
    assert pickle.loads(pickle.dumps(d1)) == d1
    other = full()
    other["version"] = "full.v2"
    assert parse_definition(other) != d1


def test_the_hash_is_cached_and_matches_the_canonical_function() -> None:
    d = parse_definition(full())
    first = d.definition_hash
    assert d.definition_hash is first
    assert first == definition_hash(full())
    assert len(first) == 64 and int(first, 16) >= 0


def test_direct_construction_builds_the_index() -> None:
    d = Definition(name="x", steps=(TaskStep(id="a", body="a"), SleepStep(id="b", duration_ms=1)))
    assert d.index_of("b") == 1
    assert d.successor("a") == "b"
    assert parse_definition(d.to_json()) == d


# --- retry policy ------------------------------------------------------------------------------


def test_backoff_grows_and_is_capped() -> None:
    policy = RetryPolicy()
    assert [policy.backoff_ms(a) for a in range(1, 10)] == [
        200,
        400,
        800,
        1600,
        3200,
        6400,
        12800,
        25600,
        30000,
    ]
    assert RetryPolicy(initial_backoff_ms=0).backoff_ms(5) == 0
    assert RetryPolicy(backoff_factor=1.0, initial_backoff_ms=7).backoff_ms(50) == 7
    assert RetryPolicy(backoff_factor=1.5, initial_backoff_ms=100).backoff_ms(3) == 225
    assert RetryPolicy(initial_backoff_ms=500, max_backoff_ms=100).backoff_ms(1) == 100


def test_backoff_does_not_overflow() -> None:
    assert RetryPolicy(backoff_factor=10.0).backoff_ms(10_000) == 30000
    assert RetryPolicy(backoff_factor=1e308, initial_backoff_ms=10).backoff_ms(3) == 30000


def test_backoff_attempts_are_one_based() -> None:
    with pytest.raises(ValueError):
        RetryPolicy().backoff_ms(0)


def test_retries_covers_retryable_and_retry_on() -> None:
    policy = RetryPolicy(retry_on=("timeout",))
    assert policy.retries("retryable")
    assert policy.retries("timeout")
    assert not policy.retries("fatal")
    assert not RetryPolicy().retries("timeout")


def test_parse_retry_and_budgets_directly() -> None:
    assert parse_retry({}) == RetryPolicy()
    with pytest.raises(Invalid) as info:
        parse_retry({"max_backoff_ms": -1}, field="x.retry")
    assert info.value.field == "x.retry.max_backoff_ms"
    assert parse_budgets({"max_transitions": 3}) == Budgets(max_transitions=3)
    with pytest.raises(Invalid) as budget_info:
        parse_budgets({"nope": 1})
    assert budget_info.value.field == "budgets.nope"


def test_parse_step_without_known_ids_skips_references() -> None:
    raw = {"id": "a", "kind": "task", "body": "b", "_next_step": "later", "input": "${steps.x}"}
    assert parse_step(raw, index=4).next == "later"
    with pytest.raises(Invalid) as info:
        parse_step(raw, index=4, known_ids=frozenset({"a"}))
    assert info.value.field == "steps[4].input"  # fields are checked in wire order
    assert info.value.definition is None


def test_invalid_pickles_with_its_location() -> None:
    exc = refused(step(0, cost_units=-1))
    again = pickle.loads(pickle.dumps(exc))
    assert (again.message, again.field, again.definition) == (
        exc.message,
        exc.field,
        exc.definition,
    )
    assert str(again) == str(exc)


def test_equal_definitions_may_differ_in_json_numbers_but_not_in_hash() -> None:
    # Python equality says 1 == 1.0; the hash of the JSON does not: compare hashes
    # to ask "same structure".
    a, b = base(), base()
    a["steps"][0]["input"] = {"x": 1}
    b["steps"][0]["input"] = {"x": 1.0}
    da, db = parse_definition(a), parse_definition(b)
    assert da == db and hash(da) == hash(db)
    assert da.definition_hash != db.definition_hash


def test_field_path_and_with_location() -> None:
    assert field_path("", "name") == "name"
    assert field_path("steps", 2) == "steps[2]"
    assert field_path("steps[2]", "retry") == "steps[2].retry"
    assert field_path("input", "a b") == "input['a b']"
    inner = Invalid("bad", field="a[0]")
    assert inner.with_location(field="steps[0].input").field == "steps[0].input.a[0]"
    assert Invalid("bad", field="[1]").with_location(field="x").field == "x[1]"
    assert Invalid("bad").with_location(field="x", definition="d").field == "x"
    located = Invalid("bad", definition="keep").with_location(definition="other")
    assert located.definition == "other"
    assert inner.field == "a[0]"  # the original is unchanged
