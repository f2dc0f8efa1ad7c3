"""The worker WebSocket's lease calls in flight (transport/websocket.py): what a connection
holds while it answers its worker's calls on leases.

A connection answers its worker's lease and session calls (``started``,
``heartbeat``, ``complete``, ``fail``, ``history``, ``session_renew``,
``session_close``) concurrently, at most ``max_in_flight`` at once, so that a
slow ``complete`` does not hold up the heartbeats of other leases; the frames
of one lease are applied in the order they arrived (`FrameOrder`). They are
answered by a pool of handler tasks that park when idle (started as load needs
them, never more than ``max_in_flight``), not by a task each: an anyio task
spawn (a task, a cancel scope, an event) per frame was two per step.

Kept apart from the connection's reading and lifecycle (`websocket.py`) and
its sending side (`_ws_writer.py`): this layer holds the pool, the order, the
in-flight bound, and the leases its session offers while a call is handled in
the same task (queued only after that call's answer, `_HELD`).
"""

from __future__ import annotations

import asyncio
import collections
from contextvars import ContextVar
from typing import Any, Final

import anyio

from stepd.actors import Waiter
from stepd.sansio.errors import Invalid
from stepd.sansio.session import FrameOrder

from ._uvicorn import WebSocketProtocol
from ._ws_frames import answer_frame
from ._ws_slots import Slots
from ._ws_writer import FrameWriter, Send
from .auth import Principal
from .operations import LEASE_CALLS
from .protocol import Operation, Protocol, error_reply

__all__ = ["LEASE_OPS", "LeaseCalls"]

LEASE_OPS: Final = {
    "started": Operation.STARTED,
    "heartbeat": Operation.HEARTBEAT,
    "complete": Operation.COMPLETE,
    "fail": Operation.FAIL,
    "history": Operation.HISTORY,
    "session_renew": Operation.SESSION_RENEW, "session_close": Operation.SESSION_CLOSE,
}
"""The frames answered by the pool, by their ``op``."""
_TARGET_KEYS: Final = {
    op: (("session_id", "lease_id") if op.text.startswith("session_") else ("lease_id", "session_id"))
    for op in LEASE_OPS.values()}
"""Per call: the envelope key naming its target, and the other one (both left out of its body)."""
_MAX_LEASE_ID: Final = 64  # `stepd.transport._validate.is_lease_id`

# Leases this connection's session offers while one of its calls is handled in the
# same task are queued only after that call's answer. The next step is offered
# inside the run's turn, i.e. inside the `complete` call of the step before it
# (docs/architecture.md "A step over the WebSocket"). Without this, the worker
# would read the next `lease` before the `ok` of its `complete`; PROTOCOL.md
# promises no order, but every worker written before the in-turn offer saw the
# answer first, and a simple client that reads its answer as the next frame would
# break. A context variable (a task's own) holds the call's list: the connection at
# index 0 (None once the call is over, so a task that copied the context during
# the call holds nothing after it), then the leases held. A list, not an object:
# no constructor call per frame.
_HELD: ContextVar[list[Any] | None] = ContextVar("stepd_ws_held", default=None)

_running_loop = asyncio._get_running_loop  # None under trio, without raising
_InvalidStateError = asyncio.InvalidStateError


