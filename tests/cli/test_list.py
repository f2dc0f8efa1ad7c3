"""``stepd run list`` and ``Client.list_runs``: filters, order, cursors (docs/cli.md "Runs").

``GET /v1/api/runs`` takes ``created_after``, ``created_before``,
``correlation``, ``idempotency_key`` and ``order`` (newest first by default)
and pages by an opaque cursor.
"""

from __future__ import annotations

import datetime
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import stepd
from stepd.cli.common import EXIT_USAGE

from .conftest import Cli

pytestmark = pytest.mark.timeout(60)



def _ids(stdout: str) -> list[str]:
    return [r["run_id"] for r in json.loads(stdout)["runs"]]


# --------------------------------------------------------------------------- paging


def test_list_json_is_the_api_page_and_its_cursor_goes_on(cli: Cli, client: stepd.Client) -> None:
    for i in range(3):  # at least three runs, whatever else ran before
        client.start("cli_echo", {"list": i}).result(timeout=20)
    first = cli("run", "list", "--limit", "2", "--json")
    assert first.exit_code == 0, first.stderr
    page = json.loads(first.stdout)
    assert set(page) == {"runs", "next_cursor"} and len(page["runs"]) == 2
    assert isinstance(page["next_cursor"], str)  # more runs follow
    rest = cli("run", "list", "--limit", "1", "--cursor", page["next_cursor"], "--json")
    assert rest.exit_code == 0, rest.stderr
    assert len(_ids(rest.stdout)) == 1 and not set(_ids(rest.stdout)) & set(_ids(first.stdout))
    # The same three runs, in the same order, as one listing shows them.
    assert _ids(first.stdout) + _ids(rest.stdout) == _ids(
        cli("run", "list", "--limit", "3", "--json").stdout)
    shown = cli("run", "list", "--limit", "2")
    assert f"more: --cursor {page['next_cursor']} (or --all)" in shown.stdout


def test_list_all_follows_the_cursors_to_the_last_run(cli: Cli, client: stepd.Client) -> None:
    for _ in range(3):
        with pytest.raises(stepd.RunFailed):
            client.start("cli_fail", None).result(timeout=20)
    everything = [r.run_id for r in client.list_runs(workflow="cli_fail", limit=None)]
    assert len(everything) >= 3
    r = cli("run", "list", "--workflow", "cli_fail", "--all", "--limit", "1", "--json")
    assert r.exit_code == 0, r.stderr
    assert _ids(r.stdout) == everything  # one run per request, every page followed
    assert json.loads(r.stdout)["next_cursor"] is None
    plain = cli("run", "list", "--workflow", "cli_fail", "--all", "--limit", "1")
    assert f"{len(everything)} runs" in plain.stdout and "more:" not in plain.stdout


@pytest.mark.parametrize(("args", "message"), [
    (("--since", "yesterday"), "error: invalid --since: 'yesterday' is not epoch ms, an ISO-8601"),
    (("--until", "2026-13-01T00:00:00Z"), "error: invalid --until: '2026-13-01T00:00:00Z'"),
    (("--limit", "1001"), "error: Invalid value for '--limit'"),
    (("--order", "sideways"), "error: Invalid value for '--order'"),
    (("--correlation", "@/no/such/file.json"), "error: invalid --correlation: cannot read"),
    (("--cursor", "not-a-cursor"), "error: invalid input: field 'cursor': "),  # the daemon's 400
])
def test_list_refuses_bad_options(cli: Cli, args: tuple[str, ...], message: str) -> None:
    r = cli("run", "list", *args)
    assert r.exit_code == EXIT_USAGE, (r.stdout, r.stderr)
    assert r.stderr.startswith(message) and r.stderr.count("\n") == 1, r.stderr


@pytest.fixture(scope="module")
def embedded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[stepd.Client, str,
                                                                         list[str]]]:
    """An embedded daemon (the in-process adapter) with three runs of a workflow, in order."""
    path: Path = tmp_path_factory.mktemp("embedded") / "data"
    name = f"emb_{uuid.uuid4().hex[:8]}"
    definition = {"name": name, "steps": [{"id": "s1", "kind": "task", "body": "b1"}]}
    with stepd.embedded(path) as daemon, stepd.Client(daemon) as client:
        daemon.call_blocking(lambda: daemon.inprocess.register({"definitions": [definition]}))
        runs = [client.start(name, i).run_id for i in range(3)]
        yield client, name, runs


def test_client_list_runs_in_process_takes_order_and_cursor(
        embedded: tuple[stepd.Client, str, list[str]]) -> None:
    client, name, runs = embedded
    assert [r.run_id for r in client.list_runs(workflow=name, order="asc")] == runs
    first = client.list_runs(workflow=name, order="asc", limit=2)
    assert [r.run_id for r in first] == runs[:2] and first.next_cursor is not None
    rest = client.list_runs(workflow=name, order="asc", cursor=first.next_cursor)
    assert [r.run_id for r in rest] == runs[2:] and rest.next_cursor is None
    with pytest.raises(stepd.Invalid) as bad:
        list(client.list_runs(workflow=name, cursor="not-a-cursor"))
    assert bad.value.field == "cursor"


