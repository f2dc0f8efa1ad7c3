"""``${path}`` templates: parsing (cached), the paths a value references, rendering.

WORKFLOWS.md "Templates" is the contract; docs/definitions.md "Templates" has the
grammar. In short:

* a string that is exactly ``"${path}"`` is replaced by the value at ``path``, of
  any type (type-preserving);
* ``${path}`` inside a longer string is interpolated as text: a string value is
  inserted as is, any other value as its canonical JSON text (``null``, ``true``,
  ``3``, ``[1,2]``, ``{"a":1}``);
* ``$${`` is a literal ``${`` (the only escape; a ``$`` anywhere else is literal);
* a path is a root, then ``.``-separated segments of ``[A-Za-z0-9_-]``. A segment
  of digits indexes a list (and is a plain key on an object). Roots: ``input``,
  ``state``, ``steps.<step id>``, ``item``, ``item_index``, ``run.id``,
  ``run.correlation``. ``steps`` needs a step id; ``run`` needs ``id`` or
  ``correlation``; ``item_index`` and ``run.id`` take no further segments.

Step ids cannot contain ``.`` (docs/definitions.md "Step ids"), so
``steps.a.b`` is always field ``b`` of step ``a``.

Rendering never re-renders what it substitutes: a state value that happens to
contain ``${...}`` is inserted as data, so a body cannot inject templates.
Object keys are never templates, only values are.
"""

from __future__ import annotations

import enum
import functools
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Final

from stepd.sansio.canonical import canonical_json
from stepd.sansio.errors import Invalid, TemplateError, field_path

from .frozen import frozen

__all__ = [
    "MISSING",
    "ROOTS",
    "Template",
    "TemplateContext",
    "TemplatePath",
    "compile_render",
    "iter_templates",
    "parse_template",
    "render",
    "template_paths",
]

ROOTS: Final = ("input", "state", "steps", "item", "item_index", "run")
"""The roots a template path may start with."""

_SEGMENT = re.compile(r"[A-Za-z0-9_-]+\Z")
_INDEX = re.compile(r"(?:0|[1-9][0-9]*)\Z")
_CACHE_SIZE = 4096


class _Missing(enum.Enum):
    MISSING = "MISSING"

    def __repr__(self) -> str:
        return "MISSING"


MISSING: Final = _Missing.MISSING
"""`TemplateContext.item` outside a for_each item: ``${item}`` does not resolve."""


@frozen
class TemplatePath:
    """One parsed ``${...}`` path.

    Attributes:
        text: the path as written, e.g. ``state.tasks.0`` (what errors name).
        root: one of `ROOTS`.
        segments: what follows the root, e.g. ``("tasks", "0")``. For ``steps``
            the first segment is the step id; for ``run`` it is ``id`` or
            ``correlation``.
    """

    text: str
    root: str
    segments: tuple[str, ...]

    @property
    def step_id(self) -> str | None:
        """The step id a ``steps.<id>...`` path names, else None."""
        return self.segments[0] if self.root == "steps" else None


@frozen
class Template:
    """A parsed template string.

    Attributes:
        text: the string as written.
        parts: literal text (``str``) and paths, in order; escapes already
            resolved in the literal text. Empty for the empty string.
        exact: the path when the whole string is exactly ``${path}`` (rendering
            then returns the value itself, any type), else None.
    """

    text: str
    parts: tuple[str | TemplatePath, ...]
    exact: TemplatePath | None

    @property
    def paths(self) -> tuple[TemplatePath, ...]:
        """The paths in this template, in order of appearance."""
        return tuple(part for part in self.parts if isinstance(part, TemplatePath))

    @property
    def is_literal(self) -> bool:
        """True when the string references no path (it may still hold escapes)."""
        return self.exact is None and all(isinstance(part, str) for part in self.parts)

    def render(self, ctx: TemplateContext) -> Any:
        """The value of this template in `ctx` (see the module docstring).

        Raises:
            TemplateError: a path does not resolve, or an interpolated value is
                not JSON.
        """
        if self.exact is not None:
            return _resolve(self.exact, ctx)
        out: list[str] = []
        for part in self.parts:
            if isinstance(part, str):
                out.append(part)
            else:
                out.append(_as_text(_resolve(part, ctx), part))
        return "".join(out)


@frozen
class TemplateContext:
    """What a template can see when a step is scheduled.

    Attributes:
        input: the run's input.
        state: the run's public state.
        steps: outputs of the steps that have completed, by step id (a for_each's
            output is the list of its item outputs).
        run_id: the run's id (``${run.id}``).
        correlation: the run's correlation value (``${run.correlation...}``).
        item: the current for_each item; `MISSING` outside a for_each item.
        item_index: the current item's 0-based index; None outside a for_each item.
    """

    input: Any
    state: Mapping[str, Any]
    steps: Mapping[str, Any]
    run_id: str
    correlation: Any
    item: Any = MISSING
    item_index: int | None = None


# --- parsing -----------------------------------------------------------------


