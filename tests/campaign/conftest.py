"""The reliability campaign (`python -m tests.campaign`): settings, gating and reporting.

The campaign's tests are long fault-injection runs (daemon and worker SIGKILLs,
stale worker calls, actor kills, power cuts, abuse). They are not part of the
default ``python -m pytest`` of the repository: unless ``STEPD_CAMPAIGN=1`` is
set, nothing in this folder is collected (``collect_ignore_glob``; the modules
are not even imported), and a campaign file named on the command line is
skipped. With the variable set, any way of naming them works::

    STEPD_CAMPAIGN=1 python -m pytest tests/campaign/test_daemon_sigkill.py
    python -m tests.campaign --size reduced -k worker      # sets it, see __main__.py

Sizes come from environment variables (`SIZES`: ``STEPD_CAMPAIGN_DAEMON_KILLS``
and the others); a test reads its own with `campaign_int`, whose default is the
``full`` size. ``python -m tests.campaign --size reduced`` sets them all.

Every test reports one Jepsen-style summary line through the ``summary``
fixture, the reliability tests' own (``tests/reliability/conftest.py``): the
line is printed, recorded as the junit property ``summary`` and repeated at
the end of the run, under "stepd campaign summaries".
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import tests.reliability.conftest as _reliability

# The fixture itself, shared with the reliability tests (listed in __all__).
from tests.reliability.conftest import summary

ENABLED = os.environ.get("STEPD_CAMPAIGN") == "1"

if not ENABLED:
    # Not collected at all, so the default suite neither runs nor imports them.
    collect_ignore_glob = ["*"]

#: name -> (full, reduced). ``full`` is the campaign's figure; ``reduced`` is what
#: CI runs after the main suite (about 10 minutes on 2 cores, all tests together).
SIZES: dict[str, tuple[int, int]] = {
    "STEPD_CAMPAIGN_DAEMON_KILLS": (50, 10),
    "STEPD_CAMPAIGN_DAEMON_ACKS": (10_000, 1_000),  # acknowledged completions at least
    "STEPD_CAMPAIGN_WORKER_KILLS": (500, 50),
    "STEPD_CAMPAIGN_STALE": (1_000, 1_000),
    "STEPD_CAMPAIGN_ACTOR_KILLS": (100, 20),  # per actor kind
    "STEPD_CAMPAIGN_POWER_CUTS": (20, 3),
}


def campaign_int(name: str) -> int:
    """The size ``name`` (a key of `SIZES`) from the environment, else its full size."""
    raw = os.environ.get(name)
    return int(raw) if raw else SIZES[name][0]


def campaign_seed(default: int = 20261201) -> int:
    """``STEPD_CAMPAIGN_SEED``, else ``STEPD_RELIABILITY_SEED``, else ``default``."""
    raw = os.environ.get("STEPD_CAMPAIGN_SEED") or os.environ.get("STEPD_RELIABILITY_SEED")
    return int(raw) if raw else default


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # A campaign file named on the command line is collected even so (pytest does
    # not ignore explicit paths): without the variable it is skipped, not run.
    if ENABLED:
        return
    here = Path(__file__).parent
    skip = pytest.mark.skip(reason="the reliability campaign runs only with STEPD_CAMPAIGN=1 "
                                   "(python -m tests.campaign)")
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    # The shared fixture keeps its lines in the reliability conftest; when that
    # conftest is loaded too (both folders in one run), it repeats them all itself.
    if terminalreporter.config.pluginmanager.is_registered(_reliability):
        return
    if _reliability._SUMMARIES:
        terminalreporter.section("stepd campaign summaries")
        for line in _reliability._SUMMARIES:
            terminalreporter.write_line(line)


__all__ = ["ENABLED", "SIZES", "campaign_int", "campaign_seed", "summary"]
