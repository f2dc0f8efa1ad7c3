"""The worker's ways to reach a daemon, one module per transport (mirroring ``transport/``).

A channel is one registered connection. It registers the worker, carries its
calls on leases (``started``, ``heartbeat``, ``complete``, ``fail``) and
delivers leases to it (`Channel.pump`) until the connection ends or the worker
ends it (`Channel.end`). The worker (`stepd.worker`) owns everything that
outlives a connection: the leases, their bodies, the slots; a reconnect is a
new channel registered with the same ``worker_id``.

* `stepd.channels.websocket.WebSocketChannel`: PROTOCOL.md "WebSocket
  transport", msgpack frames; leases and ``cancel`` pushes arrive as frames,
  credit = free slots. On asyncio, for plain ``ws://`` without a proxy, the
  lean client of `stepd.channels._wsproto` (an asyncio protocol: frames are
  parsed and dispatched in ``data_received``, sent with one ``write``);
  otherwise (trio, ``wss://``, a proxy) the ``websockets`` library.
* `stepd.channels.http.HttpChannel`: ``POST /v1/api/steps/claim`` long-polls
  for the free slots; calls are plain requests. Also the clients' HTTP backends.
* `stepd.channels.inprocess.InProcessChannel`: the embedded daemon. Also the
  clients' in-process backends.

This module holds what they share: the errors a call raises besides the typed
answers (`Lost`, `Refused`, `Unencodable`), what a channel needs of the worker
(`Host`), the channel's interface and the credit arithmetic.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any, ClassVar, Protocol

from stepd._errors import error_from_answer

__all__ = ["Channel", "Credit", "Host", "Lost", "Refused", "Unencodable", "frame_error"]

Deliver = Callable[[dict[str, Any] | None], Any]
"""Called with a request's answer frame, or None when the connection ended first."""


class Lost(Exception):
    """The connection ended before the answer came (or never opened)."""


class Refused(Exception):
    """The daemon (or something in between) refused the WebSocket: use HTTP instead."""


class Unencodable(Exception):
    """A call's body is not JSON (the body's output or state patch)."""


class Host(Protocol):
    """What a channel needs of the worker."""

    concurrency: int
    worker_id: str | None

    @property
    def running(self) -> int: ...

    @property
    def stopping(self) -> bool: ...

    def accept(self, lease: dict[str, Any]) -> None: ...

    def on_cancel(self, lease_id: str, reason: str) -> None: ...


class Channel(abc.ABC):
    """One registered connection to the daemon."""

    kind: ClassVar[str]
    ordered: ClassVar[bool] = False
    """The daemon applies this channel's calls of one lease in the order they were sent
    (one WebSocket: frames arrive in order, and the daemon applies a lease's frames in
    arrival order). Then `complete` may be sent right behind `started`, unanswered,
    and `send_soon` is available."""
    answers_leases: bool = False
    """A ``complete`` on this channel asks for the worker's next lease in its answer
    (``claim_next``, docs/leases.md "The next lease in the answer"; set once the
    daemon's register answer says it takes it): the runner that reports takes it
    (`stepd._bodies.REPORTING`)."""

    @abc.abstractmethod
    async def register(self, body: dict[str, Any]) -> dict[str, Any]: ...

    @abc.abstractmethod
    async def call(self, op: str, lease_id: str, body: dict[str, Any]) -> dict[str, Any]:
        """One lease call; its answer (raises the typed refusal, `Lost`, `Unencodable`)."""

    async def session_call(self, op: str, session_id: str, body: dict[str, Any]) -> dict[str, Any]:
        """A worker-session call (``session_renew``, ``session_close``; docs/affinity.md)."""
        raise Lost(f"{self.kind} carries no session calls")

    def send_soon(self, op: str, lease_id: str, body: dict[str, Any], deliver: Deliver) -> None:
        """Send a lease call now (ordered channels); ``deliver(frame)`` gets its answer frame
        later, or None if the connection ends first.

        Raises:
            Lost: not connected. Unencodable: the body is not JSON.
        """
        raise Lost(f"{self.kind} sends nothing ahead")

    @abc.abstractmethod
    async def pump(self, host: Host, max_request_ms: int) -> None:
        """Deliver leases to ``host`` until `end` (returns) or the connection ends (`Lost`)."""

    def slots_changed(self) -> None:
        """A lease ended or the worker started stopping: grant credit, claim, or nothing."""

    def stop_taking(self) -> None:
        """The worker stops: take no more leases (what can be revoked is revoked)."""

    def end(self) -> None:
        """The worker has finished: `pump` returns."""


class Credit:
    """Credit = free slots, granted in batches (WebSocket and in-process push).

    ``concurrency - running - outstanding`` is granted once a quarter of the slots
    (at least one) are free and unoffered, or at once when the daemon holds none
    of it (so a lease never waits while a slot is free). A credit frame per
    finished lease would cost a frame each way per step, on the step's critical path.
    """

    __slots__ = ("batch", "outstanding")

    def __init__(self, concurrency: int) -> None:
        self.batch = max(1, concurrency // 4)
        self.outstanding = 0

    def due(self, host: Host) -> int:
        """How much to grant now (0: nothing); counted as outstanding."""
        if host.stopping:
            return 0
        outstanding = self.outstanding
        n = host.concurrency - host.running - outstanding
        if n > 0 and (n >= self.batch or outstanding == 0):
            self.outstanding = outstanding + n
            return n
        return 0

    def used(self) -> None:
        """A lease arrived: it took one credit."""
        if self.outstanding > 0:
            self.outstanding -= 1


def frame_error(frame: dict[str, Any]) -> BaseException:
    """The typed error an answer frame other than ``ok``/``registered`` stands for."""
    op = frame.get("op")
    body = {k: v for k, v in frame.items() if k not in ("op", "id")}
    if op == "conflict":
        return error_from_answer(409, body)
    if op == "error":
        status = body.get("status")
        return error_from_answer(status if isinstance(status, int) else 500, body)
    return Lost(f"unexpected answer frame {op!r}")
