"""Clocks: ManualClock's virtual time and wake-ups, SystemClock's scales."""

from __future__ import annotations

import math

import anyio
import pytest

from stepd.actors import Clock, ManualClock, SystemClock

from ._helpers import settle


def test_manual_clock_starts_where_told_and_moves_both_scales_together() -> None:
    clock = ManualClock(10.0, wall_ms=5_000)
    assert clock.now() == 10.0
    assert clock.time_ms() == 5_000
    clock.advance(1.5)
    assert clock.now() == 11.5
    assert clock.time_ms() == 6_500
    clock.advance_to(20.0)
    assert clock.now() == 20.0
    assert clock.time_ms() == 15_000


def test_manual_clock_has_no_rounding_drift() -> None:
    clock = ManualClock()
    deadline = clock.now() + 1.0
    clock.advance(0.999)
    assert clock.now() < deadline
    clock.advance(0.001)
    assert clock.now() == deadline
    for _ in range(1000):
        clock.advance(0.001)
    assert clock.now() == 2.0


@pytest.mark.parametrize("bad", [-0.001, math.inf, math.nan])
def test_manual_clock_rejects_bad_advances(bad: float) -> None:
    clock = ManualClock()
    with pytest.raises(ValueError, match="seconds"):
        clock.advance(bad)


def test_manual_clock_never_goes_backwards() -> None:
    clock = ManualClock(5.0)
    with pytest.raises(ValueError, match="backwards"):
        clock.advance_to(4.0)
    clock.advance_to(5.0)  # standing still is fine
    with pytest.raises(ValueError):
        ManualClock(math.inf)
    with pytest.raises(ValueError):
        ManualClock(wall_ms=-1)


def test_both_clocks_satisfy_the_protocol() -> None:
    assert isinstance(ManualClock(), Clock)
    assert isinstance(SystemClock(), Clock)


async def test_advance_wakes_exactly_the_due_sleepers() -> None:
    clock = ManualClock()
    woken: list[float] = []

    async def sleeper(deadline: float) -> None:
        await clock.sleep_until(deadline)
        woken.append(deadline)

    async with anyio.create_task_group() as tg:
        for deadline in (3.0, 1.0, 2.0, 2.0):
            tg.start_soon(sleeper, deadline)
        await settle()
        assert clock.next_deadline() == 1.0
        clock.advance(0.999)
        await settle()
        assert woken == []
        clock.advance(0.001)
        await settle()
        assert woken == [1.0]
        clock.advance(1.5)
        await settle()
        assert woken == [1.0, 2.0, 2.0]
        assert clock.next_deadline() == 3.0
        clock.advance_to(3.0)
        await settle()
    assert woken == [1.0, 2.0, 2.0, 3.0]
    assert clock.next_deadline() is None


async def test_sleepers_resume_in_deadline_order_on_every_backend() -> None:
    clock = ManualClock()
    order: list[str] = []

    async def sleeper(name: str, deadline: float) -> None:
        await clock.sleep_until(deadline)
        order.append(name)

    async with anyio.create_task_group() as tg:
        # Started in an order unrelated to their deadlines (one at a time, so
        # that the tie b / b2 arrives in a known order).
        for name, deadline in [
            ("e", 5.0),
            ("a", 1.0),
            ("d", 4.0),
            ("b", 2.0),
            ("c", 3.0),
            ("b2", 2.0),
        ]:
            tg.start_soon(sleeper, name, deadline)
            await settle()
        clock.advance(10.0)  # all due at once
    assert order == ["a", "b", "b2", "c", "d", "e"]


async def test_a_cancelled_sleeper_is_forgotten() -> None:
    clock = ManualClock()
    with anyio.move_on_after(0):
        await clock.sleep_until(5.0)
    assert clock.next_deadline() is None
    assert "sleepers=0" in repr(clock)


async def test_a_past_deadline_returns_at_once_but_is_still_a_checkpoint() -> None:
    clock = ManualClock(3.0)
    await clock.sleep_until(1.0)
    with anyio.CancelScope() as scope:
        scope.cancel()
        await clock.sleep_until(1.0)
        pytest.fail("sleep_until did not checkpoint")  # pragma: no cover
    assert scope.cancelled_caught


async def test_system_clock_reads_the_event_loop_and_wall_time() -> None:
    import time

    clock = SystemClock()
    assert clock.now() == pytest.approx(anyio.current_time(), abs=0.05)
    assert abs(clock.time_ms() - time.time() * 1000) < 1000
    t0 = clock.now()
    await clock.sleep_until(t0 + 0.001)  # a millisecond of real time
    assert clock.now() >= t0 + 0.001
    await clock.sleep_until(t0 - 10)
