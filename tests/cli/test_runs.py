"""``stepd run ...`` against a real daemon (``stepd serve`` subprocess) and a real worker."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

import stepd

from .conftest import ECHO, Cli, eventually

pytestmark = pytest.mark.timeout(60)


def _key() -> str:
    return f"cli:{uuid.uuid4().hex[:12]}"


def test_start_and_wait_prints_the_run_id_then_the_result(cli: Cli) -> None:
    r = cli("run", "start", "cli_echo", "--input", '{"ticket": 42}', "--wait", "--timeout", "20")
    assert r.exit_code == 0, r.stderr
    run_id, rest = r.stdout.split("\n", 1)
    assert run_id.startswith("r_")
    assert json.loads(rest) == {"echo": {"ticket": 42}}
    assert r.stderr == ""


def test_start_with_a_used_idempotency_key_returns_the_original_run(cli: Cli) -> None:
    key = _key()
    first = cli("run", "start", "cli_echo", "--input", "1", "--idempotency-key", key)
    again = cli("run", "start", "cli_echo", "--input", "2", "--idempotency-key", key, "--json")
    assert first.exit_code == 0 and again.exit_code == 0, (first.stderr, again.stderr)
    assert json.loads(again.stdout) == {"run_id": first.stdout.strip(), "created": False}
    assert again.stderr.startswith(f"note: idempotency key {key!r} was used before")


def test_start_reads_input_and_correlation_from_json_file_and_pins_the_version(
        cli: Cli, tmp_path: Path) -> None:
    path = tmp_path / "input.json"
    path.write_text('{"from": "file"}')
    r = cli("run", "start", "cli_echo", "--input", f"@{path}", "--version", "cli.v1",
            "--correlation", '{"ticket": "T-1"}', "--wait", "--json")
    assert r.exit_code == 0, r.stderr
    first, last = r.stdout.splitlines()  # JSON lines: the run at once, then its end
    out = json.loads(last)
    assert json.loads(first) == {"run_id": out["run_id"], "created": True}
    assert out["created"] is True and out["status"] == "completed"
    assert out["result"] == {"echo": {"from": "file"}}
    s = cli("run", "status", out["run_id"], "--json")
    view = json.loads(s.stdout)
    assert view["correlation"] == {"ticket": "T-1"} and view["definition_version"] == "cli.v1"


def test_status_shows_version_hash_key_budgets_tokens_and_cost(cli: Cli) -> None:
    key = _key()
    run_id = cli("run", "start", "cli_echo", "--input", '{"a": 1}', "--idempotency-key", key,
                 "--wait").stdout.split("\n", 1)[0]
    r = cli("run", "status", run_id)
    assert r.exit_code == 0, r.stderr
    out = r.stdout
    for text in (run_id, "cli_echo", "completed", "cli.v1", ECHO.definition_hash, key,
                 "max_transitions", "max_cost_units", "max_state_bytes", "max_for_each_items",
                 "max_started_workflows", "1,000 in / 500 out, $0.002000"):
        assert text in out, (text, out)
    # the budget table: limits and what the run used
    transitions = next(line for line in out.splitlines() if line.startswith("max_transitions"))
    assert transitions.replace("│", " ").split() == ["max_transitions", "5", "1"]


def test_status_json_is_the_api_answer(cli: Cli, client: stepd.Client) -> None:
    run = client.start("cli_echo", {"b": 2})
    run.result(timeout=20)
    r = cli("run", "status", run.run_id, "--json")
    assert r.exit_code == 0
    view = json.loads(r.stdout)
    assert view == dict(client.status(run).raw)
    assert view["usage"] == {"input_tokens": 1000, "output_tokens": 500, "cost_usd": 0.002}


def test_list_filters_by_workflow_and_status_and_limits(cli: Cli, client: stepd.Client) -> None:
    failed = client.start("cli_fail", None)
    with pytest.raises(stepd.RunFailed):
        failed.result(timeout=20)
    r = cli("run", "list", "--workflow", "cli_fail", "--status", "failed")
    assert r.exit_code == 0, r.stderr
    assert failed.run_id in r.stdout and "cli_fail" in r.stdout and "failed" in r.stdout
    assert "cli_echo" not in r.stdout
    runs = json.loads(cli("run", "list", "--limit", "2", "--json").stdout)["runs"]
    assert len(runs) == 2 and all(x["run_id"].startswith("r_") for x in runs)
    assert cli("run", "list", "--workflow", "nobody-runs-this").stdout.strip() == "no runs match"


def test_journal_is_a_timeline_of_who_ran_what(cli: Cli, client: stepd.Client) -> None:
    failed = client.start("cli_fail", {"x": 1})
    with pytest.raises(stepd.RunFailed):
        failed.result(timeout=20)
    r = cli("run", "journal", failed.run_id)
    assert r.exit_code == 0, r.stderr
    out = r.stdout
    for text in ("run_started", "step_offered", "step_started", "step_failed", "run_failed",
                 "cli-worker", "fatal: ValueError: bad input 7", f"journal of {failed.run_id}"):
        assert text in out, (text, out)
    events = json.loads(cli("run", "journal", failed.run_id, "--json").stdout)
    assert events == client.journal(failed)


def test_export_prints_json(cli: Cli, client: stepd.Client) -> None:
    run = client.start("cli_echo", {"c": 3}, idempotency_key=_key())
    run.result(timeout=20)
    r = cli("run", "export", run.run_id)
    assert r.exit_code == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["run_id"] == run.run_id and data["definition_hash"] == ECHO.definition_hash
    assert data["definition"]["name"] == "cli_echo"
    assert [s["name"] for s in data["spans"]] == ["llm.call"]
    assert data["journal"][-1]["type"] == "run_completed"


def test_signal_resumes_a_waiting_run(cli: Cli, client: stepd.Client) -> None:
    run = client.start("cli_wait", None)
    eventually(lambda: client.status(run).status == "waiting", what="waiting")
    r = cli("run", "signal", run.run_id, "go", "--payload", '{"items": [1, 2, 3]}')
    assert r.exit_code == 0, r.stderr
    assert r.stdout.strip() == f"signal 'go' sent to {run.run_id}"
    assert run.result(timeout=20) == [2, 4, 6]


def test_a_signal_over_budget_is_refused_and_the_run_keeps_waiting(cli: Cli,
                                                                   client: stepd.Client) -> None:
    run = client.start("cli_wait", None)
    eventually(lambda: client.status(run).status == "waiting", what="waiting")
    big = json.dumps({"items": [1], "pad": "x" * 400})
    r = cli("run", "signal", run.run_id, "go", "--payload", big)
    assert r.exit_code == 4
    assert r.stderr.count("\n") == 1
    assert r.stderr.startswith("error: signal 'go' refused")
    assert "max_state_bytes" in r.stderr and "keeps waiting" in r.stderr
    assert client.status(run).status == "waiting"
    assert cli("run", "signal", run.run_id, "go", "--payload", '{"items": [5]}').exit_code == 0
    assert run.result(timeout=20) == [10]


def test_cancel_then_cancel_again_is_a_conflict(cli: Cli, client: stepd.Client) -> None:
    run = client.start("cli_wait", None)
    eventually(lambda: client.status(run).status == "waiting", what="waiting")
    r = cli("run", "cancel", run.run_id)
    assert r.exit_code == 0, r.stderr
    assert r.stdout.strip() == f"run {run.run_id} cancelled"
    assert client.status(run).status == "cancelled"
    again = cli("run", "cancel", run.run_id)
    assert again.exit_code == 4
    assert again.stderr.startswith(f"error: run {run.run_id} is already over")
    signal = cli("run", "signal", run.run_id, "go")
    assert signal.exit_code == 4 and "is already over" in signal.stderr


def test_wait_on_a_failing_run_exits_7_with_its_error(cli: Cli) -> None:
    r = cli("run", "start", "cli_fail", "--wait")
    assert r.exit_code == 7
    run_id = r.stdout.strip()
    assert r.stderr == (f"error: run {run_id} failed: step_failed at step 'boom': "
                        "fatal: ValueError: bad input 7\n")


def test_wait_timeout_exits_1_and_the_run_goes_on(cli: Cli, client: stepd.Client) -> None:
    r = cli("run", "start", "cli_wait", "--wait", "--timeout", "0.3")
    assert r.exit_code == 1
    run_id = r.stdout.strip()
    assert "is still running after 0.3 s" in r.stderr
    assert client.status(run_id).status == "waiting"
    client.cancel(run_id)
