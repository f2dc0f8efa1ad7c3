"""Canonical JSON, state size and the definition hash.

WORKFLOWS.md "version and definition_hash": SHA-256 hex of the canonical JSON of
the definition without ``version``, keys sorted, no insignificant whitespace,
UTF-8, defaults filled in. The properties below are the rule's consequences:
key order, whitespace, omitted defaults and ``version`` never change the hash;
any structural change does.
"""

from __future__ import annotations

import copy
import hashlib
import json
import random
from collections import OrderedDict
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from stepd.sansio.canonical import (
    canonical_json,
    filled_definition_hash,
    state_bytes,
)
from stepd.sansio.definition import BUDGET_NAMES, definition_hash, parse_definition
from stepd.sansio.errors import Invalid

# --- canonical_json: known vectors ------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "encoded"),
    [
        ({}, b"{}"),
        ([], b"[]"),
        (None, b"null"),
        (True, b"true"),
        (0, b"0"),
        (-12, b"-12"),
        (2**70, b"1180591620717411303424"),
        (2.0, b"2.0"),
        (0.1, b"0.1"),
        (-0.0, b"-0.0"),
        (1e16, b"1e+16"),
        (1.5e-7, b"1.5e-07"),
        ("é\u2028☃𝄞", '"é\u2028☃𝄞"'.encode()),
        ('q"\\\n', b'"q\\"\\\\\\n"'),
        ({"b": 1, "a": [1, 2.5, None, True, "x"]}, b'{"a":[1,2.5,null,true,"x"],"b":1}'),
        ({"z": {"y": 1, "x": 2}, "a": ()}, b'{"a":[],"z":{"x":2,"y":1}}'),
        ({"é": 1, "e": 2, "E": 3, "10": 4, "9": 5}, '{"10":4,"9":5,"E":3,"e":2,"é":1}'.encode()),
        ((1, (2, 3)), b"[1,[2,3]]"),
    ],
)
def test_known_vectors(value: Any, encoded: bytes) -> None:
    assert canonical_json(value) == encoded


def test_it_matches_the_json_module_core() -> None:
    value = {"tasks": [{"id": i, "title": f"t{i} é", "score": i / 3} for i in range(20)]}
    expected = json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode()
    assert canonical_json(value) == expected


def test_dict_subclasses_encode_as_objects() -> None:
    assert canonical_json(OrderedDict([("b", 1), ("a", 2)])) == b'{"a":2,"b":1}'


@pytest.mark.parametrize(
    "value",
    [
        float("nan"),
        float("inf"),
        -float("inf"),
        {"a": [1, float("nan")]},
        {1: "x"},
        {"a": {"b": [{2: "x"}]}},
        {None: 1},
        {True: 1},
        {"a": 1, 2: 3},
        {1, 2},
        b"bytes",
        object(),
        "\ud800",
        {"k": "lone \udfff"},
        {"\ud800": 1},
    ],
    ids=repr,
)
def test_what_is_not_json_is_refused(value: Any) -> None:
    with pytest.raises(Invalid) as info:
        canonical_json(value)
    assert info.value.message.startswith("not canonical JSON")


def test_a_cycle_is_refused() -> None:
    value: list[Any] = []
    value.append(value)
    with pytest.raises(Invalid):
        canonical_json(value)
    loop: dict[str, Any] = {}
    loop["self"] = loop
    with pytest.raises(Invalid):
        canonical_json(loop)


def test_check_keys_false_skips_only_the_key_walk() -> None:
    assert canonical_json({"a": {1: 2}}, check_keys=False) == b'{"a":{"1":2}}'
    with pytest.raises(Invalid):
        canonical_json({"a": float("nan")}, check_keys=False)


def test_state_bytes_is_the_utf8_length() -> None:
    assert state_bytes({}) == 2
    assert state_bytes({"a": 1}) == len(b'{"a":1}')
    # 7 ASCII bytes of punctuation, 2 for "é", 3 for "☃": bytes, not characters
    assert state_bytes({"é": "☃"}) == 12
    with pytest.raises(Invalid):
        state_bytes({"x": float("inf")})
    assert state_bytes({"a": {1: 2}}, check_keys=False) == len(b'{"a":{"1":2}}')


_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)


