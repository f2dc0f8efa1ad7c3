"""The worker WebSocket's in-flight limit (transport/websocket.py): a semaphore without loop turns."""

from __future__ import annotations

import collections

from stepd.actors import Waiter

__all__ = ["Slots"]


class Slots:
    """A counting semaphore that takes a free slot without an event loop turn.

    anyio's `Semaphore.acquire` checkpoints even when a slot is free; this one
    waits (on a `Waiter`, in FIFO order) only when none is. Event loop thread only.
    """

    __slots__ = ("_free", "_waiting")

    def __init__(self, n: int) -> None:
        self._free = n
        self._waiting: collections.deque[Waiter] = collections.deque()

    async def acquire(self) -> None:
        if self._free > 0 and not self._waiting:
            self._free -= 1
            return
        waiter = Waiter()
        self._waiting.append(waiter)
        try:
            await waiter.wait()
        except BaseException:
            if waiter.is_set():
                self.release()  # handed a slot this caller will not use
            else:
                self._waiting.remove(waiter)
            raise

    def release(self) -> None:
        if self._waiting:
            self._waiting.popleft().set()  # the slot passes straight to the next in line
        else:
            self._free += 1

    def try_acquire(self) -> bool:
        """Take a free slot if there is one (nobody waiting ahead); never waits."""
        if self._free > 0 and not self._waiting:
            self._free -= 1
            return True
        return False
