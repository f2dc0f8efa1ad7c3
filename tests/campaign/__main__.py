"""Run the reliability campaign: ``python -m tests.campaign [--size full|reduced] [-k EXPR]``.

From the repository's root (``tests`` is a package). It sets ``STEPD_CAMPAIGN=1``
and every size of `tests.campaign.conftest.SIZES` for the chosen size (a size
variable already set in the environment wins, so one figure can be changed
alone), runs pytest on ``tests/campaign`` (every test module there, whoever
wrote it) and prints, at the end, each test's outcome, run time and summary
line (the junit property ``summary`` the ``summary`` fixture records).
Arguments after ``--`` go to pytest as they are. The exit status is pytest's.

    python -m tests.campaign                      # full: the campaign's figures
    python -m tests.campaign --size reduced       # what CI runs (~10 min on 2 cores)
    python -m tests.campaign -k "stale or actor" -- -x
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

from .conftest import SIZES

ROOT = Path(__file__).resolve().parents[2]
CAMPAIGN_DIR = Path(__file__).resolve().parent


def environment(size: str) -> dict[str, str]:
    env = dict(os.environ)
    env["STEPD_CAMPAIGN"] = "1"
    env["STEPD_CAMPAIGN_SIZE"] = size
    index = 0 if size == "full" else 1
    for name, values in SIZES.items():
        env.setdefault(name, str(values[index]))
    return env


def results(junit: Path) -> list[tuple[str, str, float, list[str]]]:
    """(test id, outcome, seconds, summary lines) per test case of a junit file."""
    out: list[tuple[str, str, float, list[str]]] = []
    try:
        root = ET.parse(junit).getroot()
    except (OSError, ET.ParseError):
        return out
    for case in root.iter("testcase"):
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            found = case.find(tag)
            if found is not None:
                outcome = tag
                if tag == "skipped" and (found.get("type") or "").endswith("xfail"):
                    outcome = "xfailed"
        lines = [p.get("value") or "" for p in case.iter("property") if p.get("name") == "summary"]
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        out.append((name, outcome, float(case.get("time") or 0.0), lines))
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    parser = argparse.ArgumentParser(prog="python -m tests.campaign",
                                     description="Run the stepd reliability campaign.")
    parser.add_argument("--size", choices=("full", "reduced"), default="full")
    parser.add_argument("-k", dest="keyword", default=None, help="pytest -k expression")
    args = parser.parse_args(argv)
    env = environment(args.size)
    sizes = " ".join(f"{k.removeprefix('STEPD_CAMPAIGN_')}={env[k]}" for k in SIZES)
    print(f"stepd campaign: size={args.size} {sizes}", flush=True)
    with tempfile.TemporaryDirectory(prefix="stepd-campaign-") as tmp:
        junit = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", str(CAMPAIGN_DIR.relative_to(ROOT)), "-q", "-rfEX",
               f"--junitxml={junit}", "-o", "junit_family=xunit1"]
        if args.keyword:
            cmd += ["-k", args.keyword]
        cmd += extra
        status = subprocess.call(cmd, cwd=ROOT, env=env)
        cases = results(junit)
    print(f"\n===== stepd campaign ({args.size}): {len(cases)} tests, pytest exit {status} =====")
    for name, outcome, seconds, lines in cases:
        print(f"{outcome.upper():8} {seconds:7.1f}s {name}")
        for line in lines:
            print(f"    {line}")
    return status


if __name__ == "__main__":
    sys.exit(main())
