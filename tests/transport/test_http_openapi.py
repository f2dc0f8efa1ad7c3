"""Every answer of the live daemon conforms to ``transport/openapi.json``.

A scenario touches every endpoint with successes and refusals; each response
is checked like schemathesis' ``status_code_conformance`` (the status is
documented for that operation) and ``response_schema_conformance`` (the body
validates against the documented schema).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from stepd.transport.http import route
from stepd.transport.openapi import load_openapi

from .conftest import KEYS, DaemonProcess, Worker, task_def, unique, wait_result

jsonschema = pytest.importorskip("jsonschema")
referencing = pytest.importorskip("referencing")

URI = "urn:stepd:openapi"


class Recorder:
    """Collects (method, path, status, body) of every response an httpx client receives."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, int, Any, str]] = []

    def hook(self, response: httpx.Response) -> None:
        response.read()
        ctype = response.headers.get("content-type", "")
        body = response.json() if ctype.startswith("application/json") else response.text
        self.seen.append((response.request.method, response.request.url.path,
                          response.status_code, body, ctype))


@pytest.fixture(scope="module")
def doc() -> dict[str, Any]:
    return load_openapi()


def _response_schema(doc: dict[str, Any], method: str, path: str, status: int
                     ) -> tuple[str | None, dict[str, Any] | None]:
    """(problem, schema) for a response: problem is set when the status is undocumented."""
    found = route(path)
    assert found is not None, path
    template = found[0]
    op = doc["paths"][template][method.lower()]
    responses = op["responses"]
    entry = responses.get(str(status))
    if entry is None:
        return f"{method} {template}: status {status} is not documented", None
    if "$ref" in entry:
        name = entry["$ref"].rsplit("/", 1)[1]
        entry = doc["components"]["responses"][name]
    content = entry.get("content", {})
    if "application/json" not in content:
        return None, None
    return None, content["application/json"]["schema"]


