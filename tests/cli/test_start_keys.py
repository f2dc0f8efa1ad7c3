"""``stepd run start --wait`` with a key that may start runs but not read them.

The daemon here has keys by scope (PROTOCOL.md "Authentication and scopes"),
among them a ``read`` key, so an ``execute`` key does not fall back to reading:
it may start a run, and the wait that follows is refused (403, exit 6). The
run id must be printed before the wait, or the caller cannot know which run it
started.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from stepd.cli.common import EXIT_UNAUTHORIZED

from ._serve import ServeProcess, serve_process
from .conftest import Cli

pytestmark = pytest.mark.timeout(60)

ADMIN = "keys-admin-0123456789abcdef"
EXECUTE = "keys-execute-0123456789abcdef"
READ = "keys-read-0123456789abcdef"


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServeProcess, str]]:
    """A daemon with admin, execute and read keys, and a registered workflow nobody serves."""
    base: Path = tmp_path_factory.mktemp("keys")
    d = serve_process(base / "data", "--admin-key", ADMIN, "--execute-key", EXECUTE,
                      "--read-key", READ, "--max-request-ms", "2000",
                      "--shutdown-grace-ms", "2000")
    workflow = f"keys_{uuid.uuid4().hex[:8]}"
    definition = {"name": workflow, "steps": [{"id": "s1", "kind": "task", "body": "b1"}]}
    with httpx.Client(base_url=d.url, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10,
                      trust_env=False) as http:
        r = http.post("/v1/api/workers/register", json={"definitions": [definition]})
        assert r.status_code == 200, r.text
    yield d, workflow
    assert d.stop() == 0, d.stderr()


def _run_status(d: ServeProcess, run_id: str) -> str:
    with httpx.Client(base_url=d.url, headers={"Authorization": f"Bearer {READ}"}, timeout=10,
                      trust_env=False) as http:
        r = http.get(f"/v1/api/runs/{run_id}")
        assert r.status_code == 200, r.text
        return str(r.json()["status"])


def test_wait_json_prints_the_run_before_the_refused_wait(
        keyed: tuple[ServeProcess, str]) -> None:
    d, workflow = keyed
    r = Cli(d.url, EXECUTE)("run", "start", workflow, "--input", "1", "--wait", "--json")
    assert r.exit_code == EXIT_UNAUTHORIZED, (r.stdout, r.stderr)
    lines = r.stdout.splitlines()
    assert len(lines) == 1, r.stdout
    started = json.loads(lines[0])
    assert set(started) == {"run_id", "created"} and started["created"] is True
    run_id = started["run_id"]
    assert _run_status(d, run_id) == "running"  # the id printed is the run that was started
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("error: the key lacks the scope")
    assert f"waiting for run {run_id}, which was started and goes on" in r.stderr


def test_wait_plain_prints_the_run_id_then_the_error_naming_it(
        keyed: tuple[ServeProcess, str]) -> None:
    d, workflow = keyed
    r = Cli(d.url, EXECUTE)("run", "start", workflow, "--wait")
    assert r.exit_code == EXIT_UNAUTHORIZED, (r.stdout, r.stderr)
    run_id = r.stdout.strip()
    assert run_id.startswith("r_") and r.stdout == f"{run_id}\n"
    assert _run_status(d, run_id) == "running"
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("error: the key lacks the scope")
    assert f"run {run_id}, which was started and goes on" in r.stderr


def test_without_wait_json_is_the_same_one_line(keyed: tuple[ServeProcess, str]) -> None:
    d, workflow = keyed
    r = Cli(d.url, EXECUTE)("run", "start", workflow, "--json")
    assert r.exit_code == 0, r.stderr
    assert r.stdout.count("\n") == 1  # JSON lines, as with --wait: a script reads one format
    started = json.loads(r.stdout)
    assert started["created"] is True and _run_status(d, started["run_id"]) == "running"
