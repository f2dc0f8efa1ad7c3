"""Every example runs to completion as a subprocess, bounded, and prints what it should.

``examples/support.py`` and ``examples/research.py`` run on their embedded
default and against ``stepd serve`` (a subprocess on a free port, stopped by
PID); ``examples/chaos.py`` starts its own daemon and workers;
``examples/raw_http_worker.py`` (no SDK) runs against ``stepd serve``;
``examples/gpu_session.py`` (a worker session with a "GPU" requirement) runs
embedded and against ``stepd serve``.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator

import pytest

from tests.cli._serve import ROOT, ServeProcess, clean_env, serve_process

pytestmark = pytest.mark.timeout(120)

PRICES_TOML = """\
[models."fast-1"]
input_per_million = 0.25
output_per_million = 1.25

[models."smart-1"]
input_per_million = 3.0
output_per_million = 15.0
"""


def example(name: str, *args: str, timeout: float = 60.0) -> str:
    """Run ``python examples/NAME ARGS``; return its stdout once it exits 0."""
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / name), *args],
                          check=False, capture_output=True, text=True, timeout=timeout, env=clean_env(),
                          cwd=ROOT)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    base = tmp_path_factory.mktemp("examples")
    prices = base / "prices.toml"
    prices.write_text(PRICES_TOML)
    d = serve_process(base / "data", "--prices", str(prices), "--max-request-ms", "3000",
                      "--shutdown-grace-ms", "2000")
    yield d
    assert d.stop() == 0, d.stderr()


def _check_support(out: str, tickets: int) -> None:
    assert f"total: {tickets} runs, {tickets} completed" in out, out
    assert out.count("sent to ") == tickets - 1 and "not sent, escalated to lead@" in out
    tokens = re.search(r"(\d+) input and (\d+) output tokens, \$(\d+\.\d+)", out)
    assert tokens and int(tokens[1]) > 0 and int(tokens[2]) > 0 and float(tokens[3]) > 0, out
    assert "its spans: draft.reply, kb.search, llm.call, tool.call" in out
    assert "support.v2" in out and "'transitions': 5" in out


def test_support_embedded() -> None:
    out = example("support.py", "--tickets", "3")
    assert "over inprocess" in out
    _check_support(out, 3)


def test_support_against_serve(serve: ServeProcess) -> None:
    out = example("support.py", "--tickets", "4", "--url", serve.url)
    assert "over websocket" in out
    _check_support(out, 4)


def _check_research(out: str) -> None:
    assert re.search(r"(\d+)/\1 checks passed", out), out
    assert "FAILED" not in out
    assert "(created=True); again -> " in out and "(created=False)" in out
    assert "refused: BudgetExceeded(budget='max_state_bytes')" in out
    assert "budget_exceeded at step 'tasks': max_for_each_items" in out
    assert "budget_exceeded at step 'summarise': max_started_workflows" in out
    assert "max_transitions 6/20" in out


def test_research_embedded() -> None:
    _check_research(example("research.py"))


def test_research_against_serve(serve: ServeProcess) -> None:
    _check_research(example("research.py", "--url", serve.url))


def test_raw_http_worker_against_serve(serve: ServeProcess) -> None:
    out = example("raw_http_worker.py", "--url", serve.url, "--runs", "3", "--timeout", "30")
    lines = out.splitlines()
    assert len(lines) == 3, out
    for i, line in enumerate(lines):
        assert re.fullmatch(rf"r_\w+ completed 'hello, ADA-{i}!'", line), line


def test_chaos() -> None:
    out = example("chaos.py", "--runs", "50", "--timeout", "50", timeout=90)
    assert "OK: 50/50 runs completed with the right result, 0 lost" in out, out
    assert re.search(r"SIGKILL chaos-w1 \(pid \d+\)", out)
    killed = re.search(r"actors killed: (\d+)", out)
    assert killed and int(killed[1]) > 0, out
    assert "'completed': 50" in out


def _check_gpu_session(out: str) -> None:
    assert "session gpu acquired by gpu-a (generation 1)" in out, out
    assert "session gpu acquired by gpu-b (generation 2)" in out, out
    assert "every session step ran on a GPU worker: True" in out, out
    assert "cpu-box" not in out.split("texts:", 1)[1], out
    assert "journal: session_acquired, session_lost, session_acquired" in out, out
    assert "warm ran as a local step on: gpu-a" in out, out  # in load's worker, no lease
    assert "warm" not in out.split("texts:", 1)[1].split("warm ran", 1)[0], out  # never offered


def test_gpu_session_embedded() -> None:
    _check_gpu_session(example("gpu_session.py"))


def test_gpu_session_against_serve(serve: ServeProcess) -> None:
    _check_gpu_session(example("gpu_session.py", "--url", serve.url))