class LeaseCalls(FrameWriter):
    """The calls in flight of a worker connection (`WorkerConnection` is one).

    The connection sets ``protocol``, ``principal`` and ``worker_id``, opens
    the task group the pool's handlers run in (``_handlers``), hands each
    call frame over with `_start_call` once it holds an in-flight slot
    (``_limit``), and ends the pool with `_close_pool` once reading is over.
    """

    protocol: Protocol
    principal: Principal

    def __init__(self, *, max_in_flight: int, binary: bool, send: Send,
                 wire: WebSocketProtocol | None, max_queue: int, max_queue_bytes: int) -> None:
        super().__init__(binary=binary, send=send, wire=wire, max_queue=max_queue,
                         max_queue_bytes=max_queue_bytes)
        self._limit = Slots(max_in_flight)
        # Frames of one lease are applied in arrival order (the session machine's
        # FrameOrder numbers them); the waits are here: a Waiter per frame in flight.
        self._order = FrameOrder()
        # Only frames a later frame of their lease waits for have one (made by that frame).
        self._in_flight: dict[int, Waiter] = {}
        self._handlers: anyio.abc.TaskGroup | None = None
        # The pool: `_limit` bounds the frames in flight; the pool ends once
        # reading has (`_close_pool`).
        self._calls: collections.deque[tuple[Any, ...]] = collections.deque()
        # Parked handlers: on asyncio each waits on a bare future of the loop (a
        # `Waiter` is three Python calls more per park and wake, once a step); on
        # trio on a `Waiter`.
        self._parked: list[Any] = []
        self._pool_size = 0
        self._pool_closing = False
        self._peer_gone = False

    def _start_call(self, frame_id: int, frame: dict[str, Any]) -> None:
        """Hand a lease frame (its in-flight slot taken) to the handler pool."""
        assert self._handlers is not None
        # Frames of one lease are applied in the order they arrived, so a worker
        # may send `complete` right behind `started` without waiting for its answer.
        # Only ids as short as a lease id are tracked: a longer one names no
        # lease (answered 404) and is not kept while its answer waits for room.
        lease_id = frame["lease_id"] if "lease_id" in frame else None  # noqa: SIM401 - no call
        key = lease_id if type(lease_id) is str and len(lease_id) <= _MAX_LEASE_ID else None
        ticket, after = self._order.arrive(key)
        before = None
        if after is not None:  # `after` is still in flight: it sets this when it is done
            before = self._in_flight.get(after)
            if before is None:
                before = self._in_flight[after] = Waiter()
        self._calls.append((frame_id, LEASE_OPS[frame["op"]], frame, before, key, ticket))
        parked = self._parked
        while parked:
            waiter = parked.pop()
            if type(waiter) is Waiter:
                waiter.set()
                return
            try:
                waiter.set_result(None)
                return
            except _InvalidStateError:  # its handler was cancelled: it is leaving
                continue
        # Every handler is busy (fewer than max_in_flight: `_limit` holds the rest).
        self._pool_size += 1
        self._handlers.start_soon(self._handler_loop)

    async def _handler_loop(self) -> None:
        """One handler of the pool: answer queued lease frames; park when there are none.

        A frame waits only for frames of its lease queued before it, which
        other handlers took first (FIFO), so the pool cannot deadlock.
        """
        calls = self._calls
        parked = self._parked
        loop = _running_loop()
        try:
            while True:
                if calls:
                    await self._lease_call(*calls.popleft())
                    continue
                if self._pool_closing:
                    return
                waiter: Any = Waiter() if loop is None else loop.create_future()
                parked.append(waiter)
                try:
                    await (waiter.wait() if loop is None else waiter)
                finally:
                    if waiter in parked:  # cancelled while parked: not woken
                        parked.remove(waiter)
        finally:
            self._pool_size -= 1

    def _close_pool(self) -> None:
        """Reading is over: handlers finish the queued frames, then end."""
        self._pool_closing = True
        parked = self._parked  # emptied in place: each handler holds this list
        for waiter in parked:
            if type(waiter) is Waiter:
                waiter.set()
            elif not waiter.done():
                waiter.set_result(None)
        parked.clear()

    async def _lease_call(self, frame_id: int, op: Operation, frame: dict[str, Any] | None,
                          before: Waiter | None, key: str | None, ticket: int) -> None:
        assert frame is not None
        protocol = self.protocol
        try:
            if before is not None:
                await before.wait()  # the lease's previous frame is applied first
            protocol.call_begins()  # counted for the drain; abort() cancels the whole connection
            held: list[Any] = [self]  # `_HELD`
            token = _HELD.set(held)
            try:
                # docs/affinity.md: session calls name their session, lease calls their lease.
                name, other = _TARGET_KEYS[op]
                target = frame[name] if name in frame else None  # noqa: SIM401 - no call
                if type(target) is str:
                    # The frame minus its envelope is the body: the decoded frame is this
                    # call's own, so it is trimmed in place (no copy, no comprehension).
                    body: dict[str, Any] | None = frame
                    del frame["op"], frame["id"], frame[name]
                    if other in frame:
                        del frame[other]
                    frame = None  # not kept while the answer waits for room in the queue
                    # The connection's worker: another worker's lease is unknown here.
                    if op in LEASE_CALLS:  # a lease call: `handle` in one frame
                        reply = await protocol.handle_lease(op, target, body,
                                                            self.worker_id or "")
                    else:
                        reply = await protocol.handle(op, self.principal, target=target,
                                                      body=body, worker_id=self.worker_id or "")
                    body = None
                else:
                    frame = None
                    reply = error_reply(Invalid(f"must be the {name[:-3]} id (a string)",
                                                field=name))
                await self._push(answer_frame(frame_id, reply))
            finally:
                protocol.call_ends()
                held[0] = None  # over: a task that copied the context holds nothing more
                _HELD.reset(token)
                for lease in held[1:]:  # after the answer: see `_HELD`
                    self._queue_lease(lease)
        finally:
            in_flight = self._in_flight
            if ticket in in_flight:  # a later frame of this lease waits for this one
                waiter = in_flight[ticket]
                del in_flight[ticket]
                waiter.set()
            self._order.done(key, ticket)
            self._limit.release()

    # -- the session's outbox (`stepd.actors.daemon.session.Outbox`): leases ---------

    def lease(self, lease: dict[str, Any]) -> bool:
        """Queue a lease (its credit bounds how many wait); False when the connection ends."""
        held = _HELD.get()
        if held is not None and held[0] is self:
            held.append(lease)
            return True
        return self._queue_lease(lease)

    def _queue_lease(self, lease: dict[str, Any]) -> bool:
        if self._pool_closing or self._peer_gone:
            return False
        message, size = self._encode({"op": "lease", "lease": lease})
        if self._out_bytes and self._out_bytes + size > self._max_out_bytes:
            self._overflow()
            return False
        try:
            self._out.send_beyond((message, size))
        except anyio.ClosedResourceError:
            return False
        self._out_bytes += size
        return True
