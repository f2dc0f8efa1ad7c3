"""README.md's quickstart runs as written, and prints what the README says it prints."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(60)


def _quickstart() -> tuple[str, list[str]]:
    """The first python block of README.md, and the lines of the output block after it."""
    text = (ROOT / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, flags=re.DOTALL)
    assert code is not None
    printed = re.compile(r"\n```\n(.*?)```", flags=re.DOTALL).search(text, code.end())
    assert printed is not None
    return code.group(1), printed.group(1).strip().splitlines()


def test_the_quickstart_runs_twice_with_the_same_run(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    quickstart, printed = _quickstart()
    monkeypatch.chdir(tmp_path)
    outputs = []
    for _ in range(2):  # the second time, the idempotency key returns the original run
        exec(compile(quickstart, "README.md", "exec"), {"__name__": "quickstart"})  # noqa: S102
        outputs.append(capsys.readouterr().out.splitlines())
    assert outputs[0] == outputs[1]
    out = outputs[0]
    assert len(out) == len(printed) == 3, (out, printed)
    assert out[0] == printed[0]
    head, _, tail = printed[1].partition("...")
    assert out[1].startswith(head) and out[1].endswith(tail), (out[1], printed[1])
    assert out[2] == printed[2]