@given(_JSON)
def test_canonical_json_round_trips_and_is_stable(value: Any) -> None:
    encoded = canonical_json(value)
    decoded = json.loads(encoded)
    assert canonical_json(decoded) == encoded
    # No whitespace outside strings (a string may hold ": " or a newline itself).
    assert encoded == json.dumps(decoded, sort_keys=True, separators=(",", ":"),
                                 ensure_ascii=False).encode()


# --- the definition hash: known vectors ------------------------------------------------------

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

# Pinned: a change here changes every registered definition's hash, so it must be
# deliberate (a new default, a renamed wire key) and noted in the changelog.
RESEARCH_RUN_HASH = "f8b12581f6ed79ab3ccea749ee5256b5f58814466f2ec889bc5e95563a2b1f8f"


def test_the_research_run_hash_is_pinned() -> None:
    assert definition_hash(RESEARCH_RUN) == RESEARCH_RUN_HASH


def test_the_hash_is_sha256_of_the_filled_json_without_version() -> None:
    filled = parse_definition(RESEARCH_RUN).to_json()
    del filled["version"]
    text = json.dumps(filled, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    assert hashlib.sha256(text.encode()).hexdigest() == RESEARCH_RUN_HASH


def test_raw_and_filled_forms_hash_alike() -> None:
    d = parse_definition(RESEARCH_RUN)
    filled = d.to_json()
    assert definition_hash(filled) == RESEARCH_RUN_HASH
    assert filled_definition_hash(filled) == RESEARCH_RUN_HASH
    assert d.definition_hash == RESEARCH_RUN_HASH


def test_filled_definition_hash_trusts_its_input() -> None:
    # documented: it hashes what it is given; only definition_hash fills defaults
    assert filled_definition_hash(RESEARCH_RUN) != RESEARCH_RUN_HASH


def test_definition_hash_refuses_an_invalid_definition() -> None:
    bad = copy.deepcopy(RESEARCH_RUN)
    bad["steps"][1]["max_parallel"] = 0  # type: ignore[index]
    with pytest.raises(Invalid) as info:
        definition_hash(bad)
    assert (info.value.definition, info.value.field) == ("research_run", "steps[1].max_parallel")


# --- the definition hash: properties ---------------------------------------------------------

_ID = st.from_regex(r"[A-Za-z0-9_-]{1,10}", fullmatch=True)
_NAME = st.text(min_size=1, max_size=12).filter(lambda s: len(s.encode()) <= 128)
_PLAIN = st.text(max_size=8).filter(lambda s: "$" not in s)
_SCALAR = (
    st.none()
    | st.booleans()
    | st.integers(-(2**40), 2**40)
    | st.floats(allow_nan=False, allow_infinity=False)
    | _PLAIN
)
_TEMPLATE = st.sampled_from(
    [
        "${input}",
        "${input.a.b}",
        "${state.x}",
        "${state.tasks.0}",
        "${run.id}",
        "pre ${input} post",
        "$${literal}",
        "cost $5",
        "${run.correlation.k}",
    ]
)
_JSON_INPUT = st.recursive(
    _SCALAR | _TEMPLATE,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_PLAIN, inner, max_size=3),
    max_leaves=6,
)
_POS = st.integers(1, 10**9)


def _maybe(
    draw: st.DrawFn, obj: dict[str, Any], key: str, strategy: st.SearchStrategy[Any]
) -> None:
    if draw(st.booleans()):
        obj[key] = draw(strategy)


@st.composite
def _retry(draw: st.DrawFn) -> dict[str, Any]:
    out: dict[str, Any] = {}
    _maybe(draw, out, "max_attempts", st.integers(1, 10))
    _maybe(draw, out, "initial_backoff_ms", st.integers(0, 10_000))
    _maybe(
        draw,
        out,
        "backoff_factor",
        st.integers(1, 5) | st.floats(1.0, 10.0, allow_nan=False, allow_infinity=False),
    )
    _maybe(draw, out, "max_backoff_ms", st.integers(0, 100_000))
    _maybe(draw, out, "retry_on", st.lists(_ID, max_size=3, unique=True))
    return out


