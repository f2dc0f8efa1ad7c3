"""The worker WebSocket's sending side (transport/websocket.py): one writer task, bounded.

Kept apart from the connection's reading side. Frames are encoded when
queued (msgpack bytes or JSON text) and counted in bytes as well as in
number; past ``max_queue_bytes`` the connection is closed with 1013. Under
`stepd serve` the writer sends every frame queued when it runs in one socket
write (`WebSocketProtocol.send_frames`); under another server, one ASGI
``websocket.send`` each.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Final

import anyio
import msgpack  # type: ignore[import-untyped]

from stepd.actors import Mailbox

from ._uvicorn_ws import WebSocketProtocol
from .protocol import encode_json

__all__ = ["CLOSE_TRY_AGAIN_LATER", "Close", "FrameWriter", "Send"]

log = logging.getLogger("stepd.transport.websocket")

CLOSE_TRY_AGAIN_LATER: Final = 1013

Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

_pack: Callable[[Any], bytes] = msgpack.Packer(use_bin_type=True).pack
"""One packer for every connection (they all run on the loop's thread): `msgpack.packb`
makes a packer per frame, a Python call and a 256 KiB buffer each time. It resets
itself after each frame, and after a frame it could not encode."""
_PACKER_KEEP: Final = 1 << 20
"""A packer whose buffer grew past this for a large frame is replaced, not kept."""


class Close:
    """The writer's last item: send a close frame and stop."""

    __slots__ = ("code", "reason")

    def __init__(self, code: int, reason: str) -> None:
        self.code = code
        self.reason = reason


class FrameWriter(abc.ABC):
    """The sending half of a worker connection (`WorkerConnection` is one).

    Subclasses say how to stop reading when the peer does not read
    (`_stop_reading`) and who the peer is (``worker_id``, for the logs).
    """

    worker_id: str | None

    def __init__(self, *, binary: bool, send: Send, wire: WebSocketProtocol | None,
                 max_queue: int, max_queue_bytes: int) -> None:
        self._binary = binary
        self._send = send
        self._wire = wire
        # Outgoing frames, for the one writer task. A Mailbox, not an anyio
        # memory stream: a send or receive with room (or an item) costs no
        # event loop turn, and a step passes three frames through here.
        self._out: Mailbox[tuple[bytes | str, int] | Close] = Mailbox(max_queue)
        # The bytes of the encoded frames queued or waiting for room (`_push`).
        self._out_bytes = 0
        self._max_out_bytes = max_queue_bytes
        self._overflowed = False
        self._write_scope = anyio.CancelScope()

    @abc.abstractmethod
    def _stop_reading(self) -> None:
        """Reading and the frames in flight end now (the peer does not read)."""

    @abc.abstractmethod
    def _gone(self) -> None:
        """The peer is gone: nothing more can be sent; everything stops."""

    async def _push(self, frame: dict[str, Any] | Close) -> bool:
        """Encode a frame and queue it for the writer (waits for room in the bounded queue).

        Returns False when the frame was not queued: the connection is ending,
        or the frame would take the bytes waiting to be sent past
        ``max_queue_bytes`` (the connection is then closed with 1013,
        `_overflow`). A frame larger than the bound on its own is sent when
        nothing else waits.
        """
        size = 0
        item: tuple[bytes | str, int] | Close
        if type(frame) is Close:  # no isinstance call: an answer a step
            item = frame
        else:
            message, size = self._encode(frame)  # type: ignore[arg-type]  # a dict
            if self._out_bytes and self._out_bytes + size > self._max_out_bytes:
                self._overflow()
                return False
            item = (message, size)
            self._out_bytes += size  # counted while it waits for room, too
        try:
            await self._out.put(item)
            return True
        except anyio.ClosedResourceError:
            self._out_bytes -= size
            return False  # the connection is ending: nobody is listening
        except BaseException:
            self._out_bytes -= size  # cancelled while waiting for room
            raise

    def _has_room(self) -> bool:
        """The writer's queue takes a frame now (`_push_now` will not be refused for room)."""
        out = self._out
        return out.depth() < out.size

    def _push_now(self, frame: dict[str, Any]) -> None:
        """`_push` when there is room (`_has_room`), from the protocol's callback."""
        message, size = self._encode(frame)
        if self._out_bytes and self._out_bytes + size > self._max_out_bytes:
            self._overflow()
            return
        try:
            self._out.send_nowait((message, size))
        except (anyio.WouldBlock, anyio.ClosedResourceError):
            return
        self._out_bytes += size

    def push_nowait(self, frame: dict[str, Any]) -> None:
        """Queue a frame without waiting; dropped (and logged) when the queue is full."""
        message, size = self._encode(frame)
        try:
            if self._out_bytes and self._out_bytes + size > self._max_out_bytes:
                raise anyio.WouldBlock
            self._out.send_nowait((message, size))
            self._out_bytes += size
        except anyio.WouldBlock:
            log.warning("worker %s is not reading its WebSocket: dropped %s", self.worker_id,
                        frame.get("op"))
        except anyio.ClosedResourceError:
            pass

    def _overflow(self) -> None:
        """The peer does not read what it asked for: drop what waits, close with 1013.

        Everything stops at once (reading, the handlers, the pusher); the
        writer drops the frames queued and sends the close frame. Leases that
        were queued and never sent expire after their TTL and are recovered,
        as for any connection that dies (PROTOCOL.md "Expiry and recovery").
        """
        if self._overflowed:
            return
        self._overflowed = True
        log.warning("worker %s does not read its WebSocket (over %d bytes waiting to be sent): "
                    "closed with %d", self.worker_id, self._max_out_bytes, CLOSE_TRY_AGAIN_LATER)
        self._out.close()  # later pushes are refused
        self._stop_reading()
        self._write_scope.cancel()

    def _encode(self, frame: dict[str, Any]) -> tuple[bytes | str, int]:
        if self._binary:
            global _pack
            data: bytes = _pack(frame)
            n = len(data)
            if n > _PACKER_KEEP:  # its buffer grew to fit: let it go
                _pack = msgpack.Packer(use_bin_type=True).pack
            return data, n
        text = encode_json(frame)
        return text.decode("utf-8"), len(text)

    async def _write_loop(self) -> None:
        out = self._out
        try:
            with self._write_scope:  # cancelled by `_overflow`
                if self._wire is not None:
                    await self._write_wire(self._wire)
                    return
                while True:
                    item = await out.receive()  # no loop turn when a frame is there
                    if isinstance(item, Close):
                        await self._send({"type": "websocket.close", "code": item.code,
                                          "reason": item.reason})
                        return
                    data = item[0]
                    await self._send({"type": "websocket.send", "bytes": data}
                                     if type(data) is bytes else
                                     {"type": "websocket.send", "text": data})
                    self._out_bytes -= item[1]
            if self._overflowed:
                await self._send({"type": "websocket.close", "code": CLOSE_TRY_AGAIN_LATER,
                                  "reason": "too many frames not read"})
        except OSError:  # uvicorn's ClientDisconnected: the peer is gone
            self._gone()
        except anyio.EndOfStream:
            pass
        finally:
            out.close()  # nobody writes any more: later pushes are refused, not lost unseen
            while True:  # what is left is dropped now, not when the connection is freed
                try:
                    out.receive_nowait()
                except (anyio.WouldBlock, anyio.EndOfStream):
                    break
            self._out_bytes = 0

    async def _write_wire(self, wire: WebSocketProtocol) -> None:
        """The writer under `stepd serve`: every frame queued when it runs, in one socket write.

        The answers of the frames that arrived together are queued in the same
        loop iteration (their commit resolves them at once), so they leave together.
        """
        out = self._out
        writable = wire.writable
        while True:
            item = await out.receive()
            close = item if type(item) is Close else None
            batch: list[bytes | str] = []
            size = 0
            while close is None:
                batch.append(item[0])  # type: ignore[index]  # not a Close (`close` says so)
                size += item[1]  # type: ignore[index]
                try:
                    item = out.receive_nowait()
                except (anyio.WouldBlock, anyio.EndOfStream):
                    break
                if type(item) is Close:
                    close = item
            if batch:
                if not writable.is_set():
                    await writable.wait()  # the transport's buffer is full: the peer reads slowly
                wire.send_frames(batch)
                self._out_bytes -= size
            if close is not None:
                await self._send({"type": "websocket.close", "code": close.code,
                                  "reason": close.reason})
                return
