"""The OpenAPI document: valid 3.1, complete, closed over its $refs, and honest.

"Honest" is checked against the engine itself: what the engine produces (the
golden runs' status views and journals, a real lease, filled definitions) must
validate against the response schemas, and what a request schema refuses in a
definition the daemon's parser must refuse too (schemathesis' negative-data
check relies on that direction). The validator-based checks need
``openapi-spec-validator`` / ``jsonschema``; the structural checks do not.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from stepd.actors.daemon.audit import AuditAction, AuditEntry
from stepd.sansio.definition import (
    BUDGET_NAMES,
    STEP_TYPES,
    Budgets,
    Definition,
    Delivery,
    RetryPolicy,
    StepKind,
    parse_definition,
)
from stepd.sansio.errors import Invalid
from stepd.sansio.events import AttemptOffered
from stepd.sansio.lease import REASONS
from stepd.sansio.run import RunMachine
from stepd.sansio.status import ErrorReason, RunStatus
from stepd.transport import openapi
from stepd.transport.auth import Need, Scope
from stepd.transport.openapi import load_openapi

GOLDEN = Path(__file__).resolve().parents[1] / "sansio" / "golden"
METHODS = ("get", "put", "post", "delete", "patch", "head", "options", "trace")

# Every HTTP endpoint of PROTOCOL.md: (method, path) -> need (None: no auth).
ENDPOINTS: dict[tuple[str, str], str | None] = {
    ("post", "/v1/api/workers/register"): "worker",
    ("post", "/v1/api/steps/claim"): "worker",
    ("post", "/v1/api/steps/{lease}/started"): "worker",
    ("post", "/v1/api/steps/{lease}/heartbeat"): "worker",
    ("post", "/v1/api/steps/{lease}/complete"): "worker",
    ("post", "/v1/api/steps/{lease}/fail"): "worker",
    ("get", "/v1/api/steps/{lease}/history"): "worker",  # sticky execution (docs/affinity.md)
    ("post", "/v1/api/sessions/{session}/renew"): "worker",  # worker sessions (docs/affinity.md)
    ("post", "/v1/api/sessions/{session}/close"): "worker",
    ("post", "/v1/api/runs"): "execute",
    ("get", "/v1/api/runs"): "read",
    ("get", "/v1/api/runs/{run}"): "read",
    ("get", "/v1/api/runs/{run}/journal"): "read",
    ("get", "/v1/api/runs/{run}/export"): "read",
    ("get", "/v1/api/runs/{run}/result"): "read",
    ("post", "/v1/api/runs/{run}/signal"): "execute",
    ("post", "/v1/api/runs/{run}/cancel"): "execute",
    ("post", "/v1/api/runs/{run}/retry"): "execute",
    ("post", "/v1/api/runs/{run}/fork"): "execute",
    ("get", "/v1/api/workers"): "read",
    ("get", "/v1/api/audit"): "admin",
    ("get", "/v1/api/actors"): "admin",
    ("post", "/v1/api/actors/kill"): "admin",
    ("get", "/v1/api/definitions"): "read",
    ("get", "/v1/api/stats"): "read",
    ("get", "/v1/api/daemon"): "read",  # the console's Daemon page (docs/console.md)
    ("post", "/v1/api/schedules"): "execute",
    ("get", "/v1/api/schedules"): "read",
    ("get", "/v1/api/schedules/{schedule}"): "read",
    ("delete", "/v1/api/schedules/{schedule}"): "execute",
    ("post", "/v1/api/schedules/{schedule}/pause"): "execute",
    ("post", "/v1/api/schedules/{schedule}/resume"): "execute",
    ("post", "/v1/api/runs/prune"): "admin",
    ("get", "/healthz"): None,
    ("get", "/metrics"): None,
}


@pytest.fixture(scope="module")
def doc() -> dict[str, Any]:
    return load_openapi()


def operations(doc: dict[str, Any]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    for path, item in doc["paths"].items():
        for method in METHODS:
            if method in item:
                yield method, path, item[method]


def refs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):
                yield value
            elif key == "mapping" and isinstance(value, dict):
                yield from value.values()  # discriminator mappings are references too
            else:
                yield from refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from refs(value)


def resolve(doc: dict[str, Any], ref: str) -> Any:
    assert ref.startswith("#/"), f"only local references: {ref}"
    node: Any = doc
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        assert isinstance(node, dict) and part in node, f"unresolved $ref {ref}"
        node = node[part]
    return node


# --------------------------------------------------------------------------- loading


def test_load_is_cached_and_returns_copies() -> None:
    first = load_openapi()
    first["info"]["title"] = "changed"
    assert load_openapi()["info"]["title"] == "stepd HTTP API"
    assert openapi.openapi_bytes() is openapi.openapi_bytes()
    assert json.loads(openapi.openapi_bytes()) == load_openapi()


def test_document_file_is_next_to_the_module() -> None:
    here = Path(openapi.__file__).resolve().parent / openapi.OPENAPI_FILE
    assert here.read_bytes() == openapi.openapi_bytes()


# --------------------------------------------------------------------------- validity


def test_valid_openapi_3_1(doc: dict[str, Any]) -> None:
    validator = pytest.importorskip("openapi_spec_validator")
    assert doc["openapi"].startswith("3.1.")
    validator.validate(doc)


def test_every_ref_resolves_and_every_component_is_used(doc: dict[str, Any]) -> None:
    used = set(refs(doc))
    for ref in used:
        resolve(doc, ref)
    for section in ("schemas", "responses", "parameters"):
        for name in doc["components"][section]:
            assert f"#/components/{section}/{name}" in used, f"unused component {section}/{name}"


# --------------------------------------------------------------------------- completeness


def test_exactly_the_protocol_endpoints(doc: dict[str, Any]) -> None:
    found = {(method, path) for method, path, _ in operations(doc)}
    assert found == set(ENDPOINTS)


def test_operations_are_complete(doc: dict[str, Any]) -> None:
    ids = [op["operationId"] for _, _, op in operations(doc)]
    assert len(ids) == len(set(ids))
    for method, path, op in operations(doc):
        where = f"{method.upper()} {path}"
        responses = op["responses"]
        assert responses, where
        codes = set(responses)
        assert codes <= {"200", "201", "400", "401", "403", "404", "409", "413", "422", "503"}, (
            where
        )
        assert "503" in codes, f"{where}: every endpoint answers 503 while shutting down"
        assert codes & {"200", "201"}, where
        need = ENDPOINTS[(method, path)]
        if need is None:
            assert op["security"] == [], where
            assert "x-stepd-need" not in op
            assert not codes & {"401", "403"}, where
        else:
            assert op["security"] == [{"bearerAuth": []}], where
            assert op["x-stepd-need"] == need, where
            assert Need(need)  # a real Need
            assert {"401", "403"} <= codes, where
        if "requestBody" in op:
            assert "413" in codes and "400" in codes, where
            assert list(op["requestBody"]["content"]) == ["application/json"], where
        else:
            assert "413" not in codes, where
        if "{" in path:
            assert "404" in codes, where
        for code, response in responses.items():
            response = resolve(doc, response["$ref"]) if "$ref" in response else response
            assert response["description"], (where, code)
            assert "content" in response, (where, code)


def test_path_parameters_match_templates(doc: dict[str, Any]) -> None:
    for path, item in doc["paths"].items():
        names = set(re.findall(r"\{([^}]+)\}", path))
        for method in METHODS:
            if method not in item:
                continue
            params = [resolve(doc, p["$ref"]) if "$ref" in p else p
                      for p in item.get("parameters", []) + item[method].get("parameters", [])]  # fmt: skip
            declared = {p["name"] for p in params if p["in"] == "path"}
            assert declared == names, path
            assert all(p["required"] for p in params if p["in"] == "path")


def test_audit_actions_cover_the_audited_endpoints(doc: dict[str, Any]) -> None:
    actions = [op.get("x-stepd-audit") for _, _, op in operations(doc)]
    audited = [a for a in actions if a is not None]
    assert sorted(audited) == sorted(a.value for a in AuditAction)  # each exactly once
    for method, path, op in operations(doc):
        if ENDPOINTS[(method, path)] in ("worker", None):
            assert "x-stepd-audit" not in op, "worker calls and /healthz, /metrics are not audited"


def test_websocket_endpoint_is_mentioned(doc: dict[str, Any]) -> None:
    assert "/v1/api/workers/connect" in doc["info"]["description"]
    assert "/v1/api/workers/connect" not in doc["paths"]


# --------------------------------------------------------------------------- agreement with the code


def schema(doc: dict[str, Any], name: str) -> dict[str, Any]:
    return doc["components"]["schemas"][name]  # type: ignore[no-any-return]


def test_vocabularies_match_the_code(doc: dict[str, Any]) -> None:
    assert schema(doc, "RunStatusName")["enum"] == [s.value for s in RunStatus]
    assert schema(doc, "RunError")["properties"]["reason"]["enum"] == [r.value for r in ErrorReason]
    assert schema(doc, "BudgetName")["enum"] == list(BUDGET_NAMES)
    assert schema(doc, "Conflict")["properties"]["reason"]["enum"] == list(REASONS)
    assert schema(doc, "Scope")["enum"] == [s.value for s in Scope]
    assert schema(doc, "Delivery")["enum"] == [d.value for d in Delivery]
    assert schema(doc, "AuditEntry")["properties"]["action"]["enum"] == [
        a.value for a in AuditAction
    ]
    assert set(schema(doc, "AuditEntry")["required"]) == set(
        AuditEntry(0, None, None, "runs.read", None, 200).to_dict()
    )


def test_definition_schemas_have_exactly_the_parser_keys(doc: dict[str, Any]) -> None:
    mapping = schema(doc, "Step")["discriminator"]["mapping"]
    assert set(mapping) == {k.value for k in StepKind}
    # `session` is written only when set (a definition without sessions keeps its hash).
    minimal: dict[StepKind, dict[str, Any]] = {
        StepKind.TASK: {"id": "a", "body": "b", "session": "s"},
        StepKind.FOR_EACH: {"id": "a", "body": "b", "items": [], "session": "s"},
        StepKind.WAIT: {"id": "a", "event": "e"},
        StepKind.SLEEP: {"id": "a", "duration_ms": 0},
        StepKind.START_WORKFLOWS: {"id": "a", "workflow": "w", "items": []},
    }
    for kind, cls in STEP_TYPES.items():
        step_schema = resolve(doc, mapping[kind.value])
        assert step_schema["additionalProperties"] is False
        assert step_schema["properties"]["kind"] == {"const": kind.value}
        # A task's `local` keys are in its filled form only when it is local
        # (docs/affinity.md): the schema lists every key a step can have.
        extra = {"local": True} if kind is StepKind.TASK else {}
        assert set(step_schema["properties"]) == set(cls(**minimal[kind], **extra).to_json()), kind
    assert set(schema(doc, "Retry")["properties"]) == set(RetryPolicy().to_json())
    assert set(schema(doc, "Budgets")["properties"]) == set(Budgets().limits())
    d = parse_definition({"name": "n", "steps": [{"id": "a", "kind": "sleep", "duration_ms": 1}],
                          "sessions": {"s": {}}})
    assert set(schema(doc, "Definition")["properties"]) == set(d.to_json())
    assert set(schema(doc, "SessionSpec")["properties"]) == set(d.sessions["s"].to_json())


# --------------------------------------------------------------------------- schema validation


@pytest.fixture(scope="module")
def validate(doc: dict[str, Any]) -> Any:
    """validate(name, instance) -> list of error messages (empty: valid)."""
    jsonschema = pytest.importorskip("jsonschema")
    referencing = pytest.importorskip("referencing")
    from referencing.jsonschema import DRAFT202012

    uri = "urn:stepd:openapi"
    registry = referencing.Registry().with_resource(
        uri, referencing.Resource.from_contents(doc, default_specification=DRAFT202012)
    )
    checker = jsonschema.Draft202012Validator.FORMAT_CHECKER

    def run(name: str, instance: Any) -> list[str]:
        validator = jsonschema.Draft202012Validator(
            {"$ref": f"{uri}#/components/schemas/{name}"}, registry=registry, format_checker=checker
        )
        return [
            f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
            for e in validator.iter_errors(instance)
        ]

    return run


def golden() -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(GOLDEN.glob("*.json"))]


def test_golden_runs_validate(validate: Any) -> None:
    runs = golden()
    assert runs, "the run machine's golden journals are the fixtures"
    for run in runs:
        for raw in run["definitions"]:
            assert validate("Definition", raw) == []
            assert validate("Definition", parse_definition(raw).to_json()) == []
        status = dict(run["status"], run_id="r_01JDV5Z8Q3X4M6N7P8R9S0T1U2")
        assert validate("RunStatus", status) == []
        for event in run["journal"]:
            assert validate("JournalEvent", event) == [], event


def test_the_spec_example_definition_validates(validate: Any) -> None:
    research = {
        "name": "research_run",
        "version": "research.v2",
        "steps": [
            {"id": "plan", "kind": "task", "body": "plan_research", "input": "${input}"},
            {"id": "tasks", "kind": "for_each", "items": "${state.tasks}", "body": "execute_task",
             "into": "results", "max_parallel": 4},
            {"id": "approval", "kind": "wait", "event": "approved", "timeout_ms": 3600000, "into": "approval"},
            {"id": "pause", "kind": "sleep", "duration_ms": 1000},
            {"id": "children", "kind": "start_workflows", "workflow": "summarise",
             "items": "${state.results}", "wait": True, "into": "summaries"},
            {"id": "send", "kind": "task", "body": "send_summary", "delivery": "at_most_once",
             "retry": {"max_attempts": 1}},
        ],
        "budgets": {"max_transitions": 20, "max_for_each_items": 12, "max_state_bytes": 32768,
                    "max_cost_units": 40, "max_started_workflows": 8},
        "deadline_ms": 86400000,
    }  # fmt: skip
    parse_definition(research)
    assert validate("Definition", research) == []
    assert validate("RegisterRequest", {"definitions": [research], "concurrency": 8}) == []


def _machine_lease() -> tuple[RunMachine, dict[str, Any]]:
    d = parse_definition({
        "name": "wf", "version": "v1",
        "steps": [{"id": "fan", "kind": "for_each", "body": "b", "items": "${input.xs}"}],
        "budgets": {"max_transitions": 1},
    })  # fmt: skip
    run_id = "r_01JDV5Z8Q3X4M6N7P8R9S0T1U2"
    m, _ = RunMachine.start(run_id=run_id, definition=d, input={"xs": [1, 2]}, now_ms=5,
                            correlation={"ticket": "T-42"}, idempotency_key="k:1")  # fmt: skip
    tr = m.handle(
        AttemptOffered(
            "fan", 1, "l_01JDV5Z8Q3X4M6N7P8R9S0T1U3", "w_01JDV5Z8Q3X4M6N7P8R9S0T1U4", "worker-1"
        ),
        7,
    )
    assert tr.lease is not None
    return m, dict(tr.lease, lease_ttl_ms=30000)


def test_engine_lease_and_status_validate(validate: Any) -> None:
    m, lease = _machine_lease()
    assert validate("Lease", lease) == []
    assert validate("ClaimResponse", {"leases": [lease]}) == []
    assert validate("RunStatus", m.status_view()) == []


def test_audit_entry_validates(validate: Any) -> None:
    e = AuditEntry(1_700_000_000_000, "0123456789ab", "read", "runs.read", "r_01J", 200)
    assert validate("AuditEntry", e.to_dict()) == []
    assert (
        validate(
            "AuditEntry",
            AuditEntry(1, None, None, "runs.start", None, 401, "unknown_key").to_dict(),
        )
        == []
    )
    assert validate("AuditPage", {"entries": [e.to_dict()], "next_cursor": "00" * 16}) == []


def test_error_shapes(validate: Any) -> None:
    assert validate("Error", {"error": "invalid", "message": "m", "field": "steps[0].id"}) == []
    assert validate("Conflict", {"error": "conflict", "reason": "fenced", "message": "m"}) == []
    assert validate("Conflict", {"error": "conflict", "reason": "budget_exceeded", "message": "m"})
    assert validate("BudgetRefusal", {"error": "conflict", "reason": "budget_exceeded",
                                      "budget": "max_state_bytes", "message": "m"}) == []  # fmt: skip
    assert validate(
        "BudgetRefusal", {"error": "conflict", "reason": "budget_exceeded", "message": "m"}
    )


def test_free_json_is_free(validate: Any) -> None:
    for value in (None, 1, 1.5, "s", True, [], [1, {"a": None}], {"x": [1]}):
        assert validate("CompleteRequest", {"output": value}) == []
        assert validate("SignalRequest", {"name": "approved", "payload": value}) == []
        assert (
            validate("StartRunRequest", {"workflow": "w", "input": value, "correlation": value})
            == []
        )
        assert validate("HeartbeatRequest", {"progress": value}) == []


@pytest.mark.parametrize(
    ("name", "body"),
    [
        ("StartRunRequest", {"workflow": "w", "input": {}, "idempotencyKey": "typo"}),
        ("SignalRequest", {"name": "x", "paylod": 1}),
        ("KillRequest", {"path": "/runs/x", "force": True}),
        ("ClaimRequest", {"worker_id": "w_1", "maxx": 2}),
        ("CompleteRequest", {"output": 1, "statePatch": {}}),
        ("FailRequest", {"error": {"class": "fatal", "stack": "..."}}),
        ("StartedRequest", {"x": 1}),
        ("CancelRequest", {"why": "x"}),
        ("RetryRequest", {"from_step": "a"}),
        ("ForkRequest", {"from_step": "a", "step": "b"}),
    ],
)
def test_request_bodies_refuse_unknown_keys(validate: Any, name: str, body: dict[str, Any]) -> None:
    assert validate(name, body)


BASE_DEFINITION: dict[str, Any] = {
    "name": "wf",
    "steps": [
        {"id": "a", "kind": "task", "body": "b", "retry": {"max_attempts": 2}},
        {"id": "f", "kind": "for_each", "body": "b", "items": "${steps.a}", "max_parallel": 2},
        {"id": "w", "kind": "wait", "event": "go"},
        {"id": "s", "kind": "sleep", "duration_ms": 0},
        {"id": "c", "kind": "start_workflows", "workflow": "child", "items": [1, 2]},
    ],
    "budgets": {"max_transitions": 10},
}


def mutate(path: list[str | int], value: Any) -> dict[str, Any]:
    d = copy.deepcopy(BASE_DEFINITION)
    node: Any = d
    for part in path[:-1]:
        node = node[part]
    if value is DELETE:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return d


DELETE = object()

# Each mutation violates the Definition schema; the daemon's parser must refuse
# it as well (schema-invalid => daemon-invalid is what schemathesis'
# negative_data_rejection checks).
MUTATIONS: list[tuple[list[str | int], Any]] = [
    (["name"], ""),
    (["name"], "x" * 129),
    (["name"], 3),
    (["name"], DELETE),
    (["steps"], DELETE),
    (["steps"], []),
    (["extra"], 1),
    (["version"], ""),
    (["deadline_ms"], 0),
    (["deadline_ms"], "1"),
    (["budgets", "max_transitions"], -1),
    (["budgets", "max_cost"], 1),
    (["budgets"], None),
    (["steps", 0, "id"], "a.b"),
    (["steps", 0, "id"], "$end"),
    (["steps", 0, "id"], "x" * 129),
    (["steps", 0, "id"], ""),
    (["steps", 0, "kind"], "job"),
    (["steps", 0, "body"], DELETE),
    (["steps", 0, "bodyy"], "b"),
    (["steps", 0, "next"], "w"),
    (["steps", 0, "retry", "max_attempts"], 0),
    (["steps", 0, "retry", "initial_backoff_ms"], -1),
    (["steps", 0, "retry", "backoff_factor"], 0.5),
    (["steps", 0, "retry", "retry_on"], ["x", "x"]),
    (["steps", 0, "retry", "retry_on"], [""]),
    (["steps", 0, "retry", "jitter"], True),
    (["steps", 0, "retry"], None),
    (["steps", 0, "timeout_ms"], 0),
    (["steps", 0, "delivery"], "exactly_once"),
    (["steps", 0, "cost_units"], -1),
    (["steps", 0, "cost_units"], None),
    (["steps", 0, "_next_step"], "no such.step"),
    (["steps", 0, "_next_step"], "$END"),
    (["steps", 1, "items"], "${state.tasks} and more"),
    (["steps", 1, "items"], "$${state.tasks}"),
    (["steps", 1, "items"], "${nope.x}"),
    (["steps", 1, "items"], {"a": 1}),
    (["steps", 1, "items"], 3),
    (["steps", 1, "max_parallel"], 0),
    (["steps", 1, "into"], ""),
    (["steps", 2, "event"], ""),
    (["steps", 2, "retry"], {}),
    (["steps", 3, "duration_ms"], -1),
    (["steps", 3, "duration_ms"], DELETE),
    (["steps", 3, "duration_ms"], None),
    (["steps", 4, "wait"], "yes"),
    (["steps", 4, "wait"], None),
    (["steps", 4, "version"], ""),
    (["steps", 4, "delivery"], "at_most_once"),
]


def test_base_definition_is_valid(validate: Any) -> None:
    parse_definition(BASE_DEFINITION)
    assert validate("Definition", BASE_DEFINITION) == []


@pytest.mark.parametrize(
    ("path", "value"),
    MUTATIONS,
    ids=[f"{'.'.join(map(str, p))}={'<del>' if v is DELETE else v!r}"[:60] for p, v in MUTATIONS],
)
def test_schema_invalid_definitions_are_parser_invalid(
    validate: Any, path: list[str | int], value: Any
) -> None:
    d = mutate(path, value)
    assert validate("Definition", d), "the schema should refuse this mutation"
    with pytest.raises(Invalid):
        parse_definition(d)


def test_definition_type_is_a_definition(validate: Any) -> None:
    assert isinstance(parse_definition(BASE_DEFINITION), Definition)
