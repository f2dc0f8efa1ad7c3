"""README.md's two opening commands stay true, and CI runs the same test command."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _opening_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```(?:sh|bash|console)?\n(.*?)```", text, flags=re.DOTALL)
    return [line.strip() for block in blocks[:2] for line in block.splitlines() if line.strip()]


def test_ci_runs_the_readme_test_command() -> None:
    commands = _opening_commands()
    assert len(commands) == 2, commands
    test_command = commands[1]
    assert "pytest" in test_command
    ci = (ROOT / ".ci" / "run").read_text()
    assert test_command in ci, "the README's test command and .ci/run have drifted apart"
