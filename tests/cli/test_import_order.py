"""``stepd.embedded`` stays the function whatever was imported first.

Found by the CLI tests: ``stepd.Client(url)`` imports the submodule
``stepd.embedded``, which used to replace the package's lazily exported
function of the same name, so a later ``stepd.embedded(path)`` in the same
process raised ``TypeError: 'module' object is not callable``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

PROGRAM = """
import stepd
stepd.Client("http://127.0.0.1:1")       # imports the submodule stepd.embedded
import stepd.embedded                     # and so does this
from stepd.embedded import Embedded
with stepd.embedded(sys.argv[1]) as daemon:
    assert isinstance(daemon, Embedded)
    print("ok", callable(stepd.embedded))
"""


def test_a_client_first_does_not_shadow_stepd_embedded(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-c", "import sys\n" + PROGRAM, str(tmp_path)],
                          check=False, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "ok True\n"
