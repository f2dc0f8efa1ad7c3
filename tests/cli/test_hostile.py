"""Data from workers and clients never drives the terminal (docs/cli.md "Hostile data").

A raw HTTP worker (httpx, PROTOCOL.md only: no SDK, which might clean things
up on the way) registers under a name full of escape sequences, fails an
attempt with such a message, then completes with such an output and state; the
run carries them as its idempotency key and correlation too. Every command
that shows them, against the real ``stepd serve`` of the session, must print
no control or format character as itself, show the escaped form instead, and
print rich markup literally; ``--json`` must stay JSON that reads back as the
API's answer.
"""

from __future__ import annotations

import json
import unicodedata
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from ._serve import ServeProcess
from .conftest import ADMIN_KEY, Cli, stepd_process

pytestmark = pytest.mark.timeout(60)

# Clear the screen, set the window title, return to column 0, reverse the text that
# follows, an 8-bit CSI, DEL, a bidi isolate, and markup rich would style.
HOSTILE = "evil\x1b[2J\x1b]0;title\x07\r\u202e[bold red]x[/]\x9b\x7f\u2066!"
ESCAPED = r"evil\x1b[2J\x1b]0;title\x07\r\u202e[bold red]x[/]\x9b\x7f\u2066!"
IN_JSON = r"evil\u001b[2J\u001b]0;title\u0007\r\u202e[bold red]x[/]"  # as JSON spells it


def raw_controls(text: str) -> list[str]:
    """Every character of ``text`` a terminal would act on or reorder by (newlines aside)."""
    return [ch for ch in text if ch != "\n"
            and unicodedata.category(ch) in ("Cc", "Cf", "Cs", "Zl", "Zp")]


def squeezed(text: str) -> str:
    """``text`` without whitespace and table rules, so a folded table cell reads whole."""
    return "".join(ch for ch in text if not ch.isspace() and ch not in "│┃─━┼╇╋")


@dataclass
class Hostile:
    workflow: str
    worker_id: str
    completed: str  # the run that failed once with HOSTILE, then completed with it
    failed: str  # the run that failed for good with HOSTILE
    idempotency_key: str


def _claim(http: httpx.Client, worker_id: str, run_id: str) -> dict[str, Any]:
    for _ in range(10):  # bounded: a retry is scheduled a few hundred ms after a failure
        r = http.post("/v1/api/steps/claim", json={"worker_id": worker_id, "max": 1,
                                                   "wait_ms": 1500, "run_id": run_id})
        assert r.status_code == 200, r.text
        if r.json()["leases"]:
            return dict(r.json()["leases"][0])
    raise AssertionError(f"no lease for {run_id}")


def _ok(r: httpx.Response) -> dict[str, Any]:
    assert r.status_code in (200, 201), r.text
    return dict(r.json())


@pytest.fixture(scope="module")
def hostile(daemon: ServeProcess) -> Iterator[Hostile]:
    workflow = f"hostile_{uuid.uuid4().hex[:8]}"
    definition = {"name": workflow, "steps": [{"id": "s1", "kind": "task", "body": "b1"}]}
    with httpx.Client(base_url=daemon.url, headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                      timeout=10, trust_env=False) as http:
        worker_id = _ok(http.post("/v1/api/workers/register", json={
            "name": HOSTILE, "build_id": HOSTILE, "definitions": [definition]}))["worker_id"]
        key = f"{HOSTILE}-{uuid.uuid4().hex[:8]}"
        completed = _ok(http.post("/v1/api/runs", json={
            "workflow": workflow, "input": HOSTILE, "correlation": HOSTILE,
            "idempotency_key": key}))["run_id"]
        lease = _claim(http, worker_id, completed)
        _ok(http.post(f"/v1/api/steps/{lease['lease_id']}/started", json={}))
        _ok(http.post(f"/v1/api/steps/{lease['lease_id']}/fail",
                      json={"error": {"class": "retryable", "message": HOSTILE}}))
        lease = _claim(http, worker_id, completed)
        _ok(http.post(f"/v1/api/steps/{lease['lease_id']}/started", json={}))
        _ok(http.post(f"/v1/api/steps/{lease['lease_id']}/complete", json={
            "output": {"said": HOSTILE}, "state_patch": {"note": HOSTILE}}))
        failed = _ok(http.post("/v1/api/runs", json={"workflow": workflow, "input": 1}))["run_id"]
        lease = _claim(http, worker_id, failed)
        _ok(http.post(f"/v1/api/steps/{lease['lease_id']}/started", json={}))
        _ok(http.post(f"/v1/api/steps/{lease['lease_id']}/fail",
                      json={"error": {"class": "fatal", "message": HOSTILE}}))
        for run_id, status in ((completed, "completed"), (failed, "failed")):
            r = http.get(f"/v1/api/runs/{run_id}/result", params={"wait_ms": 5000})
            assert _ok(r)["status"] == status, r.text
    yield Hostile(workflow, worker_id, completed, failed, key)


