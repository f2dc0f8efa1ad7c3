"""The wheel carries the console: every file of ``transport/console/`` as package data.

Nothing is built at install time and nothing but Python runs the daemon, so the
static files must be in the wheel itself, beside ``stepd/transport/http.py``
(tests/test_packaging.py reads the same build: the session's `stepd_wheel`).
"""

from __future__ import annotations

import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONSOLE = ROOT / "transport" / "console"


def test_the_wheel_carries_every_console_file(stepd_wheel: Path) -> None:
    with zipfile.ZipFile(stepd_wheel) as z:
        names = set(z.namelist())
        files = [p for p in CONSOLE.rglob("*") if p.is_file()]
        assert files
        for path in files:
            name = f"stepd/transport/console/{path.relative_to(CONSOLE).as_posix()}"
            assert name in names, f"{name} is missing from the wheel"
            assert z.read(name) == path.read_bytes(), name
    assert not any(n.startswith("stepd/transport/console/") and n.endswith(".py") for n in names)
