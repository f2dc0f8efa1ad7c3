"""Bounded polling for tests that watch real processes: one helper, not one per file."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def eventually(check: Callable[[], Any], *, timeout: float = 10.0, what: str = "",
               interval: float = 0.02) -> Any:
    """Call `check` until it returns something truthy, and return that; at most `timeout` s.

    Raises:
        AssertionError: the time ran out (naming `what`).
    """
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or check}")
        if interval:
            time.sleep(interval)