@functools.lru_cache(maxsize=_CACHE_SIZE)
def parse_template(text: str) -> Template:
    """Parse a template string (cached: render runs for every scheduled step).

    Args:
        text: any string; one without ``${`` parses to a single literal part.

    Returns:
        The parsed `Template`.

    Raises:
        Invalid: an unclosed ``${``, an empty path, an empty segment, a segment
            with characters outside ``[A-Za-z0-9_-]``, an unknown root, or a root
            used with the wrong segments (``steps`` without a step id, ``run.x``,
            ``item_index.x``, ``run.id.x``). ``field`` is None; callers that know
            where the string sits add it (`iter_templates` does).
    """
    if "$" not in text:
        return Template(text, (text,) if text else (), None)
    parts: list[str | TemplatePath] = []
    literal: list[str] = []
    pos = 0
    end = len(text)
    while pos < end:
        dollar = text.find("$", pos)
        if dollar < 0:
            literal.append(text[pos:])
            break
        literal.append(text[pos:dollar])
        if text.startswith("$${", dollar):
            literal.append("${")
            pos = dollar + 3
        elif text.startswith("${", dollar):
            close = text.find("}", dollar + 2)
            if close < 0:
                raise Invalid(
                    f"unclosed '${{' at offset {dollar} in template {text!r} "
                    "(write '$${' for a literal '${')"
                )
            joined = "".join(literal)
            if joined:
                parts.append(joined)
            literal = []
            parts.append(_parse_path(text[dollar + 2 : close], text))
            pos = close + 1
        else:
            literal.append("$")
            pos = dollar + 1
    joined = "".join(literal)
    if joined:
        parts.append(joined)
    exact = parts[0] if len(parts) == 1 and isinstance(parts[0], TemplatePath) else None
    return Template(text, tuple(parts), exact)


def _parse_path(path: str, text: str) -> TemplatePath:
    if not path:
        raise Invalid(f"empty path '${{}}' in template {text!r}")
    segments = path.split(".")
    for segment in segments:
        if not segment:
            raise Invalid(f"empty segment in path {path!r} of template {text!r}")
        if _SEGMENT.match(segment) is None:
            raise Invalid(
                f"path {path!r} of template {text!r}: segment {segment!r} may only hold "
                "letters, digits, '_' and '-'"
            )
    root, rest = segments[0], tuple(segments[1:])
    if root not in ROOTS:
        raise Invalid(
            f"path {path!r} of template {text!r}: unknown root {root!r}; "
            f"expected one of {', '.join(ROOTS)}"
        )
    if root == "steps" and not rest:
        raise Invalid(f"path {path!r} of template {text!r}: write 'steps.<step id>'")
    if root == "run":
        if not rest or rest[0] not in ("id", "correlation"):
            raise Invalid(
                f"path {path!r} of template {text!r}: write 'run.id' or 'run.correlation'"
            )
        if rest[0] == "id" and len(rest) > 1:
            raise Invalid(f"path {path!r} of template {text!r}: 'run.id' is a string")
    if root == "item_index" and rest:
        raise Invalid(f"path {path!r} of template {text!r}: 'item_index' is an integer")
    return TemplatePath(path, root, rest)


# --- walking values ------------------------------------------------------------


def iter_templates(value: Any, field: str = "") -> Iterator[tuple[str, Template]]:
    """Every template string inside a JSON value, with its field path.

    Walks dicts (values only: keys are never templates) and lists/tuples;
    strings without a ``$`` are skipped.

    Args:
        value: a JSON value.
        field: the path of `value` itself, prefixed to the yielded paths
            (``steps[1].input`` gives ``steps[1].input.a[0]``).

    Yields:
        (field path, parsed template) for each string that holds a ``$``.

    Raises:
        Invalid: a string does not parse; ``field`` names where it sits.
    """
    if isinstance(value, str):
        if "$" in value:
            try:
                yield field, parse_template(value)
            except Invalid as exc:
                raise exc.with_location(field=field or None) from None
    elif isinstance(value, dict):
        for key, child in value.items():
            yield from iter_templates(child, field_path(field, str(key)))
    elif isinstance(value, (list, tuple)):
        for index, child in enumerate(value):
            yield from iter_templates(child, field_path(field, index))


def template_paths(value: Any) -> list[str]:
    """Every path referenced anywhere inside a JSON value, for validation.

    Args:
        value: a JSON value (a definition's ``input`` or ``items``).

    Returns:
        The path texts (``state.tasks``, ``steps.plan.out``), in order of first
        appearance, without duplicates.

    Raises:
        Invalid: a string does not parse; ``field`` names where it sits in `value`.
    """
    seen: dict[str, None] = {}
    for _, template in iter_templates(value):
        for path in template.paths:
            seen.setdefault(path.text, None)
    return list(seen)


# --- rendering -------------------------------------------------------------------


