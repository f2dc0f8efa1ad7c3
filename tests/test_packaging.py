"""The wheel carries exactly the `stepd` package tree (DESIGN.md "Layout").

actors/, storage/ and transport/ sit at the repository root but must install as
`stepd.actors`, `stepd.storage` and `stepd.transport`: a top-level `actors`
package in site-packages would collide with anything else called that.
"""

from __future__ import annotations

import zipfile
from pathlib import Path


def test_wheel_contains_only_the_stepd_tree(stepd_wheel: Path) -> None:
    names = zipfile.ZipFile(stepd_wheel).namelist()
    tops = {name.split("/", 1)[0] for name in names}
    dist_info = {t for t in tops if t.endswith(".dist-info")}
    assert len(dist_info) == 1
    assert tops - dist_info == {"stepd"}, f"unexpected top-level entries: {sorted(tops)}"
    for sub in ("actors", "storage", "transport", "sansio", "cli", "channels", "actors/daemon"):
        assert f"stepd/{sub}/__init__.py" in names, f"stepd/{sub} is missing from the wheel"
    assert not any("/tests/" in n or n.startswith("tests/") for n in names)
    assert "stepd/py.typed" in names
