"""``stepd workers``, ``stepd actors`` and ``stepd actors kill`` against a real daemon."""

from __future__ import annotations

import json
import threading
from typing import Any

import httpx
import pytest

import stepd

from ._serve import ServeProcess
from .conftest import ADMIN_KEY, Cli, eventually

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
    assert r.stdout.startswith("killed /timers; its supervisor restarts it")
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


REST = ["/registry", "/runs", "/leases", "/timers", "/schedules", "/recovery", "/retention"]


def test_kill_message_names_the_siblings_restarted_with_the_actor() -> None:
    from stepd.cli.render import kill_message

    assert kill_message("/registry", {"path": "/registry", "restarted": REST}) == (
        "killed /registry; its supervisor restarts it and, with it (rest_for_one), "
        "/runs, /leases, /timers, /schedules, /recovery, /retention")
    assert kill_message("/runs/r_x", {"path": "/runs/r_x", "restarted": ["/runs/r_x"]}) == (
        "killed /runs/r_x; its supervisor restarts it from storage")
    older = kill_message("/timers", {"path": "/timers"})  # a daemon without "restarted"
    assert older.startswith("killed /timers; its supervisor restarts it from storage, with any "
                            "siblings its strategy restarts")
    hostile = kill_message("/x", {"path": "/x", "restarted": ["/x", "/y\x1b[2J"]})
    assert "\x1b" not in hostile and hostile.endswith(r"/y\x1b[2J")


def test_actors_kill_does_not_claim_the_actor_restarts_alone(cli: Cli, client: stepd.Client,
                                                             daemon: ServeProcess) -> None:
    r = cli("actors", "kill", "/timers")
    assert r.exit_code == 0, r.stderr
    out = r.stdout.strip()
    # /timers is under the root's rest_for_one: the siblings started after it restart too.
    # A daemon that lists them says so; one that does not must not claim /timers goes alone.
    assert out != "killed /timers; its supervisor restarts it from storage"
    listed = ("killed /timers; its supervisor restarts it and, with it (rest_for_one), "
              "/schedules, /recovery, /retention")
    assert out in (listed, kill_message_without_list("/timers")), out
    # A path with no actor (a run that is over is passivated): the daemon's message, as is.
    run = client.start("cli_echo", {"kill": "passivated"})
    run.result(timeout=20)
    path = f"/runs/{run.run_id}"

    def paths(node: dict[str, object]) -> set[object]:
        children = node.get("children") or []
        assert isinstance(children, list)
        return {node.get("path")}.union(*(paths(c) for c in children))

    eventually(lambda: path not in paths(client.actors()), what=f"{path} passivated")
    with httpx.Client(base_url=daemon.url, headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                      timeout=10, trust_env=False) as http:
        answer = http.post("/v1/api/actors/kill", json={"path": path})
    assert answer.status_code == 404, answer.text
    missing = cli("actors", "kill", path)
    assert missing.exit_code == 3
    assert missing.stderr == f"error: {answer.json()['message']}\n"


def kill_message_without_list(path: str) -> str:
    from stepd.cli.render import kill_message

    return kill_message(path, {"path": path})


def _gpu_load(ctx: stepd.StepContext, input: Any) -> str:
    return "loaded"


def test_workers_shows_protocol_capabilities_and_held_sessions(
        cli: Cli, client: stepd.Client) -> None:
    """docs/affinity.md: the negotiated version, what the worker supports, and the worker
    sessions it holds (in the table a count; in ``--json`` each session)."""
    flow = (stepd.Workflow("cli_gpu", version="cli.v1")
            .session("gpu", requirements={"gpu": "a100"}, ttl_ms=600_000)
            .then(_gpu_load, session="gpu").wait("go"))
    gpu = stepd.Worker(client, concurrency=2, name="cli-gpu", resources={"gpu": "a100"},
                       max_sessions=2, local_steps=True).register(flow)
    errors: list[BaseException] = []

    def serve() -> None:
        try:
            gpu.serve(handle_signals=False)
        except BaseException as exc:  # noqa: BLE001 - asserted below
            errors.append(exc)

    thread = threading.Thread(target=serve, name="cli-gpu", daemon=True)
    thread.start()
    try:
        assert gpu.wait_ready(20), errors
        run = client.start("cli_gpu", {})
        # The run waits for its signal inside the session: the holder keeps it.
        eventually(lambda: client.status(run).status == "waiting", what="the run waits")
        r = cli("workers")
        assert r.exit_code == 0, r.stderr
        (row,) = [line for line in r.stdout.splitlines() if "cli-gpu" in line]
        assert "1.20" in row and "local_steps, sessions" in row
        assert row.rstrip().endswith("1"), row  # one session held
        (mine,) = [w for w in json.loads(cli("workers", "--json").stdout)
                   if w["worker_id"] == gpu.worker_id]
        (held,) = mine["sessions"]
        assert (held["run_id"], held["name"], held["status"], held["generation"]) == (
            run.run_id, "gpu", "held", 1)
        assert held["session_id"].startswith("ws_")
        assert held["since"] <= held["lease_until"] <= held["expires_at"]
        assert 0 < held["ttl_remaining_ms"] <= 600_000
        client.cancel(run)
        eventually(lambda: not next(w for w in client.workers()
                                    if w["worker_id"] == gpu.worker_id)["sessions"],
                   what="the session closed with its run")
    finally:
        gpu.stop(2)
        thread.join(20)
    assert not thread.is_alive() and not errors, errors
