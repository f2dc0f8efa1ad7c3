"""``stepd run retry|fork|watch``, ``run start --watch`` and ``run cancel --reason`` against
a real ``stepd serve`` and a real worker.

Watch is checked three ways: in process (click's runner: not a terminal, so
plain lines), as a real subprocess piped while the run moves (the lines come
as they happen, no escape sequences), and on a pseudo-terminal (rich's live
display: escape sequences, the progress line).
"""

from __future__ import annotations

import json
import os
import pty
import re
import select
import subprocess
import sys
import time

import pytest

import stepd

from ._serve import ROOT, clean_env
from .conftest import ADMIN_KEY, FLAKY_DOWN, Cli, eventually

pytestmark = pytest.mark.timeout(60)


def _start(cli: Cli, workflow: str, *args: str) -> str:
    r = cli("run", "start", workflow, *args)
    assert r.exit_code == 0, r.stderr
    return r.stdout.split("\n", 1)[0].strip()


def _ended(client: stepd.Client, run_id: str) -> stepd.RunStatus:
    return eventually(lambda: (s := client.status(run_id)).done and s, timeout=20,  # type: ignore[no-any-return]
                      what=f"run {run_id} to end")


def test_retry_resumes_a_failed_run_and_watch_shows_it_to_the_end(
        cli: Cli, client: stepd.Client) -> None:
    FLAKY_DOWN.set()
    try:
        run_id = _start(cli, "cli_flaky", "--input", "5")
        assert _ended(client, run_id).status == "failed"
    finally:
        FLAKY_DOWN.clear()
    r = cli("run", "retry", run_id)
    assert r.exit_code == 0, r.stderr
    assert r.stdout.strip() == f"run {run_id} resumed at step 'flaky': running"
    w = cli("run", "watch", run_id)
    assert w.exit_code == 0, w.stderr
    lines = w.stdout.splitlines()
    kinds = [line.split()[1] for line in lines if not line.startswith("progress:")]
    assert kinds.count("run_failed") == 1 and kinds.index("run_failed") < kinds.index("run_retried")
    assert kinds[-1] == "run_completed"
    assert "\x1b[" not in w.stdout  # not a terminal: plain lines
    assert lines[-1].startswith("progress: completed · 2/2 steps done · transitions 2/10")
    again = cli("run", "retry", run_id)
    assert again.exit_code == 4
    assert "only a failed run can be retried" in again.stderr
    assert client.status(run_id).result == {"done": {"n": 5}}


def test_a_run_failed_on_its_code_fails_again_and_watch_exits_7(cli: Cli,
                                                                 client: stepd.Client) -> None:
    run_id = _start(cli, "cli_fail")
    assert _ended(client, run_id).status == "failed"
    r = cli("run", "retry", run_id, "--json")
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout) == {"run_id": run_id, "status": "running", "step_id": "boom"}
    w = cli("run", "watch", run_id)
    assert w.exit_code == 7
    assert f"run {run_id} failed: step_failed at step 'boom'" in w.stderr
    assert [ln.split()[1] for ln in w.stdout.splitlines()
            if not ln.startswith("progress:")].count("run_failed") == 2


def test_fork_from_a_step_links_both_ways_in_status_and_export(cli: Cli,
                                                                client: stepd.Client) -> None:
    run_id = _start(cli, "cli_flaky", "--input", "8", "--correlation", '"T-8"')
    assert _ended(client, run_id).status == "completed"
    bad = cli("run", "fork", run_id, "--from-step", "nope")
    assert bad.exit_code == 2 and "field 'from_step'" in bad.stderr
    r = cli("run", "fork", run_id, "--from-step", "prepare")
    assert r.exit_code == 0, r.stderr
    fork_id = r.stdout.strip()
    assert fork_id.startswith("r_") and fork_id != run_id
    done = _ended(client, fork_id)
    assert done.status == "completed" and done.result == {"done": {"n": 8}}
    assert dict(done.state) == {"prepared": 8} and done.correlation == "T-8"
    shown = cli("run", "status", fork_id)
    assert re.search(rf"forked from +{run_id} after step 'prepare'", shown.stdout), shown.stdout
    source = json.loads(cli("run", "export", run_id).stdout)
    assert source["forks"] == [{"run_id": fork_id, "step_id": "prepare"}]
    assert source["input"] == 8 and source["result"] == {"done": {"n": 8}}
    assert source["forked_from"] is None and source["error"] is None
    exported = json.loads(cli("run", "export", fork_id).stdout)
    assert exported["forked_from"] == {"run_id": run_id, "step_id": "prepare"}
    seq = next(e["seq"] for e in exported["journal"] if e["type"] == "run_forked")
    assert exported["journal"][:seq - 1] == source["journal"][:seq - 1]


