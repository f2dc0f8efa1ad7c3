"""What travels through a mailbox besides plain told messages.

A *tell* puts the message itself in an actor's mailbox: no envelope. An ask
that cannot run inline (the actor is busy or has messages queued, or the ask
has a timeout) puts an `Ask`, which is both the envelope and the one-shot
reply slot: the caller waits on it, the actor fills it. That makes such an ask
one mailbox send plus one reply wake-up, with one small object and one
`Waiter`, and no task or cancel scope unless the caller gave a timeout.

A `Mailbox` is a bounded queue with the calls of an anyio memory object
stream pair (`send`/`send_nowait`, `receive`/`receive_nowait`, `close`),
built on a deque and the backend's own wake-up (`Waiter`); anyio's streams
cost several times more per message.

The actor runtime keeps each incarnation's mailbox in the `Runtime` itself
(a deque, its bound, and the waiters of blocked senders: no object of its
own, one method call less per message); `Mailbox` is the same discipline as a
standalone object, exported for other hand-offs on one event loop (the
WebSocket transport's outgoing frames, the engine's push sessions).
"""

from __future__ import annotations

from collections import deque
from typing import Any, Generic, TypeVar

import anyio
import anyio.lowlevel

from ._waiter import Waiter

__all__ = ["Ask", "Mailbox"]


class Ask:
    """One request and its reply slot.

    States: pending, then exactly one of value / error. `set_value` and
    `set_error` after the first are ignored (an actor's cleanup may try to
    fail an ask whose reply was already sent). If the caller stopped waiting
    (timeout or cancellation), the reply is simply dropped.
    """

    __slots__ = ("_done", "_error", "_event", "_value", "message")

    def __init__(self, message: object) -> None:
        self.message = message
        self._done = False
        self._value: Any = None
        self._error: BaseException | None = None
        self._event: Waiter | None = None

    @property
    def done(self) -> bool:
        return self._done

    def set_value(self, value: object) -> None:
        if self._done:
            return
        self._value = value
        self._done = True
        if self._event is not None:
            self._event.set()

    def set_error(self, error: BaseException) -> None:
        if self._done:
            return
        self._error = error
        self._done = True
        if self._event is not None:
            self._event.set()

    async def wait(self) -> Any:
        """Wait for the reply and return it (or raise the error it carries)."""
        if not self._done:
            event = self._event = Waiter()
            await event.wait()
        if self._error is not None:
            error, self._error = self._error, None
            try:
                raise error
            finally:
                del error
        return self._value


T = TypeVar("T")


class Mailbox(Generic[T]):
    """One incarnation's bounded queue, with the calls of a memory stream's two ends.

    Sends beyond `size` wait (`send`) or raise `anyio.WouldBlock`
    (`send_nowait`); after `close()`, sends raise `anyio.ClosedResourceError`
    and receives drain what is left, then raise `anyio.EndOfStream`.
    """

    # No separate send/receive end objects: ends holding the box's bound
    # methods would make every mailbox a reference cycle, left for the cyclic
    # GC, and an actor per lease attempt makes that garbage by the thousand.
    __slots__ = ("_closed", "_items", "_receiver", "_senders", "size")

    def __init__(self, size: int) -> None:
        self.size = size
        self._items: deque[T] = deque()
        self._receiver: Waiter | None = None  # the actor loop, parked on an empty box
        self._senders: deque[Waiter] = deque()  # tells parked on a full box
        self._closed = False

    def depth(self) -> int:
        """Return how many items wait in the buffer (including a WAKE token)."""
        return len(self._items)

    def close(self) -> None:
        self._closed = True
        receiver, self._receiver = self._receiver, None
        if receiver is not None:
            receiver.set()
        while self._senders:
            self._senders.popleft().set()

    # -- the two ends -----------------------------------------------------

    def send_nowait(self, item: T) -> None:
        if self._closed:
            raise anyio.ClosedResourceError
        if len(self._items) >= self.size:
            raise anyio.WouldBlock
        self._items.append(item)
        receiver = self._receiver
        if receiver is not None:
            self._receiver = None
            receiver.set()

    def send_beyond(self, item: T) -> None:
        """`send_nowait` past the size bound: for items bounded elsewhere (a WebSocket's
        leases, which its credit bounds), that must not wait behind others.

        Raises:
            ClosedResourceError: the mailbox is closed.
        """
        if self._closed:
            raise anyio.ClosedResourceError
        self._items.append(item)
        receiver = self._receiver
        if receiver is not None:
            self._receiver = None
            receiver.set()

    async def send(self, item: T) -> None:
        await anyio.lowlevel.checkpoint_if_cancelled()
        while True:
            try:
                self.send_nowait(item)
            except anyio.WouldBlock:
                waiter = Waiter()
                self._senders.append(waiter)
                try:
                    await waiter.wait()
                finally:
                    if not waiter.is_set():
                        self._senders.remove(waiter)
                continue
            await anyio.lowlevel.cancel_shielded_checkpoint()
            return

    async def put(self, item: T) -> None:
        """`send_nowait` when there is room, else wait for room like `send`.

        No checkpoint when there is room (`send` always takes one): for a
        caller that waits right after anyway (an ask blocks on its reply) or
        that is never the receiver itself (a transport's writer queue).
        """
        if self._closed:
            raise anyio.ClosedResourceError
        items = self._items
        if len(items) >= self.size:
            await self.send(item)  # waits for room
            return
        items.append(item)  # `send_nowait()`, inlined: a writer queue's every frame
        receiver = self._receiver
        if receiver is not None:
            self._receiver = None
            receiver.set()

    def receive_nowait(self) -> T:
        items = self._items
        if items:
            item = items.popleft()
            if self._senders:
                self._senders.popleft().set()
            return item
        if self._closed:
            raise anyio.EndOfStream
        raise anyio.WouldBlock

    async def receive(self) -> T:
        items = self._items
        while True:
            if items:  # `receive_nowait()`, inlined: one call per item received
                item = items.popleft()
                if self._senders:
                    self._senders.popleft().set()
                return item
            if self._closed:
                raise anyio.EndOfStream
            waiter = self._receiver = Waiter()
            try:
                await waiter.wait()
            finally:
                if self._receiver is waiter:
                    self._receiver = None
