"""``${path}`` templates: grammar, rendering, errors, caching (WORKFLOWS.md "Templates")."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stepd.sansio.errors import Invalid, TemplateError
from stepd.sansio.templates import (
    MISSING,
    ROOTS,
    Template,
    TemplateContext,
    TemplatePath,
    compile_render,
    iter_templates,
    parse_template,
    render,
    template_paths,
)


def ctx(**changes: Any) -> TemplateContext:
    base: dict[str, Any] = {
        "input": {"ticket": 42, "user": {"name": "Ana", "tags": ["a", "b"]}, "none": None},
        "state": {
            "tasks": [{"id": "t1"}, {"id": "t2"}],
            "count": 3,
            "flag": True,
            "ratio": 0.5,
            "empty": None,
            "text": "hi",
            "0": "zero key",
        },
        "steps": {"plan": {"tasks": ["x", "y"], "n": 2}, "tasks": [1, 2, 3], "silent": None},
        "run_id": "r_01J",
        "correlation": {"ticket": "T-42", "deep": {"k": [7]}},
    }
    base.update(changes)
    return TemplateContext(**base)


# --- parsing -----------------------------------------------------------------------


def test_a_string_without_dollar_is_one_literal() -> None:
    t = parse_template("hello")
    assert t == Template("hello", ("hello",), None)
    assert t.is_literal and t.paths == ()
    assert parse_template("").parts == ()


def test_an_exact_template() -> None:
    t = parse_template("${state.tasks.0}")
    path = TemplatePath("state.tasks.0", "state", ("tasks", "0"))
    assert t.exact == path
    assert t.parts == (path,)
    assert t.paths == (path,)
    assert not t.is_literal


def test_an_interpolated_template() -> None:
    t = parse_template("id=${input.ticket} by ${run.id}!")
    assert t.exact is None
    assert t.parts == (
        "id=",
        TemplatePath("input.ticket", "input", ("ticket",)),
        " by ",
        TemplatePath("run.id", "run", ("id",)),
        "!",
    )


def test_two_adjacent_paths_are_not_exact() -> None:
    t = parse_template("${input}${input}")
    assert t.exact is None
    assert len(t.paths) == 2


@pytest.mark.parametrize(
    ("text", "literal"),
    [
        ("$${input}", "${input}"),
        ("a $${b} c", "a ${b} c"),
        ("$$", "$$"),
        ("$", "$"),
        ("cost: $5", "cost: $5"),
        ("$$$", "$$$"),
        ("}", "}"),
        ("{$}", "{$}"),
        ("$${", "${"),
        ("$$${", "$${"),
    ],
)
def test_escapes_and_lone_dollars_are_literal(text: str, literal: str) -> None:
    t = parse_template(text)
    assert t.is_literal
    assert render(text, ctx()) == literal


def test_the_escape_applies_before_a_real_template() -> None:
    assert render("$${input.ticket}=${input.ticket}", ctx()) == "${input.ticket}=42"


def test_a_dollar_right_before_a_template_forms_the_escape() -> None:
    # documented limitation: "$${" always wins, so "$" + "${x}" cannot be written
    assert render("$${input.ticket}", ctx()) == "${input.ticket}"
    assert render("$ ${input.ticket}", ctx()) == "$ 42"


def test_step_path_exposes_its_step_id() -> None:
    assert parse_template("${steps.plan.n}").exact.step_id == "plan"  # type: ignore[union-attr]
    assert parse_template("${state.x}").exact.step_id is None  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("${input", "unclosed"),
        ("a ${state.x and more", "unclosed"),
        ("${}", "empty path"),
        ("${input.}", "empty segment"),
        ("${.input}", "empty segment"),
        ("${input..a}", "empty segment"),
        ("${ input}", "segment ' input'"),
        ("${input.a b}", "segment 'a b'"),
        ("${input.é}", "segment 'é'"),
        ("${input[0]}", "segment 'input[0]'"),
        ("${inputs}", "unknown root 'inputs'"),
        ("${State.x}", "unknown root"),
        ("${steps}", "steps.<step id>"),
        ("${run}", "run.id"),
        ("${run.name}", "run.id"),
        ("${run.id.x}", "'run.id' is a string"),
        ("${item_index.x}", "integer"),
        ("ok ${input} then ${nope}", "unknown root 'nope'"),
    ],
)
def test_syntax_errors_are_invalid(text: str, fragment: str) -> None:
    with pytest.raises(Invalid) as info:
        parse_template(text)
    assert fragment in info.value.message
    assert info.value.field is None


def test_roots_are_the_documented_ones() -> None:
    assert ROOTS == ("input", "state", "steps", "item", "item_index", "run")


def test_parsing_is_cached() -> None:
    text = "cached ${input.ticket} test_parsing_is_cached"
    before = parse_template.cache_info().hits
    first = parse_template(text)
    assert parse_template(text) is first
    assert parse_template.cache_info().hits == before + 1


def test_render_uses_the_cache() -> None:
    text = "${input.user.name} test_render_uses_the_cache"
    render(text, ctx())
    hits = parse_template.cache_info().hits
    render(text, ctx())
    render({"a": [text]}, ctx())
    assert parse_template.cache_info().hits == hits + 2


# --- rendering ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("${input}", {"ticket": 42, "user": {"name": "Ana", "tags": ["a", "b"]}, "none": None}),
        ("${input.ticket}", 42),
        ("${input.user.name}", "Ana"),
        ("${input.user.tags}", ["a", "b"]),
        ("${input.user.tags.1}", "b"),
        ("${input.none}", None),
        ("${state.tasks}", [{"id": "t1"}, {"id": "t2"}]),
        ("${state.tasks.1.id}", "t2"),
        ("${state.flag}", True),
        ("${state.ratio}", 0.5),
        ("${state.empty}", None),
        ("${state.0}", "zero key"),
        ("${steps.plan}", {"tasks": ["x", "y"], "n": 2}),
        ("${steps.plan.tasks.0}", "x"),
        ("${steps.tasks}", [1, 2, 3]),
        ("${steps.tasks.2}", 3),
        ("${steps.silent}", None),
        ("${run.id}", "r_01J"),
        ("${run.correlation}", {"ticket": "T-42", "deep": {"k": [7]}}),
        ("${run.correlation.ticket}", "T-42"),
        ("${run.correlation.deep.k.0}", 7),
    ],
)
def test_an_exact_template_keeps_the_type(text: str, value: Any) -> None:
    out = render(text, ctx())
    assert out == value
    assert type(out) is type(value)


def test_an_exact_template_returns_the_value_itself() -> None:
    c = ctx()
    assert render("${state.tasks}", c) is c.state["tasks"]


@pytest.mark.parametrize(
    ("text", "out"),
    [
        ("t=${input.ticket}", "t=42"),
        ("${input.user.name}!", "Ana!"),
        ("n=${input.none}", "n=null"),
        ("f=${state.flag}", "f=true"),
        ("r=${state.ratio}", "r=0.5"),
        ("list=${input.user.tags}", 'list=["a","b"]'),
        ("obj=${run.correlation.deep}", 'obj={"k":[7]}'),
        ("sorted=${steps.plan}", 'sorted={"n":2,"tasks":["x","y"]}'),
        ("${run.id}/${steps.plan.n}", "r_01J/2"),
        ("q=${state.text}", "q=hi"),
    ],
)
def test_interpolation_writes_text(text: str, out: str) -> None:
    assert render(text, ctx()) == out


def test_interpolated_strings_are_inserted_as_is() -> None:
    c = ctx(state={"s": 'quote " and é'})
    assert render("<${state.s}>", c) == '<quote " and é>'


def test_render_walks_dicts_and_lists() -> None:
    value = {
        "ticket": "${input.ticket}",
        "nested": [{"first": "${state.tasks.0}"}, "x-${run.id}", 3, None, True, 1.5],
        "${input.ticket}": "keys are not templates",
    }
    assert render(value, ctx()) == {
        "ticket": 42,
        "nested": [{"first": {"id": "t1"}}, "x-r_01J", 3, None, True, 1.5],
        "${input.ticket}": "keys are not templates",
    }


def test_render_turns_tuples_into_lists_and_leaves_scalars() -> None:
    assert render(("${input.ticket}", 2), ctx()) == [42, 2]
    assert render(5, ctx()) == 5
    assert render(None, ctx()) is None


def test_substituted_values_are_not_rendered_again() -> None:
    c = ctx(state={"evil": "${run.id}"})
    assert render("${state.evil}", c) == "${run.id}"
    assert render("x ${state.evil}", c) == "x ${run.id}"


def test_item_and_item_index_inside_a_for_each_item() -> None:
    c = ctx(item={"task": "t", "n": [5]}, item_index=3)
    assert render("${item}", c) == {"task": "t", "n": [5]}
    assert render("${item.n.0}", c) == 5
    assert render("${item_index}", c) == 3
    assert render("#${item_index}: ${item.task}", c) == "#3: t"


def test_a_null_item_is_an_item() -> None:
    assert render("${item}", ctx(item=None, item_index=0)) is None
    assert render("${item_index}", ctx(item=None, item_index=0)) == 0


@pytest.mark.parametrize("text", ["${item}", "${item.x}", "x ${item}"])
def test_item_outside_a_for_each_fails(text: str) -> None:
    assert ctx().item is MISSING
    with pytest.raises(TemplateError) as info:
        render(text, ctx())
    assert "for_each" in info.value.message
    assert info.value.path == text.split("${")[1].rstrip("}")


def test_item_index_outside_a_for_each_fails() -> None:
    with pytest.raises(TemplateError) as info:
        render("${item_index}", ctx())
    assert info.value.path == "item_index"


@pytest.mark.parametrize(
    ("text", "path", "fragment"),
    [
        ("${input.missing}", "input.missing", "input has no key 'missing'"),
        ("${input.user.age}", "input.user.age", "input.user has no key 'age'"),
        ("${state.tasks.2}", "state.tasks.2", "no index 2 (length 2)"),
        ("${state.tasks.01}", "state.tasks.01", "not an index"),
        ("${state.tasks.first}", "state.tasks.first", "is a list"),
        ("${state.count.x}", "state.count.x", "state.count is a number"),
        ("${state.text.0}", "state.text.0", "is a string"),
        ("${state.empty.x}", "state.empty.x", "is null"),
        ("${state.flag.x}", "state.flag.x", "is a boolean"),
        ("${steps.ghost}", "steps.ghost", "has not completed"),
        ("${steps.ghost.x}", "steps.ghost.x", "has not completed"),
        ("${steps.plan.nope}", "steps.plan.nope", "steps.plan has no key 'nope'"),
        ("${run.correlation.nope}", "run.correlation.nope", "run.correlation has no key"),
        ("a ${input.ticket} b ${state.nope} c", "state.nope", "state has no key 'nope'"),
        ({"deep": ["${input.nope}"]}, "input.nope", "no key"),
    ],
)
def test_an_unresolvable_path_is_named(text: Any, path: str, fragment: str) -> None:
    with pytest.raises(TemplateError) as info:
        render(text, ctx())
    assert info.value.path == path
    assert fragment in info.value.message
    assert str(info.value).startswith("${" + path + "}: ")


def test_a_value_that_is_not_json_cannot_be_interpolated() -> None:
    c = ctx(state={"bad": float("nan"), "obj": object()})
    with pytest.raises(TemplateError) as info:
        render("x=${state.bad}", c)
    assert info.value.path == "state.bad"
    with pytest.raises(TemplateError):
        render("x=${state.obj}", c)
    # as an exact template the value passes through untouched
    assert render("${state.obj}", c) is c.state["obj"]


def test_a_bad_template_at_render_is_invalid() -> None:
    with pytest.raises(Invalid):
        render({"a": "${oops"}, ctx())


def test_template_error_pickles() -> None:
    exc = TemplateError("nope", path="state.x")
    again = pickle.loads(pickle.dumps(exc))
    assert (again.message, again.path) == ("nope", "state.x")


# --- template_paths and iter_templates -------------------------------------------------------


def test_template_paths_in_order_without_duplicates() -> None:
    value = {
        "a": "${input.x}",
        "b": ["${state.y} and ${input.x}", {"c": "${steps.plan.out}"}],
        "d": "$${not.a.path}",
        "e": 3,
        "${input.key}": "keys do not count",
    }
    assert template_paths(value) == ["input.x", "state.y", "steps.plan.out"]
    assert template_paths("plain") == []
    assert template_paths("${item_index}") == ["item_index"]


def test_template_paths_names_where_a_bad_template_sits() -> None:
    with pytest.raises(Invalid) as info:
        template_paths({"a": [1, {"b c": "${nope}"}]})
    assert info.value.field == "a[1]['b c']"


def test_iter_templates_yields_field_paths() -> None:
    found = [(f, t.text) for f, t in iter_templates({"a": ["${input}", "x"], "b": "$"}, "in")]
    assert found == [("in.a[0]", "${input}"), ("in.b", "$")]


# --- properties ----------------------------------------------------------------------------------

_TEXT = st.text(alphabet="ab$.{}_ é", max_size=30)


@given(st.text(max_size=40).filter(lambda s: "$" not in s))
def test_text_without_dollar_renders_to_itself(text: str) -> None:
    assert render(text, ctx()) == text


@given(_TEXT)
def test_escaping_every_opening_gives_back_the_text(text: str) -> None:
    escaped = text.replace("${", "$${")
    t = parse_template(escaped)
    assert t.is_literal
    assert render(escaped, ctx()) == text


# A "$" right before "${" would form the escape "$${" (docs/definitions.md), so
# the lone dollar piece is followed by a space.
@given(st.lists(st.sampled_from(["${input.ticket}", "${run.id}", "-", "$ ", "$${x}"]), max_size=6))
def test_interpolation_is_concatenation(pieces: list[str]) -> None:
    text = "".join(pieces)
    expected = "".join(
        {"${input.ticket}": "42", "${run.id}": "r_01J", "$${x}": "${x}"}.get(p, p) for p in pieces
    )
    out = render(text, ctx())
    if text == "${input.ticket}":
        assert out == 42
    elif text == "${run.id}":
        assert out == "r_01J"
    else:
        assert out == expected


# --- compiled rendering (compile_render: a step's input, compiled once per definition) ----

_PIECES = ["${input.ticket}", "${state.tasks}", "${steps.plan}", "${run.id}",
           "ticket ${input.ticket}!", "$5", "$${x}", "plain", 7, 0.5, None, True]
_VALUES = st.recursive(
    st.sampled_from(_PIECES),
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.sampled_from(["a", "b", "c", "acc"]), inner, max_size=4),
    max_leaves=12,
)


@given(_VALUES)
def test_a_compiled_renderer_renders_what_render_does(value: Any) -> None:
    compiled = compile_render(value)
    for context in (ctx(), ctx(state={"tasks": []})):
        out = compiled(context)
        assert out == render(value, context)
        if isinstance(value, dict):
            assert list(out) == list(value)  # the same key order
            assert out is not value  # containers are rebuilt, as render rebuilds them


def test_a_compiled_renderer_rebuilds_containers_every_time() -> None:
    value = {"i": 1, "nested": {"k": [1, 2]}, "acc": "${steps.plan}"}
    compiled = compile_render(value)
    first, second = compiled(ctx()), compiled(ctx())
    assert first == second == render(value, ctx())
    assert first is not second and first["nested"] is not second["nested"]
    assert first["nested"]["k"] is not value["nested"]["k"]
    first["nested"]["k"].append(3)
    assert value["nested"]["k"] == [1, 2]  # the definition's own value is never handed out


def test_a_compiled_renderer_raises_what_render_raises() -> None:
    compiled = compile_render({"x": "${steps.nope.field}"})
    with pytest.raises(TemplateError) as caught:
        compiled(ctx())
    with pytest.raises(TemplateError) as expected:
        render({"x": "${steps.nope.field}"}, ctx())
    assert (caught.value.path, str(caught.value)) == (expected.value.path, str(expected.value))
    with pytest.raises(Invalid):
        compile_render({"x": "${nope}"})
