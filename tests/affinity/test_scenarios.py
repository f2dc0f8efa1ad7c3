"""The scenario manifest (tests/affinity/scenarios.toml) tells the truth.

Issue 14 asks for a machine-readable list of the cross-worker scenarios and the
tests that prove them. This checks that every scenario the issue names is
listed, that each entry is well formed, that a ``done`` scenario lists tests
and a ``pending`` one names the branch that owns it and lists none yet, and
that every listed test exists: pytest collects it (this run's own collection when it
holds every listed test, as the full suite does; else pytest in a subprocess).
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = Path(__file__).with_name("scenarios.toml")

#: The scenarios issue 14 names ("Scenario manifest and tests").
REQUIRED = frozenset({
    "manifest-truthfulness", "local-step-replay", "session-holder-loss-reacquire",
    "sticky-hit-eviction", "worker-replacement", "forced-cold-replay", "build-mismatch",
    "mixed-version-fleet", "no-settings",
})
STATUSES = frozenset({"done", "pending"})

pytestmark = pytest.mark.timeout(120)


def scenarios() -> list[dict[str, Any]]:
    with MANIFEST.open("rb") as f:
        data = tomllib.load(f)
    assert set(data) == {"scenario"}, f"unknown top-level keys: {sorted(data)}"
    return list(data["scenario"])


def test_every_scenario_of_the_issue_is_listed_once_and_well_formed() -> None:
    entries = scenarios()
    ids = [e.get("id") for e in entries]
    assert len(ids) == len(set(ids)), "a scenario is listed twice"
    assert set(ids) == REQUIRED
    for e in entries:
        assert set(e) == {"id", "title", "owner", "status", "tests"}, e
        assert e["status"] in STATUSES, e
        assert isinstance(e["title"], str) and e["title"], e
        assert isinstance(e["owner"], str) and e["owner"], e
        assert isinstance(e["tests"], list), e
        if e["status"] == "done":
            assert e["tests"], f"{e['id']}: done, but no test proves it"
        else:
            assert not e["tests"], f"{e['id']}: pending scenarios list their tests when done"
        for node in e["tests"]:
            path, sep, name = node.partition("::")
            assert sep and name and "[" not in name, f"{node}: path::test_name, no parameters"
            assert (ROOT / path).is_file(), f"{node}: no such file"


def not_collected(nodes: list[str], collected: set[str]) -> list[str]:
    return [n for n in nodes
            if n not in collected and not any(c.startswith(n + "[") for c in collected)]


def test_every_listed_test_is_collected(request: pytest.FixtureRequest) -> None:
    nodes = sorted({node for e in scenarios() for node in e["tests"]})
    # The full suite has already collected every listed test: this run's own items
    # prove it. Otherwise (a file run alone, -k, -m, --deselect) a second pytest
    # collects the files in a subprocess (~5-10 s of imports) and has the last word.
    missing = not_collected(nodes, {item.nodeid for item in request.session.items})
    if missing:
        files = sorted({node.partition("::")[0] for node in nodes})
        out = subprocess.run(
            [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
             *files], check=False, cwd=ROOT, capture_output=True, text=True, timeout=100)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
        missing = not_collected(
            nodes, {line.strip() for line in out.stdout.splitlines() if "::" in line})
    assert not missing, f"listed but not collected: {missing}"
