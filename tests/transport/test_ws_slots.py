"""The WebSocket's in-flight limit (`transport._ws_slots.Slots`): order, hand-over, cancellation."""

from __future__ import annotations

import anyio
import pytest

from stepd.transport._ws_slots import Slots as _Slots

pytestmark = pytest.mark.anyio


async def test_a_free_slot_is_taken_without_waiting_and_the_rest_queue_in_order() -> None:
    slots = _Slots(1)
    await slots.acquire()  # free: no wait
    got: list[int] = []

    async def take(i: int) -> None:
        await slots.acquire()
        got.append(i)

    async with anyio.create_task_group() as tg:
        for i in range(3):
            tg.start_soon(take, i)
            await anyio.wait_all_tasks_blocked()
        assert got == []
        for expected in ([0], [0, 1], [0, 1, 2]):
            slots.release()
            await anyio.wait_all_tasks_blocked()
            assert got == expected


async def test_a_waiter_cancelled_as_it_is_handed_the_slot_does_not_lose_it() -> None:
    slots = _Slots(1)
    await slots.acquire()
    acquired: list[bool] = []

    async def wait_for_it() -> None:
        await slots.acquire()
        acquired.append(True)

    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg:
            tg.start_soon(wait_for_it)
            await anyio.wait_all_tasks_blocked()
            slots.release()  # handed to the waiter...
            scope.cancel()  # ...which is cancelled before it runs
    if acquired:  # trio does not interrupt a task already woken: it holds the slot
        slots.release()
    # Either way the slot is free again, exactly once.
    with anyio.fail_after(5):
        await slots.acquire()
    with anyio.move_on_after(0.05) as late:
        await slots.acquire()
    assert late.cancelled_caught


async def test_a_waiter_cancelled_while_waiting_leaves_the_queue() -> None:
    slots = _Slots(1)
    await slots.acquire()
    with anyio.move_on_after(0.01):
        await slots.acquire()
    slots.release()
    with anyio.fail_after(5):
        await slots.acquire()  # the cancelled waiter did not take it
