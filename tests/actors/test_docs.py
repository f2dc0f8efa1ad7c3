"""docs/actors.md's first example runs as written, on both backends."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "actors.md"


def _first_example() -> str:
    blocks: list[str] = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.DOTALL)
    assert blocks, "docs/actors.md has no python example"
    return blocks[0]


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_the_example_runs(backend: str) -> None:
    code = _first_example().replace("anyio.run(main)", f"anyio.run(main, backend={backend!r})")
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["['/', '/leases', '/leases/l_7']", "lease", "False"]
