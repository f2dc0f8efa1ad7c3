"""``stepd workers``, ``stepd actors`` and ``stepd actors kill`` against a real daemon."""

from __future__ import annotations

import json

import pytest

import stepd

from .conftest import Cli, eventually

pytestmark = pytest.mark.timeout(60)


def test_workers_lists_the_registered_worker(cli: Cli, worker: stepd.Worker) -> None:
    r = cli("workers")
    assert r.exit_code == 0, r.stderr
    assert worker.worker_id is not None and worker.worker_id in r.stdout
    assert "cli-worker" in r.stdout and "cli-b1" in r.stdout and "connected" in r.stdout
    found = json.loads(cli("workers", "--json").stdout)
    mine = next(w for w in found if w["worker_id"] == worker.worker_id)
    assert mine["name"] == "cli-worker" and mine["connected"] is True


def test_actors_shows_the_supervision_tree(cli: Cli) -> None:
    r = cli("actors")
    assert r.exit_code == 0, r.stderr
    for path in ("/registry", "/runs", "/leases", "/timers", "/recovery"):
        assert path in r.stdout
    assert "restarts" in r.stdout and "mailbox" in r.stdout
    tree = json.loads(cli("actors", "--json").stdout)
    assert tree["path"] == "/" and {c["path"] for c in tree["children"]} >= {"/registry", "/runs"}


def test_actors_kill_restarts_the_actor_and_runs_go_on(cli: Cli, client: stepd.Client) -> None:
    def restarts(path: str) -> int:
        tree = client.actors()
        return next(c["restarts"] for c in tree["children"] if c["path"] == path)

    before = restarts("/timers")
    r = cli("actors", "kill", "/timers")
    assert r.exit_code == 0, r.stderr
    assert r.stdout.strip() == "killed /timers; its supervisor restarts it from storage"
    eventually(lambda: restarts("/timers") > before, what="/timers restarted")
    # The daemon still runs work after the kill.
    assert client.start("cli_echo", {"after": "kill"}).result(timeout=20) == {
        "echo": {"after": "kill"}}


def test_actors_kill_errors(cli: Cli) -> None:
    missing = cli("actors", "kill", "/no/such/actor")
    assert missing.exit_code == 3
    assert missing.stderr == "error: no actor at '/no/such/actor'\n"
    root = cli("actors", "kill", "/")
    assert root.exit_code == 2
    assert root.stderr.startswith("error: invalid input: field 'path': ")
