"""docs/run-machine.md shows the transition table as it is.

Run `python -m tests.sansio.test_docs` to rewrite the diagram after changing
the table.
"""

from __future__ import annotations

import re
from pathlib import Path

from stepd.sansio.run import mermaid

DOC = Path(__file__).resolve().parents[2] / "docs" / "run-machine.md"
BLOCK = re.compile(r"```mermaid\n(.*?)```", re.DOTALL)


def test_the_diagram_in_the_docs_is_generated_from_the_table() -> None:
    match = BLOCK.search(DOC.read_text())
    assert match, "docs/run-machine.md has no mermaid block"
    assert match.group(1).strip() == mermaid().strip(), (
        "docs/run-machine.md is out of date: run `python -m tests.sansio.test_docs`"
    )


if __name__ == "__main__":
    text = DOC.read_text()
    DOC.write_text(BLOCK.sub(lambda m: f"```mermaid\n{mermaid()}\n```", text, count=1))
    print(f"rewrote {DOC}")