def test_client_list_runs_checks_its_arguments(
        embedded: tuple[stepd.Client, str, list[str]]) -> None:
    client, _, _ = embedded
    refused: list[tuple[dict[str, Any], str]] = [
        ({"order": "sideways"}, "order"),
        ({"created_after": datetime.datetime(2026, 12, 1)}, "created_after"),  # naive: no zone
        ({"created_before": 1.5}, "created_before"),
        ({"page_size": 0}, "page_size"),
        ({"correlation": float("nan")}, "correlation"),  # not JSON
    ]
    for kwargs, field in refused:
        with pytest.raises(stepd.Invalid) as bad:
            client.list_runs(**kwargs)  # at the call, before anything is sent
        assert bad.value.field == field, kwargs


# --------------------------------------------------------------------------- filters and order


@pytest.fixture
def three(client: stepd.Client) -> tuple[str, list[stepd.RunStatus]]:
    """Three completed runs sharing a fresh correlation, oldest first, their statuses."""
    token = uuid.uuid4().hex
    statuses = []
    for i in range(3):
        run = client.start("cli_echo", i, correlation={"t": token},
                           idempotency_key=f"list:{token}:{i}")
        run.result(timeout=20)
        statuses.append(client.status(run))
    return token, statuses


def _iso(when: datetime.datetime) -> str:
    return when.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def test_list_is_newest_first_and_asc_oldest_first(
        cli: Cli, three: tuple[str, list[stepd.RunStatus]]) -> None:
    token, runs = three
    ids = [s.run_id for s in runs]
    corr = json.dumps({"t": token})
    assert _ids(cli("run", "list", "--correlation", corr, "--json").stdout) == ids[::-1]
    assert _ids(cli("run", "list", "--correlation", corr, "--order", "asc",
                    "--json").stdout) == ids
    plain = cli("run", "list", "--correlation", corr)
    assert "3 runs, newest first" in plain.stdout
    assert plain.stdout.index(ids[2]) < plain.stdout.index(ids[0])


def test_list_since_and_until(cli: Cli, three: tuple[str, list[stepd.RunStatus]]) -> None:
    token, runs = three
    created = [s.created_at for s in runs]
    assert all(c is not None for c in created)
    first, second, third = created  # type: ignore[misc]
    assert first < second < third, created
    middle_early = first + (second - first) / 2
    middle_late = second + (third - second) / 2
    epoch = datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)
    since_ms = str((middle_early - epoch) // datetime.timedelta(milliseconds=1))
    corr = json.dumps({"t": token})
    r = cli("run", "list", "--correlation", corr, "--since", since_ms,
            "--until", _iso(middle_late), "--json")
    assert r.exit_code == 0, r.stderr
    assert _ids(r.stdout) == [runs[1].run_id]
    recent = cli("run", "list", "--correlation", corr, "--since", "1h", "--json")
    assert len(_ids(recent.stdout)) == 3


def test_list_by_correlation_and_idempotency_key(cli: Cli, client: stepd.Client,
                                                 three: tuple[str, list[stepd.RunStatus]]) -> None:
    token, runs = three
    # Key order does not matter: the correlation is compared as canonical JSON.
    other_order = cli("run", "list", "--correlation", json.dumps({"t": token}), "--json")
    assert len(_ids(other_order.stdout)) == 3
    r = cli("run", "list", "--idempotency-key", f"list:{token}:1", "--json")
    assert _ids(r.stdout) == [runs[1].run_id]
    plain = client.start("cli_echo", None, correlation=f"plain-{token}")
    plain.result(timeout=20)
    for value in (f"plain-{token}", json.dumps(f"plain-{token}")):  # text, or its JSON
        assert _ids(cli("run", "list", "--correlation", value, "--json").stdout) == [plain.run_id]
    assert [r.run_id for r in client.list_runs(correlation=f"plain-{token}")] == [plain.run_id]


def test_list_pages_with_cursor_and_all(cli: Cli, three: tuple[str, list[stepd.RunStatus]]) -> None:
    token, runs = three
    ids = [s.run_id for s in runs][::-1]
    corr = json.dumps({"t": token})
    first = json.loads(cli("run", "list", "--correlation", corr, "--limit", "1", "--json").stdout)
    assert [r["run_id"] for r in first["runs"]] == ids[:1] and first["next_cursor"]
    rest = cli("run", "list", "--correlation", corr, "--cursor", first["next_cursor"], "--json")
    assert _ids(rest.stdout) == ids[1:]
    assert _ids(cli("run", "list", "--correlation", corr, "--all", "--limit", "1",
                    "--json").stdout) == ids


def test_async_client_list_runs_pages_the_same_way(
        embedded: tuple[stepd.Client, str, list[str]]) -> None:
    import anyio

    client, name, runs = embedded
    daemon = client._daemon
    assert daemon is not None

    async def listing() -> tuple[list[str], list[str], str | None]:
        async with stepd.AsyncClient(daemon) as aclient:
            first = aclient.list_runs(workflow=name, order="asc", limit=2, page_size=1)
            head = [r.run_id async for r in first]
            assert first.next_cursor is not None
            rest = aclient.list_runs(workflow=name, order="asc", cursor=first.next_cursor)
            return head, [r.run_id async for r in rest], rest.next_cursor

    head, tail, cursor = anyio.run(listing)
    assert head == runs[:2] and tail == runs[2:] and cursor is None