def _shown(cli: Cli, *args: str) -> str:
    """The command's stdout, once checked to hold no raw control or format character.

    300 columns: wide enough that no table folds the escaped texts.
    """
    r = cli(*args, env={"COLUMNS": "300"})
    assert r.exit_code == 0, r.stderr
    assert raw_controls(r.stdout) == [], (args, r.stdout)
    return r.stdout


def test_workers_shows_a_hostile_name_escaped(cli: Cli, hostile: Hostile) -> None:
    out = _shown(cli, "workers")
    assert hostile.worker_id in out
    row = next(line for line in out.splitlines() if hostile.worker_id in line)
    assert row.count(ESCAPED) == 2, row  # name and build, escaped, the markup as text


def test_journal_shows_the_worker_and_its_fail_message_escaped(cli: Cli,
                                                               hostile: Hostile) -> None:
    out = _shown(cli, "run", "journal", hostile.completed)
    assert ESCAPED in out  # the worker column (no_wrap): the escaped name, whole
    assert squeezed(f"retryable: {ESCAPED}") in squeezed(out)  # the failed attempt's detail
    assert squeezed(IN_JSON) in squeezed(out)  # the key in run_started, the result


def test_status_shows_key_correlation_output_and_error_escaped(cli: Cli,
                                                               hostile: Hostile) -> None:
    out = _shown(cli, "run", "status", hostile.completed)
    key_row = next(line for line in out.splitlines() if line.startswith("idempotency key"))
    assert f"{ESCAPED}-" in key_row
    for row in ("correlation", "input", "state", "result"):
        line = next(x for x in out.splitlines() if x.startswith(row))
        assert IN_JSON in line, (row, line)  # JSON values: JSON's escapes, then printable's
        assert r"\u202e[bold red]x[/]\x9b\x7f\u2066" in line
    failed = _shown(cli, "run", "status", hostile.failed)
    assert f"step_failed at step 's1': fatal: {ESCAPED}" in failed


@pytest.mark.parametrize("command", [
    ("run", "status", "{completed}", "--json"),
    ("run", "journal", "{completed}", "--json"),
    ("run", "export", "{completed}"),
])
def test_json_output_stays_json_and_terminal_safe(cli: Cli, hostile: Hostile, daemon: ServeProcess,
                                                  command: tuple[str, ...]) -> None:
    args = tuple(a.format(completed=hostile.completed) for a in command)
    out = _shown(cli, *args)
    value = json.loads(out)
    path = {"status": f"/v1/api/runs/{hostile.completed}",
            "journal": f"/v1/api/runs/{hostile.completed}/journal",
            "export": f"/v1/api/runs/{hostile.completed}/export"}[args[1]]
    with httpx.Client(base_url=daemon.url, headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                      timeout=10, trust_env=False) as http:
        answer = http.get(path).json()
    if args[1] == "journal":
        answer = answer["events"]
    assert value == answer  # every character read back as the daemon sent it
    assert json.dumps(HOSTILE)[1:-1] in json.dumps(value)  # and it holds the hostile text


def test_an_error_line_never_carries_raw_controls(cli: Cli) -> None:
    r = cli("run", "status", "r_\x1b[2J\u202e")
    assert r.exit_code in (2, 3), r.stderr
    assert raw_controls(r.stderr) == [] and r.stderr.count("\n") == 1
    assert r"r_\x1b[2J\u202e" in r.stderr
    usage = cli("run", "list", "--status", "\x1b[2Jx")
    assert usage.exit_code == 2
    assert raw_controls(usage.stderr) == [] and r"\x1b[2Jx" in usage.stderr


def test_the_real_entry_point_writes_no_raw_controls(daemon: ServeProcess,
                                                     hostile: Hostile) -> None:
    env = {"STEPD_URL": daemon.url, "STEPD_KEY": ADMIN_KEY, "COLUMNS": "200"}
    journal = stepd_process("run", "journal", hostile.completed, env=env)
    assert journal.returncode == 0, journal.stderr
    assert "\x1b" not in journal.stdout and "\r" not in journal.stdout
    assert ESCAPED in journal.stdout


def test_printable_and_json_text() -> None:
    from stepd.cli.common import json_text, printable

    assert printable("plain ünïcode 名前 🙂") == "plain ünïcode 名前 🙂"
    assert printable(HOSTILE) == ESCAPED
    assert printable("a\tb\nc\u200bd\ud800e\U000e0001") == r"a\tb\nc\u200bd\ud800e\U000e0001"
    text = json_text({"k": HOSTILE + "\ud800\U000e0001 ü"})
    assert raw_controls(text) == []
    assert json.loads(text) == {"k": HOSTILE + "\ud800\U000e0001 ü"}
    assert "ü" in text  # readable: only the dangerous characters are escaped
