"""Every failure is one line on stderr and a documented exit code (docs/cli.md "Exit codes")."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from stepd.cli.common import (
    EXIT_CONFLICT,
    EXIT_NOT_FOUND,
    EXIT_UNAUTHORIZED,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
)

from ._serve import ServeProcess
from .conftest import ADMIN_KEY, Cli, stepd_process

pytestmark = pytest.mark.timeout(60)


def _one_line(stderr: str) -> str:
    assert stderr.endswith("\n") and stderr.count("\n") == 1, stderr
    assert stderr.startswith("error: "), stderr
    return stderr


@pytest.mark.parametrize("command", [
    ("run", "status", "r_nope"),
    ("run", "journal", "r_nope"),
    ("run", "export", "r_nope"),
    ("run", "signal", "r_nope", "go"),
    ("run", "cancel", "r_nope"),
])
def test_an_unknown_run_is_not_found(cli: Cli, command: tuple[str, ...]) -> None:
    r = cli(*command)
    assert r.exit_code == EXIT_NOT_FOUND
    assert _one_line(r.stderr) == "error: run r_nope not found\n"
    assert r.stdout == ""


def test_an_unknown_workflow_is_not_found(cli: Cli) -> None:
    r = cli("run", "start", "no_such_workflow")
    assert r.exit_code == EXIT_NOT_FOUND
    assert "no_such_workflow" in _one_line(r.stderr) and "not registered" in r.stderr


@pytest.mark.parametrize(("args", "message"), [
    (("run", "start", "cli_echo", "--input", "{bad"), "error: invalid --input: '{bad' is not JSON"),
    (("run", "start", "cli_echo", "--input", "NaN"), "error: invalid --input: 'NaN' is not JSON"),
    (("run", "start", "cli_echo", "--correlation", "[1,"), "error: invalid --correlation"),
    (("run", "signal", "r_x", "go", "--payload", "nope"), "error: invalid --payload"),
    (("run", "start", "cli_echo", "--input", "@/no/such/file.json"),
     "error: invalid --input: cannot read '/no/such/file.json'"),
    (("run", "start", "cli_echo", "--idempotency-key", ""),
     "error: invalid input: field 'idempotency_key': "),
    (("run", "start"), "error: Missing argument 'WORKFLOW'. (see 'stepd run start --help')"),
    (("run", "list", "--status", "sleepy"), "error: Invalid value for '--status'"),
    (("run", "start", "cli_echo", "--timeout", "3"), "error: --timeout needs --wait"),
    (("nosuch",), "error: No such command 'nosuch'."),
])
def test_usage_errors_exit_2(cli: Cli, args: tuple[str, ...], message: str) -> None:
    r = cli(*args)
    assert r.exit_code == EXIT_USAGE, (r.stdout, r.stderr)
    assert _one_line(r.stderr).startswith(message), r.stderr


def test_input_from_stdin(cli: Cli) -> None:
    r = cli("run", "start", "cli_echo", "--input", "-", "--wait", input='{"from": "stdin"}')
    assert r.exit_code == 0, r.stderr
    assert '"from": "stdin"' in r.stdout


def test_a_conflict_exits_4(cli: Cli) -> None:
    run_id = cli("run", "start", "cli_echo", "--wait").stdout.split("\n", 1)[0]
    r = cli("run", "cancel", run_id)
    assert r.exit_code == EXIT_CONFLICT
    assert _one_line(r.stderr) == f"error: run {run_id} is already over (completed)\n"


def test_a_refused_key_exits_6(cli: Cli) -> None:
    r = cli("run", "list", "--key", "not-the-key")
    assert r.exit_code == EXIT_UNAUTHORIZED
    assert "refused the key" in _one_line(r.stderr) and "not-the-key" not in r.stderr
    missing = cli("workers", env={"STEPD_KEY": ""})
    assert missing.exit_code == EXIT_UNAUTHORIZED


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_an_unreachable_daemon_exits_5_from_the_real_entry_point() -> None:
    url = f"http://127.0.0.1:{_free_port()}"
    r = stepd_process("run", "status", "r_x", env={"STEPD_URL": url})
    assert r.returncode == EXIT_UNREACHABLE
    assert _one_line(r.stderr).startswith(f"error: cannot reach the daemon at {url} (")
    assert "is 'stepd serve' running?" in r.stderr
    assert r.stdout == ""


def test_the_real_entry_point_against_the_daemon(daemon: ServeProcess) -> None:
    ok = stepd_process("actors", "--url", daemon.url, "--key", ADMIN_KEY)
    assert ok.returncode == 0, ok.stderr
    assert "/registry" in ok.stdout
    missing = stepd_process("run", "status", "r_nope", env={"STEPD_URL": daemon.url,
                                                           "STEPD_KEY": ADMIN_KEY})
    assert missing.returncode == EXIT_NOT_FOUND
    assert missing.stderr == "error: run r_nope not found\n"


def test_help_exits_0(cli: Cli) -> None:
    r = cli("--help")
    assert r.exit_code == 0
    for command in ("serve", "run", "workers", "actors", "demo"):
        assert command in r.stdout
    for sub in ("start", "status", "list", "journal", "export", "signal", "cancel"):
        assert sub in cli("run", "--help").stdout


def test_serve_on_a_taken_port_says_so_and_exits_1(daemon: ServeProcess, tmp_path: Path) -> None:
    port = daemon.url.rsplit(":", 1)[1]
    r = stepd_process("serve", "--data", str(tmp_path / "d"), "--port", port)
    assert r.returncode == 1
    assert f"stepd serve: cannot listen on http://127.0.0.1:{port}" in r.stderr
    assert "Traceback" not in r.stderr
