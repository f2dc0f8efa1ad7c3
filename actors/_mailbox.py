"""What travels through a mailbox besides plain told messages.

A mailbox is a bounded anyio memory object stream (`Mailbox`). A *tell* puts
the message itself in it: no envelope. An *ask* puts an `Ask`, which is both
the envelope and the one-shot reply slot: the caller waits on it, the actor
fills it. That makes an ask one mailbox send plus one reply wake-up, with one
small object and one anyio Event allocated per ask, and no task or cancel
scope unless the caller gave a timeout.

`WAKE` is a private token the runtime drops into a mailbox (non-blocking, at
most one at a time) to wake an idle actor when something arrives on its
*system queue* (a fired timer, a child's exit, a stop request), which is
served before the mailbox.
"""

from __future__ import annotations

from typing import Any, Final

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

__all__ = ["WAKE", "Ask", "Mailbox"]


class _Wake:
    __slots__ = ()

    def __repr__(self) -> str:
        return "<WAKE>"


WAKE: Final = _Wake()


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
        self._event: anyio.Event | None = None

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
            event = self._event = anyio.Event()
            await event.wait()
        if self._error is not None:
            error, self._error = self._error, None
            try:
                raise error
            finally:
                del error
        return self._value


class Mailbox:
    """The two ends of one incarnation's bounded memory object stream."""

    __slots__ = ("rx", "size", "tx")

    def __init__(self, size: int) -> None:
        self.size = size
        self.tx: MemoryObjectSendStream[object]
        self.rx: MemoryObjectReceiveStream[object]
        self.tx, self.rx = anyio.create_memory_object_stream[object](size)

    def depth(self) -> int:
        """Return how many items wait in the buffer (including a WAKE token)."""
        return self.rx.statistics().current_buffer_used

    def close(self) -> None:
        self.rx.close()
        self.tx.close()
