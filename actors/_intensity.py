"""Restart intensity: a pure sliding window over monotonic time.

This is OTP's ``supervisor:add_restart/1`` as a pure function: given the times
of earlier restarts, the time of a new one, and the limits, it returns the new
window and whether the supervisor may go on. It reads no clock and keeps no
state, so it is tested without an event loop.

The window is inclusive like OTP's: a restart exactly `period` seconds ago
still counts. "More than `intensity` restarts within `period` seconds" means
the supervisor gives up; ``intensity=0`` forbids restarts altogether.
"""

from __future__ import annotations

import math

__all__ = ["add_restart"]


def add_restart(
    history: tuple[float, ...], now: float, *, intensity: int, period: float
) -> tuple[tuple[float, ...], bool]:
    """Record a restart at `now` and decide whether it stays within the limit.

    Args:
        history: earlier restart times (any order; only those still inside the
            window are kept).
        now: the monotonic time of this restart, in seconds.
        intensity: the maximum number of restarts allowed within `period`.
        period: the window length in seconds.

    Returns:
        ``(window, ok)``: the restart times still inside the window including
        `now`, oldest first; and `True` if at most `intensity` of them remain,
        `False` if the supervisor must give up and escalate.

    Raises:
        ValueError: if `intensity` is negative or `period` is not a positive
            finite number.
    """
    if intensity < 0:
        raise ValueError(f"intensity must be >= 0, got {intensity!r}")
    if not (math.isfinite(period) and period > 0):
        raise ValueError(f"period must be a positive finite number of seconds, got {period!r}")
    threshold = now - period
    window = tuple(sorted(t for t in history if t >= threshold)) + (now,)
    return window, len(window) <= intensity
