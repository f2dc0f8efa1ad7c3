"""Durations as the SDK accepts them, normalised to integer milliseconds.

The wire form knows only integer milliseconds (PROTOCOL.md: "All times are
integers in milliseconds"); people write ``"30s"`` or ``timedelta(minutes=2)``.
This module is the one place that turns the second into the first, so the
builder, the CLI and tests agree on what ``"1h30m"`` means.

Accepted:

* an ``int`` (not a ``bool``): milliseconds, as is;
* a ``datetime.timedelta`` holding a whole number of milliseconds;
* a string of one or more ``<digits><unit>`` groups, units strictly decreasing
  and each used once: ``ms``, ``s``, ``m``, ``h``, ``d`` (``"500ms"``, ``"30s"``,
  ``"2m"``, ``"1h30m"``, ``"1d12h"``). No spaces, no signs, no fractions: a
  fraction is better written in the next smaller unit.

Floats are refused: ``2.5`` could mean seconds or milliseconds.
"""

from __future__ import annotations

import datetime
import re

from stepd.sansio.errors import Invalid

__all__ = ["Duration", "parse_duration"]

Duration = int | datetime.timedelta | str
"""What a duration argument may be (see the module docstring)."""

_UNIT_MS = {"d": 86_400_000, "h": 3_600_000, "m": 60_000, "s": 1_000, "ms": 1}
_UNIT_ORDER = ("d", "h", "m", "s", "ms")
_GROUP = re.compile(r"(\d+)(ms|s|m|h|d)")


def parse_duration(value: object, *, field: str, allow_zero: bool = False) -> int:
    """Milliseconds from an int, a timedelta or a string such as ``"1h30m"``.

    Args:
        value: the duration (see the module docstring).
        field: the field name the error names (``timeout``, ``steps[1].timeout_ms``).
        allow_zero: whether 0 is accepted (a ``sleep`` of 0 is; a timeout is not).

    Returns:
        The duration in whole milliseconds, ``>= 0`` (``> 0`` unless ``allow_zero``).

    Raises:
        Invalid: the value is not a duration, is negative, is zero when zero is
            not allowed, or is not a whole number of milliseconds.
    """
    ms: int
    if isinstance(value, bool):
        raise Invalid(_expected(allow_zero, value), field=field)
    if isinstance(value, int):
        ms = value
    elif isinstance(value, datetime.timedelta):
        micros = (value.days * 86_400 + value.seconds) * 1_000_000 + value.microseconds
        if micros % 1000:
            raise Invalid(f"must be a whole number of milliseconds, got {value!r}", field=field)
        ms = micros // 1000
    elif isinstance(value, str):
        ms = _parse_text(value, field=field, allow_zero=allow_zero)
    else:
        raise Invalid(_expected(allow_zero, value), field=field)
    if ms < 0 or (ms == 0 and not allow_zero):
        raise Invalid(_expected(allow_zero, value), field=field)
    return ms


def _parse_text(text: str, *, field: str, allow_zero: bool) -> int:
    pos = 0
    total = 0
    last_rank = -1
    while pos < len(text):
        match = _GROUP.match(text, pos)
        if match is None:
            break
        rank = _UNIT_ORDER.index(match.group(2))
        if rank <= last_rank:
            raise Invalid(
                f"units must appear once each, largest first (d, h, m, s, ms), got {text!r}",
                field=field,
            )
        last_rank = rank
        total += int(match.group(1)) * _UNIT_MS[match.group(2)]
        pos = match.end()
    if pos == 0 or pos != len(text):
        raise Invalid(
            f"{_expected(allow_zero, text)}; write e.g. '500ms', '30s', '2m', '1h30m', '1d'",
            field=field,
        )
    return total


def _expected(allow_zero: bool, got: object) -> str:
    what = "a duration >= 0" if allow_zero else "a duration > 0"
    return f"must be {what} (int milliseconds, timedelta or text like '30s'), got {got!r}"