@st.composite
def definitions(draw: st.DrawFn) -> dict[str, Any]:
    """A random valid definition in raw wire form (optional keys present or not)."""
    ids = draw(st.lists(_ID, min_size=1, max_size=5, unique=True))
    targets = st.sampled_from([*ids, "$end"]) | st.none()
    steps: list[dict[str, Any]] = []
    for step_id in ids:
        kind = draw(st.sampled_from(["task", "for_each", "wait", "sleep", "start_workflows"]))
        step: dict[str, Any] = {"id": step_id, "kind": kind}
        if kind in ("task", "for_each"):
            step["body"] = draw(_NAME)
            if kind == "for_each":
                step["items"] = draw(
                    st.sampled_from(["${state.tasks}", "${input.items}"])
                    | st.lists(_JSON_INPUT, max_size=3)
                )
                _maybe(draw, step, "into", _NAME | st.none())
                _maybe(draw, step, "max_parallel", st.integers(1, 64) | st.none())
                _maybe(
                    draw,
                    step,
                    "input",
                    _JSON_INPUT | st.just({"i": "${item_index}", "x": "${item}"}),
                )
            else:
                _maybe(draw, step, "input", _JSON_INPUT | st.just({"s": f"${{steps.{ids[0]}}}"}))
            _maybe(draw, step, "retry", _retry())
            _maybe(draw, step, "timeout_ms", _POS | st.none())
            _maybe(draw, step, "delivery", st.sampled_from(["at_least_once", "at_most_once"]))
            _maybe(draw, step, "cost_units", st.integers(0, 100))
        elif kind == "wait":
            step["event"] = draw(_NAME)
            _maybe(draw, step, "timeout_ms", _POS | st.none())
            _maybe(draw, step, "into", _NAME | st.none())
        elif kind == "sleep":
            step["duration_ms"] = draw(st.integers(0, 10**9))
        else:
            step["workflow"] = draw(_NAME)
            step["items"] = draw(st.just("${state.results}") | st.lists(_JSON_INPUT, max_size=3))
            _maybe(draw, step, "version", _NAME | st.none())
            _maybe(draw, step, "wait", st.booleans())
            _maybe(draw, step, "into", _NAME | st.none())
        _maybe(draw, step, "_next_step", targets)
        steps.append(step)
    definition: dict[str, Any] = {"name": draw(_NAME), "steps": steps}
    _maybe(draw, definition, "version", _NAME | st.none())
    if draw(st.booleans()):
        budgets: dict[str, Any] = {}
        for name in BUDGET_NAMES:
            _maybe(draw, budgets, name, st.integers(0, 10**6) | st.none())
        definition["budgets"] = budgets
    _maybe(draw, definition, "deadline_ms", _POS | st.none())
    return definition


def _shuffled(value: Any, rnd: random.Random) -> Any:
    if isinstance(value, dict):
        keys = list(value)
        rnd.shuffle(keys)
        return {key: _shuffled(value[key], rnd) for key in keys}
    if isinstance(value, list):
        return [_shuffled(v, rnd) for v in value]
    return value


_SETTINGS = settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow])


@_SETTINGS
@given(definitions())
def test_generated_definitions_round_trip(raw: dict[str, Any]) -> None:
    d = parse_definition(raw)
    assert parse_definition(d.to_json()) == d
    assert parse_definition(json.loads(json.dumps(d.to_json()))) == d


@_SETTINGS
@given(
    definitions(),
    st.randoms(use_true_random=False),
    st.sampled_from([None, 0, 1, 2, 4, "\t"]),
    st.sampled_from([(",", ":"), (", ", ": "), (" ,", " :  ")]),
)
def test_key_order_and_whitespace_never_change_the_hash(
    raw: dict[str, Any], rnd: random.Random, indent: int | str | None, separators: tuple[str, str]
) -> None:
    text = json.dumps(_shuffled(raw, rnd), indent=indent, separators=separators)
    assert definition_hash(json.loads(text)) == definition_hash(raw)


_NO_DEFAULT = object()


