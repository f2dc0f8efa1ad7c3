"""Shared test helpers: settling the event loop, and a recording actor.

`settle()` replaces real sleeps: it returns once every other task is blocked.
On trio that is `trio.testing.wait_all_tasks_blocked()`. On asyncio anyio's
`wait_all_tasks_blocked()` sleeps a *real* 0.1 s whenever a task is not blocked
yet, so here it is done with zero-length sleeps instead: settled means every
task waits on an unfinished future and no callback is ready to run (bounded,
so a test that never settles fails instead of hanging).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio

from stepd.actors import Actor, ActorSystem


async def settle() -> None:
    """Return once every other task in this event loop is blocked."""
    if anyio.get_cancelled_exc_class().__module__.startswith("trio"):
        import trio.testing

        await trio.testing.wait_all_tasks_blocked()
        return
    import asyncio

    this = asyncio.current_task()
    loop = asyncio.get_running_loop()
    for _ in range(10_000):
        await asyncio.sleep(0)
        # Callbacks waiting to run (a finished task's done-callbacks, future
        # wake-ups) mean the loop has not settled, even if every task waits.
        if getattr(loop, "_ready", None):
            continue
        for task in asyncio.all_tasks():
            if task is this or task.done():
                continue
            waiter = getattr(task, "_fut_waiter", None)
            if waiter is None or waiter.done():
                break
        else:
            return
    raise AssertionError("the event loop never settled: some task keeps running")


class Boom(Exception):
    """The crash the tests inject."""


class Rejected(Exception):
    """An expected rejection, listed in `reply_errors` by some test actors."""


@dataclass(frozen=True)
class Echo:
    value: Any


@dataclass(frozen=True)
class Block:
    """Handle this by waiting on the actor's gate (so the mailbox fills up)."""

    tag: str = ""


class Rec(Actor):
    """A recording actor: logs its lifecycle into a shared list.

    Messages: ``Echo(x)`` replies x; ``"crash"`` raises Boom; ``"stop"`` stops
    normally; ``"reject"`` raises Rejected; ``Block()`` waits on `gate`;
    ``("arm", key, delay, msg)`` arms a timer; ``("cancel", key)`` cancels one;
    anything else is logged as ``got <name> <message>``.
    """

    reply_errors = (Rejected,)

    def __init__(
        self,
        name: str,
        log: list[str],
        *,
        gate: anyio.Event | None = None,
        start_gate: anyio.Event | None = None,
        fail_start: bool = False,
        hang_on_stop: bool = False,
    ) -> None:
        self.name = name
        self.log = log
        self.gate = gate
        self.start_gate = start_gate
        self.fail_start = fail_start
        self.hang_on_stop = hang_on_stop

    async def on_start(self) -> None:
        self.log.append(f"start {self.name}")
        if self.start_gate is not None:
            await self.start_gate.wait()
        if self.fail_start:
            raise Boom(f"{self.name} cannot start")
        self.log.append(f"started {self.name}")

    async def receive(self, message: Any) -> Any:
        if isinstance(message, Echo):
            return message.value
        if isinstance(message, Block):
            assert self.gate is not None
            self.log.append(f"blocked {self.name} {message.tag}".rstrip())
            await self.gate.wait()
            return f"unblocked {message.tag}".rstrip()
        if message == "crash":
            raise Boom(self.name)
        if message == "stop":
            self.stop()
            return "stopping"
        if message == "reject":
            raise Rejected(self.name)
        if isinstance(message, tuple) and message and message[0] == "arm":
            _, key, delay, msg = message
            self.arm_timer(key, self.clock.now() + delay, msg)
            return None
        if isinstance(message, tuple) and message and message[0] == "cancel":
            return self.cancel_timer(message[1])
        self.log.append(f"got {self.name} {message}")
        return None

    async def on_stop(self, reason: BaseException | None) -> None:
        self.log.append(f"stop {self.name} {type(reason).__name__ if reason else 'normal'}")
        if self.hang_on_stop:
            await anyio.sleep_forever()


def rec(name: str, log: list[str], **kwargs: Any) -> Callable[[], Rec]:
    """Return a factory for `Rec` (what ChildSpec.start wants)."""
    return lambda: Rec(name, log, **kwargs)


def lines(log: list[str], prefix: str = "") -> list[str]:
    """Return the log lines starting with `prefix`."""
    return [line for line in log if line.startswith(prefix)]


def paths(system: ActorSystem) -> list[str]:
    """Return every path in the system's tree, depth first."""
    return [node.path for node in system.tree().walk()]
