"""Workflow definitions: the model, strict parsing, defaults and the wire form.

A definition is data the daemon orchestrates; bodies are code workers hold
(WORKFLOWS.md "Definition"). Workers register definitions as JSON; this module
turns that JSON into frozen dataclasses, refusing anything half-valid with an
`Invalid` that names the definition and the exact field
(``steps[2].retry.max_attempts``), and turns them back into the wire form with
every default filled in, which is what `definition_hash` is computed over.

`parse_definition` is the only validating entry point: the dataclasses can be
built directly (tests, the run machine's fixtures), but nothing checks them then.
docs/definitions.md documents the wire format, every default, every rule and the
decisions the spec left open.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ._model import (
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
    Step,
    StepKind,
    TaskStep,
    WaitStep,
)
from ._parse import (
    MAX_DURATION_MS,
    MAX_INT,
    parse_budgets,
    parse_definition,
    parse_retry,
    parse_step,
)

__all__ = [
    "BUDGET_NAMES",
    "END",
    "MAX_DURATION_MS",
    "MAX_INT",
    "MAX_NAME_BYTES",
    "STEP_TYPES",
    "Budgets",
    "Definition",
    "Delivery",
    "ForEachStep",
    "RetryPolicy",
    "SleepStep",
    "StartWorkflowsStep",
    "Step",
    "StepKind",
    "TaskStep",
    "WaitStep",
    "definition_hash",
    "parse_budgets",
    "parse_definition",
    "parse_retry",
    "parse_step",
]


def definition_hash(definition_json: Mapping[str, Any]) -> str:
    """The ``definition_hash`` of a definition in wire form, raw or filled.

    WORKFLOWS.md "version and definition_hash": SHA-256 hex of the canonical JSON
    of the definition without ``version``, defaults filled in. The definition is
    parsed (strictly) and re-serialised first, so key order, whitespace, omitted
    defaults and ``version`` never change the result.

    Raises:
        Invalid: the definition does not validate (see `parse_definition`).
    """
    return parse_definition(definition_json).definition_hash
