"""``stepd schedule ...`` and ``stepd runs prune`` against the session's real daemon."""

from __future__ import annotations

import json
from pathlib import Path

from .conftest import Cli, stepd_process


def test_schedule_create_list_pause_resume_delete(cli: Cli) -> None:
    r = cli("schedule", "create", "cli_echo", "--cron", "0 0 1 1 *", "--tz", "Asia/Tokyo",
            "--input", '{"new": "year"}', "--overlap", "buffer_one", "--catchup", "2h",
            "--json")
    assert r.exit_code == 0, r.stderr
    created = json.loads(r.stdout)
    sid = created["schedule_id"]
    assert created["catchup_window_ms"] == 7_200_000 and created["input"] == {"new": "year"}
    listed = cli("schedule", "list")
    assert listed.exit_code == 0 and sid in listed.stdout and "Asia/Tokyo" in listed.stdout
    paused = cli("schedule", "pause", sid)
    assert paused.exit_code == 0 and paused.stdout.startswith(f"paused {sid} ") \
        and paused.stdout.rstrip().endswith(": paused")
    resumed = cli("schedule", "resume", sid)
    assert resumed.exit_code == 0 and "next fire" in resumed.stdout
    assert json.loads(cli("schedule", "show", sid).stdout)["paused"] is False
    assert cli("schedule", "delete", sid).stdout == f"deleted {sid}\n"
    gone = cli("schedule", "show", sid)
    assert gone.exit_code == 3 and "not found" in gone.stderr
    assert sid not in json.dumps(json.loads(cli("schedule", "list", "--json").stdout))


def test_schedule_errors_name_the_field(cli: Cli) -> None:
    bad = cli("schedule", "create", "cli_echo", "--cron", "every minute")
    assert bad.exit_code == 2 and "field 'cron'" in bad.stderr
    zone = cli("schedule", "create", "cli_echo", "--cron", "* * * * *", "--tz", "Moon/Base")
    assert zone.exit_code == 2 and "field 'timezone'" in zone.stderr
    nobody = cli("schedule", "create", "nobody_serves_it", "--cron", "* * * * *")
    assert nobody.exit_code == 2 and "field 'workflow'" in nobody.stderr


def test_runs_prune(cli: Cli) -> None:
    # Before 2000: nothing of this daemon's is that old (the shared daemon's runs stay).
    r = cli("runs", "prune", "--before", "2000-01-01T00:00:00Z")
    assert r.exit_code == 0, r.stderr
    assert r.stdout == "pruned 0 runs\n"
    bad = cli("run", "prune", "--before", "last tuesday")
    assert bad.exit_code == 2 and "--before" in bad.stderr


def test_serve_refuses_a_retention_that_is_not_a_duration(tmp_path: Path) -> None:
    r = stepd_process("serve", "--data", str(tmp_path / "d"), "--port", "0",
                      "--retention", "a month")
    assert r.returncode == 2, r.stderr
    assert "retention" in r.stderr and "duration" in r.stderr