def render(value: Any, ctx: TemplateContext) -> Any:
    """Render every template string inside a JSON value.

    Dicts and lists are rebuilt (tuples come back as lists); other scalars are
    returned as they are. A string exactly ``${path}`` becomes the value at path,
    not a copy: treat the result as read-only, it may share structure with
    `ctx`.

    Args:
        value: a definition's ``input`` or ``items``.
        ctx: what the templates can see.

    Returns:
        The rendered value.

    Raises:
        TemplateError: a path does not resolve (``path`` names it), ``item`` or
            ``item_index`` is used outside a for_each item, or an interpolated
            value is not JSON.
        Invalid: a string is not a valid template (a definition that passed
            `parse_definition` never has one).
    """
    if isinstance(value, str):
        if "$" not in value:
            return value
        return parse_template(value).render(ctx)
    if isinstance(value, dict):
        return {key: render(child, ctx) for key, child in value.items()}
    if isinstance(value, (list, tuple)):
        return [render(child, ctx) for child in value]
    return value


#: `render` of one value, compiled (`compile_render`): ``renderer(ctx)``.
Renderer = Callable[["TemplateContext"], Any]


def compile_render(value: Any) -> Renderer:
    """`render` of `value` as one function, for a value rendered again and again (a
    step's ``input``, once per visit and item).

    What `render` decides anew each time (which strings hold templates, which
    children are containers, the parse) is decided here once: the function
    copies a container with its literal members in place and fills in only
    what holds a template, in the same key order; the result is what
    `render(value, ctx)` returns, containers rebuilt, and the same errors.

    Raises:
        Invalid: a string is not a valid template (as `render` would).
    """
    if isinstance(value, str):
        if "$" not in value:
            return functools.partial(_same, value)
        template = parse_template(value)
        if template.exact is not None:
            return functools.partial(_resolve, template.exact)
        return template.render
    if isinstance(value, dict):
        base = dict(value)
        parts = tuple((key, compile_render(child)) for key, child in value.items()
                      if not _literal(child))
        return functools.partial(_render_dict, base, parts)
    if isinstance(value, (list, tuple)):
        if all(_literal(child) for child in value):
            return functools.partial(_copy_list, value)
        fns = tuple(compile_render(child) for child in value)
        return functools.partial(_render_list, fns)
    return functools.partial(_same, value)


def _literal(value: Any) -> bool:
    """A scalar that renders as itself (a container is always rebuilt)."""
    if isinstance(value, str):
        return "$" not in value
    return not isinstance(value, (dict, list, tuple))


def _same(value: Any, ctx: TemplateContext) -> Any:
    return value


def _copy_list(value: list[Any] | tuple[Any, ...], ctx: TemplateContext) -> list[Any]:
    return list(value)


def _render_dict(base: dict[str, Any], parts: tuple[tuple[str, Renderer], ...],
                 ctx: TemplateContext) -> dict[str, Any]:
    out = base.copy()
    for key, fn in parts:
        out[key] = fn(ctx)
    return out


def _render_list(fns: tuple[Renderer, ...], ctx: TemplateContext) -> list[Any]:
    return [fn(ctx) for fn in fns]


def _resolve(path: TemplatePath, ctx: TemplateContext) -> Any:
    root = path.root
    segments = path.segments
    current: Any
    if root == "input":
        current, where = ctx.input, "input"
    elif root == "state":
        current, where = ctx.state, "state"
    elif root == "steps":
        step_id = segments[0]
        if step_id not in ctx.steps:
            raise TemplateError(
                f"step {step_id!r} has no output (it has not completed in this run)",
                path=path.text,
            )
        current, where = ctx.steps[step_id], f"steps.{step_id}"
        segments = segments[1:]
    elif root == "item":
        if ctx.item is MISSING:
            raise TemplateError("'item' is only defined inside a for_each item", path=path.text)
        current, where = ctx.item, "item"
    elif root == "item_index":
        if ctx.item_index is None:
            raise TemplateError(
                "'item_index' is only defined inside a for_each item", path=path.text
            )
        return ctx.item_index
    else:  # run: the parser allows only run.id and run.correlation[...]
        if segments[0] == "id":
            return ctx.run_id
        current, where = ctx.correlation, "run.correlation"
        segments = segments[1:]
    for segment in segments:
        current = _step_into(current, segment, where, path)
        where = f"{where}.{segment}"
    return current


def _step_into(current: Any, segment: str, where: str, path: TemplatePath) -> Any:
    if isinstance(current, Mapping):
        if segment in current:
            return current[segment]
        raise TemplateError(f"{where} has no key {segment!r}", path=path.text)
    if isinstance(current, (list, tuple)):
        if _INDEX.match(segment) is None:
            raise TemplateError(f"{where} is a list; {segment!r} is not an index", path=path.text)
        index = int(segment)
        if index < len(current):
            return current[index]
        raise TemplateError(f"{where} has no index {index} (length {len(current)})", path=path.text)
    raise TemplateError(f"{where} is {_kind(current)}, it has no field {segment!r}", path=path.text)


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return f"a {type(value).__name__}"


def _as_text(value: Any, path: TemplatePath) -> str:
    if isinstance(value, str):
        return value
    try:
        return canonical_json(value).decode("utf-8")
    except Invalid as exc:
        raise TemplateError(
            f"the value cannot be interpolated: {exc.message}", path=path.text
        ) from exc
