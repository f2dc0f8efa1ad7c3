"""Restart intensity as a pure sliding window (OTP add_restart), no event loop."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stepd.actors import add_restart


def test_within_limit_then_over() -> None:
    window: tuple[float, ...] = ()
    decisions = []
    for now in (0.0, 1.0, 2.0, 3.0):
        window, ok = add_restart(window, now, intensity=3, period=5.0)
        decisions.append(ok)
    assert decisions == [True, True, True, False]
    assert window == (0.0, 1.0, 2.0, 3.0)


def test_old_restarts_slide_out_of_the_window() -> None:
    window, ok = add_restart((0.0, 1.0, 2.0), 7.5, intensity=3, period=5.0)
    assert ok
    assert window == (7.5,)
    window, ok = add_restart((1.0, 2.0, 3.0), 6.5, intensity=3, period=5.0)
    assert window == (2.0, 3.0, 6.5)
    assert ok


def test_window_is_inclusive_like_otp() -> None:
    # A restart exactly `period` ago still counts.
    window, ok = add_restart((0.0,), 5.0, intensity=1, period=5.0)
    assert window == (0.0, 5.0)
    assert not ok
    window, ok = add_restart((0.0,), 5.000001, intensity=1, period=5.0)
    assert window == (5.000001,)
    assert ok


def test_zero_intensity_allows_no_restart() -> None:
    assert add_restart((), 0.0, intensity=0, period=1.0) == ((0.0,), False)


def test_the_function_is_pure() -> None:
    history = (1.0, 2.0)
    assert add_restart(history, 3.0, intensity=5, period=10.0) == add_restart(
        history, 3.0, intensity=5, period=10.0
    )
    assert history == (1.0, 2.0)


@pytest.mark.parametrize(
    ("intensity", "period", "match"),
    [
        (-1, 5.0, "intensity"),
        (1, 0.0, "period"),
        (1, -1.0, "period"),
        (1, math.inf, "period"),
        (1, math.nan, "period"),
    ],
)
def test_bad_limits_are_rejected(intensity: int, period: float, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        add_restart((), 0.0, intensity=intensity, period=period)


@given(
    gaps=st.lists(
        st.floats(min_value=0.0, max_value=10.0, allow_nan=False), min_size=1, max_size=40
    ),
    intensity=st.integers(min_value=0, max_value=6),
    period=st.floats(min_value=0.01, max_value=20.0, allow_nan=False),
)
def test_matches_a_brute_force_count(gaps: list[float], intensity: int, period: float) -> None:
    """Feeding restarts one by one gives, at each step, the brute-force verdict:
    ok iff at most `intensity` restarts happened in [now - period, now]."""
    times: list[float] = []
    now = 0.0
    window: tuple[float, ...] = ()
    for gap in gaps:
        now += gap
        times.append(now)
        window, ok = add_restart(window, now, intensity=intensity, period=period)
        in_window = [t for t in times if t >= now - period]
        assert ok == (len(in_window) <= intensity)
        assert window == tuple(in_window)
        if not ok:
            break  # the supervisor would have given up here