@_SETTINGS
@given(definitions(), st.randoms(use_true_random=False))
def test_omitting_a_defaulted_key_never_changes_the_hash(
    raw: dict[str, Any], rnd: random.Random
) -> None:
    filled = parse_definition(raw).to_json()
    expected = filled_definition_hash(filled)
    defaults = parse_definition({"name": "n", "steps": [{"id": "t", "kind": "task", "body": "b"}]})
    default_retry = defaults.steps[0].retry.to_json()  # type: ignore[union-attr]
    trimmed = copy.deepcopy(filled)
    for key in ("version", "deadline_ms"):
        if trimmed[key] is None and rnd.random() < 0.5:
            del trimmed[key]
    if all(v is None for v in trimmed["budgets"].values()) and rnd.random() < 0.5:
        del trimmed["budgets"]
    else:
        for name in list(trimmed["budgets"]):
            if trimmed["budgets"][name] is None and rnd.random() < 0.5:
                del trimmed["budgets"][name]
    step_defaults: dict[str, Any] = {
        "timeout_ms": None,
        "delivery": "at_least_once",
        "cost_units": 1,
        "_next_step": None,
        "into": None,
        "max_parallel": None,
        "version": None,
        "wait": True,
    }
    for step in trimmed["steps"]:
        input_default = "${item}" if step["kind"] == "for_each" else "${input}"
        for key in list(step):
            default = input_default if key == "input" else step_defaults.get(key, _NO_DEFAULT)
            if step[key] == default and rnd.random() < 0.5:
                del step[key]
            elif key == "retry":
                for rk in list(step["retry"]):
                    if step["retry"][rk] == default_retry[rk] and rnd.random() < 0.5:
                        del step["retry"][rk]
                if not step["retry"] and rnd.random() < 0.5:
                    del step["retry"]
    assert definition_hash(trimmed) == expected


@_SETTINGS
@given(definitions(), st.none() | _NAME, st.none() | _NAME)
def test_version_never_changes_the_hash(
    raw: dict[str, Any], first: str | None, second: str | None
) -> None:
    a = {**raw, "version": first}
    b = {**raw, "version": second}
    assert definition_hash(a) == definition_hash(b)
    assert parse_definition(a).definition_hash == parse_definition(b).definition_hash


def _mutations(raw: dict[str, Any], data: st.DataObject) -> dict[str, Any]:
    """One structural change that keeps the definition valid (or is assumed away)."""
    out = copy.deepcopy(raw)
    steps = out["steps"]
    choice = data.draw(
        st.sampled_from(
            [
                "add",
                "remove",
                "reorder",
                "body",
                "retry",
                "budget",
                "name",
                "deadline",
                "kind_field",
            ]
        )
    )
    if choice == "add":
        new_id = data.draw(_ID.filter(lambda i: i not in {s["id"] for s in steps}))
        position = data.draw(st.integers(0, len(steps)))
        steps.insert(position, {"id": new_id, "kind": "sleep", "duration_ms": 5})
    elif choice == "remove":
        assume(len(steps) > 1)
        del steps[data.draw(st.integers(0, len(steps) - 1))]
    elif choice == "reorder":
        assume(len(steps) > 1)
        i = data.draw(st.integers(0, len(steps) - 2))
        steps[i], steps[i + 1] = steps[i + 1], steps[i]
    elif choice == "body":
        bodies = [s for s in steps if "body" in s]
        assume(bodies)
        bodies[0]["body"] = bodies[0]["body"] + "_renamed"
    elif choice == "retry":
        tasks = [s for s in steps if s["kind"] in ("task", "for_each")]
        assume(tasks)
        retry = tasks[0].setdefault("retry", {})
        retry["max_attempts"] = retry.get("max_attempts", 3) + 1
    elif choice == "budget":
        name = data.draw(st.sampled_from(BUDGET_NAMES))
        budgets = out.setdefault("budgets", {})
        current = budgets.get(name)
        budgets[name] = (
            0 if current is None else (None if data.draw(st.booleans()) else current + 1)
        )
    elif choice == "name":
        out["name"] = out["name"] + "x"
    elif choice == "deadline":
        current = out.get("deadline_ms")
        out["deadline_ms"] = 1000 if current is None else current + 1
    else:
        last = steps[-1]
        if last["kind"] == "sleep":
            last["duration_ms"] += 1
        elif last["kind"] == "wait":
            last["event"] += "!"
        elif last["kind"] == "start_workflows":
            last["wait"] = not last.get("wait", True)
        else:
            last["cost_units"] = last.get("cost_units", 1) + 1
    return out


@_SETTINGS
@given(definitions(), st.data())
def test_any_structural_change_changes_the_hash(raw: dict[str, Any], data: st.DataObject) -> None:
    changed = _mutations(raw, data)
    try:
        changed_hash = definition_hash(changed)
    except Invalid:
        assume(False)  # e.g. removed a step another step jumps to
        return
    assert changed_hash != definition_hash(raw)
