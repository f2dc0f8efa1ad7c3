"""Version negotiation, the capability manifest and the capability gate, over raw HTTP and
the raw WebSocket against a real daemon (AFFINITY.md "Version negotiation and the
capability manifest"; tests/affinity/scenarios.toml: manifest truthfulness, mixed versions).

A raw worker (tests.campaign._common's links) sends exactly the bytes under test;
the SDK's own declaration is checked in tests/sdk/test_local_steps.py.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.campaign._common import Answer, HttpLink, WsLink, make_link
from tests.reliability.conftest import DaemonProcess, stop_daemon

from .conftest import events_of, start_fast_daemon, start_runs

pytestmark = pytest.mark.timeout(60)

TRANSPORTS = ["http", "ws"]

SUPPORTED = {"status": "supported"}
REJECTED = {"status": "rejected"}
MANIFEST = {"local_steps": SUPPORTED, "sessions": REJECTED, "sticky": REJECTED}
ALL_REJECTED = {"local_steps": REJECTED, "sessions": REJECTED, "sticky": REJECTED}


def definition(name: str) -> dict[str, Any]:
    return {"name": name, "steps": [
        {"id": "prep", "kind": "task", "body": "prep"},
        {"id": "norm", "kind": "task", "body": "norm", "local": True,
         "input": "${steps.prep}"},
        {"id": "tally", "kind": "task", "body": "tally"}]}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    d = start_fast_daemon(Path(tmp_path_factory.mktemp("negotiation")) / "data")
    try:
        yield d
    finally:
        stop_daemon(d)


@pytest.fixture(params=TRANSPORTS)
def link(request: pytest.FixtureRequest, daemon: DaemonProcess) -> Iterator[HttpLink | WsLink]:
    lk = make_link(request.param, daemon.url)
    try:
        yield lk
    finally:
        lk.close()


def error_field(answer: Answer) -> str | None:
    """The ``field`` of a 400, from either transport."""
    assert answer.kind == "error", answer
    detail = answer.detail
    if isinstance(detail, dict):  # a WebSocket error frame
        assert detail["status"] == 400, detail
        return detail.get("field")
    status, _, body = str(detail).partition(" ")
    assert status == "400", detail
    return json.loads(body).get("field")


def register(link: HttpLink | WsLink, name: str, **body: Any) -> Answer:
    return link.register({"name": "raw", "definitions": [definition(name)], **body})


# --------------------------------------------------------------------------- negotiation


@pytest.mark.parametrize(("theirs", "negotiated"), [
    (None, "1.0"), ("1.0", "1.0"), ("1.17", "1.17"), ("1.20", "1.20"), ("1.25", "1.20"),
    ("2.3", "1.20")])
def test_register_answers_the_lower_version(link: HttpLink | WsLink, theirs: str | None,
                                            negotiated: str) -> None:
    body = {} if theirs is None else {"protocol_version": theirs}
    answer = register(link, "neg-version", **body)
    assert answer.kind == "ok", answer
    assert answer.detail["protocol_version"] == negotiated


@pytest.mark.parametrize(("body", "field"), [
    # Capability data below 1.18.
    ({"protocol_version": "1.17", "capabilities": ["local_steps"], "manifest": MANIFEST},
     "capabilities"),
    ({"protocol_version": "1.17", "manifest": ALL_REJECTED}, "manifest"),
    # No protocol_version: an old worker, 1.0, may not declare capabilities.
    ({"capabilities": ["local_steps"], "manifest": MANIFEST}, "capabilities"),
    # A manifest missing one of the three.
    ({"protocol_version": "1.20", "manifest": {"local_steps": SUPPORTED, "sessions": REJECTED}},
     "manifest.sticky"),
    # A flat capability the manifest does not mark supported.
    ({"protocol_version": "1.20", "capabilities": ["local_steps"], "manifest": ALL_REJECTED},
     "capabilities"),
    ({"protocol_version": "1.20", "capabilities": ["local_steps"]}, "manifest"),
    ({"protocol_version": "1.20", "manifest": {**MANIFEST, "sticky": {"status": "maybe"}}},
     "manifest.sticky.status"),
])
def test_capability_declarations_the_daemon_refuses_name_the_field(
        link: HttpLink | WsLink, body: dict[str, Any], field: str) -> None:
    assert error_field(register(link, "neg-refused", **body)) == field


def test_a_truthful_manifest_is_stored_as_declared(link: HttpLink | WsLink,
                                                   daemon: DaemonProcess) -> None:
    answer = register(link, "neg-truth", protocol_version="1.20",
                      capabilities=["local_steps"], manifest=MANIFEST)
    assert answer.kind == "ok", answer
    wid = answer.detail["worker_id"]
    with httpx.Client(base_url=daemon.url, trust_env=False) as c:
        [me] = [w for w in c.get("/v1/api/workers").json()["workers"] if w["worker_id"] == wid]
    assert me["capabilities"] == ["local_steps"] and me["manifest"] == MANIFEST


# --------------------------------------------------------------------------- the gate


def take(link: HttpLink | WsLink, step: str) -> dict[str, Any]:
    link.grant(1)
    for _ in range(20):  # bounded: a few seconds of long polls
        for lease in link.leases(max=1, wait_ms=500):
            assert lease["step_id"] == step, lease
            return lease
    raise AssertionError(f"no lease for {step}")


RECORD = {"step_id": "norm", "input": 1, "attempts": [
    {"attempt": 1, "started_ms": 0, "ended_ms": 2, "output": 10}], "output": 10}


@pytest.mark.parametrize(("declaration", "words"), [
    ({"protocol_version": "1.17"}, "1.18"),
    ({"protocol_version": "1.20", "manifest": ALL_REJECTED}, "did not declare"),
])
def test_local_records_from_a_worker_without_the_capability_are_refused_whole(
        link: HttpLink | WsLink, daemon: DaemonProcess, declaration: dict[str, Any],
        words: str) -> None:
    name = f"gate-{link.transport}-{declaration['protocol_version']}"
    assert register(link, name, **declaration).kind == "ok"
    [run] = start_runs(daemon.url, name, [1])
    lease = take(link, "prep")
    assert "local_steps" not in lease  # no plan for a worker that did not declare it
    assert link.call("started", lease["lease_id"]).kind == "ok"
    refused = link.call("complete", lease["lease_id"], {"output": 1, "local_steps": [RECORD]})
    assert error_field(refused) == "local_steps"
    assert words in str(refused.detail)
    # Nothing of the completion was applied: prep is still in flight.
    assert "step_completed" not in [e["type"] for e in events_of(daemon.url, run)]
    # The same completion without the records is taken; norm becomes an ordinary lease.
    assert link.call("complete", lease["lease_id"], {"output": 1}).kind == "ok"
    norm = take(link, "norm")
    assert norm["input"] == 1


def test_a_declared_worker_gets_the_plan_and_its_records_are_journaled(
        link: HttpLink | WsLink, daemon: DaemonProcess) -> None:
    name = f"gate-ok-{link.transport}"
    answer = register(link, name, protocol_version="1.20", capabilities=["local_steps"],
                      manifest=MANIFEST)
    assert answer.kind == "ok", answer
    [run] = start_runs(daemon.url, name, [1])
    lease = take(link, "prep")
    assert [p["step_id"] for p in lease["local_steps"]] == ["norm"]
    assert lease["run_input"] == {"n": 1}
    assert link.call("started", lease["lease_id"]).kind == "ok"
    # A record the run does not take (wrong step) is refused whole, too.
    wrong = {**RECORD, "step_id": "tally"}
    refused = link.call("complete", lease["lease_id"], {"output": 1, "local_steps": [wrong]})
    assert error_field(refused) == "local_steps[0].step_id"
    assert link.call("complete", lease["lease_id"],
                     {"output": 1, "local_steps": [RECORD]}).kind == "ok"
    tally = take(link, "tally")
    assert tally["steps"]["norm"] == 10
    events = events_of(daemon.url, run)
    local = [e for e in events if e.get("execution_mode") == "local"]
    assert [e["type"] for e in local] == ["step_scheduled", "step_started", "step_completed"]
    assert {e["lease_id"] for e in local} == {lease["lease_id"]}


def span(span_id: str = "ab" * 8, **extra: Any) -> dict[str, Any]:
    return {"span_id": span_id, "name": "llm.call", "start_ms": 1, "end_ms": 2, **extra}


@pytest.mark.parametrize(("change", "field"), [
    ({"usage": {"input_tokens": -1}}, "local_steps[0].usage.input_tokens"),
    ({"usage": {"cost_usd": 1.0}}, "local_steps[0].usage.cost_usd"),
    ({"spans": [span("xyz")]}, "local_steps[0].spans[0].span_id"),
    ({"spans": [span(usage={"output_tokens": 1 << 41})]},
     "local_steps[0].spans[0].usage.output_tokens"),
    ({"spans": {"not": "an array"}}, "local_steps[0].spans"),
])
def test_a_local_records_usage_and_spans_are_checked_as_a_completes(
        link: HttpLink | WsLink, daemon: DaemonProcess, change: dict[str, Any],
        field: str) -> None:
    # A workflow of its own per case: a run left by another case holds a `tally` slot that
    # this case's worker could be offered first.
    name = f"local-usage-{link.transport}-{uuid.uuid4().hex[:8]}"
    assert register(link, name, protocol_version="1.20", capabilities=["local_steps"],
                    manifest=MANIFEST).kind == "ok"
    [run] = start_runs(daemon.url, name, [1])
    lease = take(link, "prep")
    assert link.call("started", lease["lease_id"]).kind == "ok"
    refused = link.call("complete", lease["lease_id"],
                        {"output": 1, "local_steps": [{**RECORD, **change}]})
    assert error_field(refused) == field
    assert "step_completed" not in [e["type"] for e in events_of(daemon.url, run)]
    # The same record with a good body: journaled, summed into the run's usage.
    norm_span = lease["local_steps"][0]["span_id"]
    good = {**RECORD, "usage": {"model": "m", "input_tokens": 30, "output_tokens": 3},
            "spans": [span(parent_span_id=norm_span,
                           usage={"model": "m", "input_tokens": 5, "output_tokens": 1})]}
    assert link.call("complete", lease["lease_id"],
                     {"output": 1, "usage": {"input_tokens": 100, "output_tokens": 10},
                      "local_steps": [good]}).kind == "ok"
    events = events_of(daemon.url, run)
    [norm] = [e for e in events if e["type"] == "step_completed" and e["step_id"] == "norm"]
    assert norm["usage"]["input_tokens"] == 30 and norm["spans"][0]["parent_span_id"] == norm_span
    with httpx.Client(base_url=daemon.url, trust_env=False) as c:
        usage = c.get(f"/v1/api/runs/{run}").json()["usage"]
    assert (usage["input_tokens"], usage["output_tokens"]) == (130, 13)
