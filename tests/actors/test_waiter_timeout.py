"""`Waiter.wait_at_most`: the bounded wait of a claim and a result long-poll, on both backends."""

from __future__ import annotations

import anyio
import anyio.lowlevel

from stepd.actors import Waiter


async def test_a_set_waiter_returns_at_once_and_a_later_set_wakes_it_early() -> None:
    done = Waiter()
    done.set()
    with anyio.fail_after(5):
        await done.wait_at_most(60)  # already set: no wait at all

    later = Waiter()

    async def set_soon() -> None:
        await anyio.lowlevel.checkpoint()
        later.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(set_soon)
        with anyio.fail_after(5):  # woken by the set, long before the 60 s bound
            await later.wait_at_most(60)
    assert later.is_set()


async def test_an_unset_waiter_gives_up_after_the_bound_and_stays_set() -> None:
    w = Waiter()
    with anyio.fail_after(5):
        await w.wait_at_most(0.01)
    assert w.is_set()  # the timeout set it: a second wait returns at once
    with anyio.fail_after(5):
        await w.wait_at_most(60)


async def test_a_cancel_while_waiting_propagates() -> None:
    w = Waiter()
    with anyio.move_on_after(0.01) as scope:
        await w.wait_at_most(60)
    assert scope.cancelled_caught
