"""Token usage and its price: one price book for spans and steps alike.

WORKFLOWS.md "Step bodies": a body reports the tokens it spent, either as spans
(each span carries its own usage; the step's usage is the sum over all its
spans, nested ones included) or as an explicit `usage` that overrides the sum.
The daemon prices usage with one price book: model -> USD per million input
and output tokens. A model missing from the book costs 0 and is reported as
unpriced, so a typo in a model name shows up instead of silently costing
nothing.

Convention for spans: each span's `usage` is its *own* usage, exclusive of its
children; the daemon sums every span. (The Python SDK sends spans this way.)
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import Invalid


@dataclass(frozen=True, slots=True)
class Price:
    input_per_million: float
    output_per_million: float


@dataclass(frozen=True, slots=True)
class PriceBook:
    models: dict[str, Price] = field(default_factory=dict)

    @classmethod
    def load(cls, path: str | Path) -> PriceBook:
        """Read a TOML price book.

        Format::

            [models."gpt-4o"]
            input_per_million = 2.5
            output_per_million = 10.0

        Raises:
            Invalid: the file does not parse or a price is not a number >= 0.
        """
        try:
            data = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise Invalid(f"cannot read price book: {exc}", field="prices") from exc
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PriceBook:
        models = data.get("models", {})
        if not isinstance(models, dict):
            raise Invalid("must be a table of models", field="models")
        out: dict[str, Price] = {}
        for name, entry in models.items():
            if not isinstance(entry, dict):
                raise Invalid("must be a table", field=f"models.{name}")
            prices = []
            for key in ("input_per_million", "output_per_million"):
                value = entry.get(key, 0.0)
                if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                    raise Invalid("must be a number >= 0", field=f"models.{name}.{key}")
                prices.append(float(value))
            extra = set(entry) - {"input_per_million", "output_per_million"}
            if extra:
                raise Invalid(f"unknown key {min(extra)!r}", field=f"models.{name}")
            out[str(name)] = Price(*prices)
        return cls(out)

    def cost(self, model: str | None, input_tokens: int, output_tokens: int) -> float:
        price = self.models.get(model or "")
        if price is None:
            return 0.0
        return (input_tokens * price.input_per_million + output_tokens * price.output_per_million) / 1e6


def _tokens(usage: dict[str, Any], key: str, where: str) -> int:
    value = usage.get(key, 0)
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise Invalid("must be an integer >= 0", field=f"{where}.{key}")
    return value


def check_usage(usage: Any, where: str) -> dict[str, Any]:
    """Validate one usage object: {"model"?, "input_tokens"?, "output_tokens"?}.

    Raises:
        Invalid: naming the field.
    """
    if not isinstance(usage, dict):
        raise Invalid("must be an object", field=where)
    unknown = set(usage) - {"model", "input_tokens", "output_tokens", "cost_usd"}
    if unknown:
        raise Invalid(f"unknown key {min(unknown)!r}", field=where)
    model = usage.get("model")
    if model is not None and not isinstance(model, str):
        raise Invalid("must be a string", field=f"{where}.model")
    return {
        "model": model,
        "input_tokens": _tokens(usage, "input_tokens", where),
        "output_tokens": _tokens(usage, "output_tokens", where),
    }


def step_usage(
    usage: Any, spans: list[dict[str, Any]] | None, book: PriceBook, *, where: str = ""
) -> tuple[dict[str, Any] | None, list[dict[str, Any]] | None]:
    """Price a completion's usage: the explicit override, else the sum of its spans.

    `where` prefixes the fields an error names: a local step's record is priced
    the same way (``local_steps[0].spans[1].usage``).

    Returns the step's priced usage (None when nothing was reported) and the
    spans with each span's usage priced (`cost_usd` added).

    Raises:
        Invalid: a usage or span is malformed (naming the field).
    """
    priced_spans: list[dict[str, Any]] | None = None
    total_in = total_out = 0
    total_cost = 0.0
    any_usage = False
    if spans:
        priced_spans = []
        for i, span in enumerate(spans):
            span = dict(span)
            if span.get("usage") is not None:
                u = check_usage(span["usage"], f"{where}spans[{i}].usage")
                cost = book.cost(u["model"], u["input_tokens"], u["output_tokens"])
                span["usage"] = {**u, "cost_usd": cost}
                total_in += u["input_tokens"]
                total_out += u["output_tokens"]
                total_cost += cost
                any_usage = True
            priced_spans.append(span)
    if usage is not None:
        u = check_usage(usage, f"{where}usage")
        cost = book.cost(u["model"], u["input_tokens"], u["output_tokens"])
        return {**u, "cost_usd": cost}, priced_spans
    if not any_usage:
        return None, priced_spans
    return {"input_tokens": total_in, "output_tokens": total_out, "cost_usd": total_cost}, priced_spans
