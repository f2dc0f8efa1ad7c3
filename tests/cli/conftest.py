"""Fixtures for the CLI tests: a real ``stepd serve`` subprocess, a worker, the CLI runner.

* ``daemon``: ``python -m stepd serve`` on a free port of 127.0.0.1 with an admin
  key and a price book (model ``m``: 1 USD per million input tokens, 2 per
  million output tokens), shared by the session and stopped by PID (SIGTERM).
* ``worker``: a `stepd.Worker` in this process (WebSocket) serving the test
  workflows below, on a thread, for the whole session.
* ``cli``: runs ``stepd ...`` in process (click's runner) with ``STEPD_URL`` and
  ``STEPD_KEY`` pointing at the daemon; ``stepd_process`` runs the real entry
  point as a subprocess (``python -m stepd``).
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from click.testing import CliRunner, Result

import stepd
from stepd.cli import main
from tests._waiting import eventually as _eventually

from ._serve import ROOT, ServeProcess, clean_env, serve_process

ADMIN_KEY = "cli-admin-key-0123456789abcdef"
PRICES_TOML = '[models."m"]\ninput_per_million = 1.0\noutput_per_million = 2.0\n'


async def echo(ctx: stepd.StepContext, input: Any) -> dict[str, Any]:
    with ctx.span("llm.call", model="m") as span:
        span.set_usage(model="m", input_tokens=1000, output_tokens=500)
    ctx.patch_state(seen=input)
    return {"echo": input}


def boom(ctx: stepd.StepContext, input: Any) -> None:
    raise ValueError("bad input 7")


def double(ctx: stepd.StepContext, item: Any) -> Any:
    return item * 2


#: While set, the ``flaky`` body fails (class ``fatal``): a run to retry once it is cleared.
FLAKY_DOWN = threading.Event()


def prepare(ctx: stepd.StepContext, input: Any) -> dict[str, Any]:
    ctx.patch_state(prepared=input)
    return {"n": input}


def flaky(ctx: stepd.StepContext, input: Any) -> dict[str, Any]:
    if FLAKY_DOWN.is_set():
        raise stepd.StepFailure("fatal", "the flaky service is down")
    return {"done": input}


ECHO = (stepd.Workflow("cli_echo", version="cli.v1").then(echo)
        .budget(max_transitions=5, max_cost_units=10))
WAIT = (stepd.Workflow("cli_wait", version="cli.v1").wait("go", into="go")
        .for_each("${state.go.items}", double, into="doubled")
        .budget(max_state_bytes=200))
FAIL = stepd.Workflow("cli_fail").then(boom)
FLAKY = (stepd.Workflow("cli_flaky", version="cli.v1").then(prepare)
         .then(flaky, input="${steps.prepare}").budget(max_transitions=10))


@pytest.fixture(scope="session")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    base = tmp_path_factory.mktemp("cli")
    prices = base / "prices.toml"
    prices.write_text(PRICES_TOML)
    d = serve_process(base / "data", "--admin-key", ADMIN_KEY, "--prices", str(prices),
                      "--max-request-ms", "2000", "--shutdown-grace-ms", "2000")
    yield d
    assert d.stop() == 0, d.stderr()


@pytest.fixture(scope="session")
def worker(daemon: ServeProcess) -> Iterator[stepd.Worker]:
    w = stepd.Worker(daemon.url, key=ADMIN_KEY, concurrency=8, name="cli-worker",
                     build_id="cli-b1").register(ECHO, WAIT, FAIL, FLAKY)
    errors: list[BaseException] = []

    def serve() -> None:
        try:
            w.serve(handle_signals=False)
        except BaseException as exc:  # noqa: BLE001 - asserted below
            errors.append(exc)

    thread = threading.Thread(target=serve, name="cli-worker", daemon=True)
    thread.start()
    assert w.wait_ready(20), errors
    yield w
    w.stop(2)
    thread.join(20)
    assert not thread.is_alive() and not errors, errors


@pytest.fixture(scope="session")
def client(daemon: ServeProcess) -> Iterator[stepd.Client]:
    with stepd.Client(daemon.url, key=ADMIN_KEY, trust_env=False) as c:
        yield c


@dataclass
class Cli:
    url: str
    key: str

    def __call__(self, *args: str, env: dict[str, str] | None = None,
                 input: str | None = None) -> Result:
        runner = CliRunner()
        full = {"STEPD_URL": self.url, "STEPD_KEY": self.key, "COLUMNS": "200"}
        full.update(env or {})
        return runner.invoke(main, list(args), env=full, input=input, catch_exceptions=False,
                             prog_name="stepd")


@pytest.fixture
def cli(daemon: ServeProcess, worker: stepd.Worker) -> Cli:
    return Cli(daemon.url, ADMIN_KEY)


def stepd_process(*args: str, env: dict[str, str] | None = None,
                  timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    """``python -m stepd ARGS`` as a subprocess (the real entry point)."""
    return subprocess.run([sys.executable, "-m", "stepd", *args], check=False, capture_output=True,
                          text=True, timeout=timeout, env=clean_env(**(env or {})), cwd=ROOT)


def eventually(check: Callable[[], Any], *, timeout: float = 10.0, what: str = "") -> Any:
    return _eventually(check, timeout=timeout, what=what)
