"""The wheel carries the console: every file of ``transport/console/`` as package data.

Nothing is built at install time and nothing but Python runs the daemon, so the
static files must be in the wheel itself, beside ``stepd/transport/http.py``
(tests/test_packaging.py builds the wheel the same way).
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONSOLE = ROOT / "transport" / "console"


def test_the_wheel_carries_every_console_file(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation",
         "-q", "-w", str(tmp_path)],
        check=True, cwd=tmp_path, timeout=300,
    )
    (wheel,) = tmp_path.glob("stepd-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        files = [p for p in CONSOLE.rglob("*") if p.is_file()]
        assert files
        for path in files:
            name = f"stepd/transport/console/{path.relative_to(CONSOLE).as_posix()}"
            assert name in names, f"{name} is missing from the wheel"
            assert z.read(name) == path.read_bytes(), name
    assert not any(n.startswith("stepd/transport/console/") and n.endswith(".py") for n in names)