def _check(doc: dict[str, Any], recorder: Recorder) -> list[str]:
    from referencing.jsonschema import DRAFT202012

    registry = referencing.Registry().with_resource(
        URI, referencing.Resource.from_contents(doc, default_specification=DRAFT202012))
    problems = []
    for method, path, status, body, ctype in recorder.seen:
        problem, schema = _response_schema(doc, method, path, status)
        if problem:
            problems.append(problem)
            continue
        if schema is None:
            continue
        if not ctype.startswith("application/json"):
            problems.append(f"{method} {path} {status}: content-type {ctype}")
            continue
        resolved = _rebase(schema)
        validator = jsonschema.Draft202012Validator(
            resolved, registry=registry,
            format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
        for err in validator.iter_errors(body):
            problems.append(f"{method} {path} {status}: "
                            f"{'/'.join(map(str, err.absolute_path))}: {err.message}")
    return problems


def _rebase(schema: Any) -> Any:
    """Point the document's local ``#/...`` references at the registered document."""
    if isinstance(schema, dict):
        return {k: (f"{URI}{v}" if k == "$ref" and v.startswith("#") else _rebase(v))
                for k, v in schema.items()}
    if isinstance(schema, list):
        return [_rebase(x) for x in schema]
    return schema


@pytest.fixture
def recorded(daemon: DaemonProcess) -> Iterator[tuple[httpx.Client, Recorder]]:
    rec = Recorder()
    with daemon.client(event_hooks={"response": [rec.hook]}) as client:
        yield client, rec


def test_the_answers_of_a_whole_scenario_conform(recorded: tuple[httpx.Client, Recorder],
                                                 doc: dict[str, Any]) -> None:
    http, rec = recorded
    name, waiting = unique(), unique()
    w = Worker(http, [task_def(name, "a", "b"),
                      {"name": waiting, "budgets": {"max_state_bytes": 64},
                       "steps": [{"id": "w", "kind": "wait", "event": "go", "into": "go"}]}])
    http.post("/v1/api/workers/register", json={"definitions": [{"name": "x"}]})  # 400
    http.post("/v1/api/workers/register", json={"definitions": [], "worker_id": "w_NOPE"})  # 404
    run_id = http.post("/v1/api/runs", json={"workflow": name, "input": {"i": 1},
                                             "idempotency_key": unique("k")}).json()["run_id"]
    http.post("/v1/api/runs", json={"workflow": unique(), "input": 1})  # 422
    http.post("/v1/api/runs", json={"workflow": name})  # 400
    http.post("/v1/api/runs", content=b"{")  # 400, not JSON
    http.post("/v1/api/runs", content=b" " * 70_000)  # 413
    http.post("/v1/api/steps/claim", json={"worker_id": "w_UNKNOWN"})  # 404
    lid = w.claim_one(run_id=run_id)["lease_id"]
    http.post(f"/v1/api/steps/{lid}/started")
    http.post(f"/v1/api/steps/{lid}/heartbeat", json={"progress": [1]})
    http.post(f"/v1/api/steps/{lid}/complete", json={"output": 1})
    http.post(f"/v1/api/steps/{lid}/complete", json={"output": 1})  # 409
    http.post(f"/v1/api/steps/{lid}/fail", json={"error": {"class": "fatal"}})  # 409
    http.post("/v1/api/steps/l_NOPE/heartbeat")  # 404
    http.post(f"/v1/api/steps/{lid}/started", json={"x": 1})  # 400
    b = w.claim_one(run_id=run_id)
    http.post(f"/v1/api/steps/{b['lease_id']}/started")
    http.post(f"/v1/api/steps/{b['lease_id']}/fail", json={"error": {"class": "fatal",
                                                                      "message": "no"}})
    wait_result(http, run_id)
    http.get(f"/v1/api/runs/{run_id}")
    http.get("/v1/api/runs", params={"workflow": name, "limit": 1})
    http.get("/v1/api/runs", params={"limit": 0})  # 400
    http.get(f"/v1/api/runs/{run_id}/journal", params={"after_seq": 1})
    http.get(f"/v1/api/runs/{run_id}/export")
    http.get(f"/v1/api/runs/{run_id}/result")
    http.get("/v1/api/runs/r_NOPE/result")  # 404
    parked = http.post("/v1/api/runs", json={"workflow": waiting, "input": None}).json()["run_id"]
    http.get(f"/v1/api/runs/{parked}")
    http.post(f"/v1/api/runs/{parked}/signal", json={"name": "go", "payload": "x" * 200})  # 409
    http.post(f"/v1/api/runs/{parked}/signal", json={"name": "go", "payload": 1})
    http.post(f"/v1/api/runs/{parked}/signal", json={"name": "go"})  # 409 run_terminal
    http.post(f"/v1/api/runs/{run_id}/cancel")  # 409
    http.get("/v1/api/workers")
    http.get("/v1/api/audit", params={"limit": 5})
    http.get("/v1/api/audit", params={"cursor": "x"})  # 400
    http.get("/v1/api/actors")
    http.post("/v1/api/actors/kill", json={"path": "/nothing"})  # 404
    http.post("/v1/api/actors/kill", json={"path": "/"})  # 400
    http.get("/healthz")
    http.get("/metrics")
    statuses = {s for _, _, s, _, _ in rec.seen}
    assert statuses >= {200, 201, 400, 404, 409, 413, 422}, statuses
    assert _check(doc, rec) == []


def test_refusals_of_auth_conform(auth_daemon: DaemonProcess, doc: dict[str, Any]) -> None:
    rec = Recorder()
    with auth_daemon.client(event_hooks={"response": [rec.hook]}) as http:
        http.get("/v1/api/runs")  # 401
        http.get("/v1/api/runs", headers={"Authorization": f"Bearer {KEYS['worker']}"})  # 403
        http.post("/v1/api/steps/claim", json={},
                  headers={"Authorization": f"Bearer {KEYS['read']}"})  # 403
    assert {s for _, _, s, _, _ in rec.seen} == {401, 403}
    assert _check(doc, rec) == []
