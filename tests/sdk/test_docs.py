"""docs/sdk.md's quickstart runs as written (embedded daemon, in a temporary directory)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(60)


def test_the_quickstart_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                             capsys: pytest.CaptureFixture[str]) -> None:
    text = (ROOT / "docs" / "sdk.md").read_text()
    quickstart = re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)[0]
    monkeypatch.chdir(tmp_path)
    exec(compile(quickstart, "docs/sdk.md", "exec"), {"__name__": "quickstart"})
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "{'text': 'Re: your billing question'}"
    assert out[1].startswith("Usage(input_tokens=812, output_tokens=9")