def test_cancel_with_a_reason_shows_it_in_the_status(cli: Cli, client: stepd.Client) -> None:
    run_id = _start(cli, "cli_wait")
    r = cli("run", "cancel", run_id, "--reason", "the customer withdrew")
    assert r.exit_code == 0, r.stderr
    assert r.stdout.strip() == f"run {run_id} cancelled: the customer withdrew"
    view = client.status(run_id)
    assert view.status == "cancelled" and view.error is not None
    assert view.error.message == "the customer withdrew"
    assert "cancelled at step 'go': the customer withdrew" in cli("run", "status", run_id).stdout


def test_start_watch_prints_the_id_then_the_journal(cli: Cli) -> None:
    r = cli("run", "start", "cli_echo", "--input", '{"w": 1}', "--watch")
    assert r.exit_code == 0, r.stderr
    first, *rest = r.stdout.splitlines()
    assert first.startswith("r_")
    kinds = [ln.split()[1] for ln in rest if not ln.startswith("progress:")]
    assert kinds[0] == "run_started" and kinds[-1] == "run_completed"
    assert "step_completed" in kinds
    assert rest[-1].startswith("progress: completed · 1/1 steps done · transitions 1/5 · "
                               "cost 1/10")
    j = cli("run", "start", "cli_echo", "--input", "2", "--watch", "--json")
    assert j.exit_code == 0, j.stderr
    docs = [json.loads(line) for line in j.stdout.splitlines()]
    assert docs[0]["created"] is True
    assert [d["type"] for d in docs[1:-1]][-1] == "run_completed"
    assert docs[-1] == {"run_id": docs[0]["run_id"], "status": "completed",
                        "result": {"echo": 2}, "error": None}
    both = cli("run", "start", "cli_echo", "--wait", "--watch")
    assert both.exit_code == 2 and "pick one" in both.stderr


def _stepd(*args: str, **kw: object) -> subprocess.Popen[bytes]:
    env = clean_env(STEPD_URL=kw.pop("url"), STEPD_KEY=ADMIN_KEY)  # type: ignore[arg-type]
    env.update(kw.pop("env", {}))  # type: ignore[arg-type]
    return subprocess.Popen([sys.executable, "-m", "stepd", *args], cwd=ROOT, env=env, **kw)  # type: ignore[call-overload, no-any-return]


def test_watch_piped_streams_plain_lines_as_the_run_moves(cli: Cli, client: stepd.Client) -> None:
    run_id = _start(cli, "cli_wait")
    proc = _stepd("run", "watch", run_id, "--interval", "0.05", url=cli.url,
                  stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        seen: list[str] = []
        deadline = time.monotonic() + 20
        while not any("waiting" in ln for ln in seen if ln.startswith("progress:")):
            assert time.monotonic() < deadline, seen
            seen.append(proc.stdout.readline().decode())
        # The watch is live: the signal sent now shows up in the same process.
        client.signal(run_id, "go", {"items": [1, 2, 3]})
        out, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = "".join(seen) + out.decode()
    assert proc.returncode == 0, err.decode()
    assert "\x1b[" not in text
    for kind in ("signal_received", "step_completed", "run_completed"):
        assert kind in text, text
    progress = [ln for ln in text.splitlines() if ln.startswith("progress:")]
    assert progress[0].startswith("progress: waiting · 0/2 steps done · at go")
    assert progress[-1].startswith("progress: completed · 2/2 steps done")


def test_watch_on_a_terminal_draws_a_live_progress_line(cli: Cli, client: stepd.Client) -> None:
    run_id = _start(cli, "cli_echo", "--input", "3")
    _ended(client, run_id)
    master, slave = pty.openpty()
    proc = _stepd("run", "watch", run_id, url=cli.url, stdout=slave, stderr=slave,
                  env={"TERM": "xterm-256color", "COLUMNS": "120"})
    os.close(slave)
    chunks: list[bytes] = []
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.2)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:  # the child closed the terminal (EIO)
                    break
                if not data:
                    break
                chunks.append(data)
            elif proc.poll() is not None:
                break
        assert proc.wait(20) == 0, b"".join(chunks)
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    screen = b"".join(chunks).decode(errors="replace")
    assert "\x1b[" in screen  # rich drew it: styles and cursor movement
    assert "run_completed" in screen
    assert "completed · 1/1 steps done" in screen
    assert "progress:" not in screen  # the plain rendering's label: not on a terminal
