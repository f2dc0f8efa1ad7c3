"""The embedded daemon (`stepd.embedded`): the worker's in-process channel and the
clients' in-process backends. No sockets.

* `InProcessChannel` (the worker): calls go through
  `stepd.transport.inprocess.InProcess` (the daemon's protocol handler: the same
  validation and errors as HTTP, values copied); the worker's session actor pushes
  leases and cancels into the channel (its outbox), with the same credit protocol
  as the WebSocket (`stepd.channels.Credit`).
* `SyncEmbedded` / `AsyncEmbedded` (`stepd.Client` / `stepd.AsyncClient`): each
  call is an `InProcess` method, run on the daemon's loop.

Everything this module asks of the daemon is in `_Daemon`, the one place to
rewire when the daemon's API changes.
"""

from __future__ import annotations

from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, Final

from stepd import _wire
from stepd._errors import NotFound, translate
from stepd.actors import Waiter
from stepd.channels import Channel, Credit, Host, Lost

if TYPE_CHECKING:
    from stepd.embedded import Embedded

_LEASE_CALLS: Final = frozenset({"started", "heartbeat", "complete", "fail"})

__all__ = ["AsyncEmbedded", "InProcessChannel", "SyncEmbedded"]


# --------------------------------------------------------------------------- the daemon's side


class _Daemon:
    """What the SDK's in-process transport asks of the embedded daemon: its `InProcess`
    handler, and for a worker an attachment to its session actor.

    DAEMON-FACING: these calls are the daemon's API as of this writing
    (``daemon.inprocess``, ``Daemon.attach`` and its `Connection`'s ``grant`` and
    ``detach``, the session's `Outbox` protocol, ``copy_out``); rewire them here
    when it changes.
    """

    __slots__ = ("daemon",)

    def __init__(self, daemon: Embedded) -> None:
        self.daemon = daemon

    async def call(self, op: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """One `InProcess` operation (``register``, ``started``, ``complete``...)."""
        return await getattr(self.daemon.inprocess, op)(*args, **kwargs)  # type: ignore[no-any-return]

    def lease_call(self, op: str, lease_id: str,
                   body: dict[str, Any]) -> Coroutine[Any, Any, dict[str, Any]]:
        """``started``, ``heartbeat``, ``complete`` or ``fail`` (`InProcess.lease_call`):
        its coroutine, awaited by the caller (one frame less per step)."""
        return self.daemon.inprocess.lease_call(op, lease_id, body)

    async def attach(self, worker_id: str, outbox: Any) -> Any:
        """Attach `outbox` (lease/cancel/close) to the worker's session actor."""
        return await self.daemon.daemon.attach(worker_id, outbox)

    @staticmethod
    def grant(connection: Any, n: int) -> None:
        while n > 0:  # the daemon takes at most 10,000 at once
            step = min(n, 10_000)
            connection.grant(step)
            n -= step

    @staticmethod
    def detach(connection: Any) -> None:
        connection.detach()

    @staticmethod
    def copy(lease: dict[str, Any]) -> dict[str, Any]:
        """The worker's own copy of a pushed lease (the daemon's dict is never shared)."""
        from stepd.transport._json import copy_out

        return copy_out(lease)  # type: ignore[no-any-return]

    @staticmethod
    def daemon_error() -> type[BaseException]:
        from stepd.sansio.errors import StepdError

        return StepdError


# --------------------------------------------------------------------------- the worker


class InProcessChannel(Channel):
    """The embedded daemon: `InProcess` calls, and the worker's session actor pushing
    leases and cancels straight into the worker (this channel is its outbox)."""

    kind = "inprocess"

    def __init__(self, daemon: Embedded) -> None:
        self.daemon = _Daemon(daemon)
        self._connection: Any = None
        self._host: Host | None = None
        self._credit: Credit | None = None
        self._lost: str | None = None
        self._ended = False
        self._done = Waiter()

    async def _invoke(self, op: str, *args: Any) -> dict[str, Any]:
        try:
            return await self.daemon.call(op, *args)
        except self.daemon.daemon_error() as exc:
            raise translate(exc) from None
        except RuntimeError as exc:  # the daemon closed under us
            raise Lost(str(exc)) from None

    async def register(self, body: dict[str, Any]) -> dict[str, Any]:
        return await self._invoke("register", body)

    async def call(self, op: str, lease_id: str, body: dict[str, Any]) -> dict[str, Any]:
        if op not in _LEASE_CALLS:
            return await self._invoke(op, lease_id, body)
        try:  # `_invoke`, written out: once per step
            return await self.daemon.lease_call(op, lease_id, body)
        except self.daemon.daemon_error() as exc:
            raise translate(exc) from None
        except RuntimeError as exc:  # the daemon closed under us
            raise Lost(str(exc)) from None

    async def session_call(self, op: str, session_id: str, body: dict[str, Any]) -> dict[str, Any]:
        return await self._invoke(op, session_id, body)

    async def pump(self, host: Host, max_request_ms: int) -> None:
        daemon = self.daemon
        assert host.worker_id is not None
        self._host = host
        self._credit = Credit(host.concurrency)
        try:
            self._connection = await daemon.attach(host.worker_id, self)
        except NotFound as exc:
            raise Lost(str(exc)) from None
        except daemon.daemon_error() as exc:  # the sessions supervisor is restarting
            raise Lost(str(exc)) from None
        try:
            if host.stopping:
                self.stop_taking()
            else:
                self.slots_changed()
            await self._done.wait()
        finally:
            self.stop_taking()
        if self._lost is not None and not self._ended:
            raise Lost(self._lost)

    # -- the session's outbox (`stepd.actors.daemon.session.Outbox`) ---------------------

    def lease(self, lease: dict[str, Any]) -> bool:
        """A lease for this worker: it took one credit; a runner takes it now."""
        host, credit = self._host, self._credit
        if self._connection is None or host is None or credit is None:
            return False
        credit.used()
        host.accept(self.daemon.copy(lease))
        return True

    def cancel(self, lease_id: str, reason: str) -> None:
        if self._host is not None:
            self._host.on_cancel(lease_id, reason)

    def close(self, reason: str) -> None:
        """The session gave this attachment up (it restarted): the worker attaches again."""
        self._connection = None
        self._lost = reason
        self._done.set()

    # -- credit -------------------------------------------------------------------------

    def slots_changed(self) -> None:
        credit, connection = self._credit, self._connection
        if credit is None or connection is None:
            return
        n = credit.due(self._host)  # type: ignore[arg-type]
        if n:
            try:
                self.daemon.grant(connection, n)
            except self.daemon.daemon_error():
                credit.outstanding = max(0, credit.outstanding - n)

    def stop_taking(self) -> None:
        # Detaching hands the session's unoffered slots back to the queue.
        connection, self._connection = self._connection, None
        if connection is not None:
            self.daemon.detach(connection)

    def end(self) -> None:
        self._ended = True
        self._done.set()


async def direct_fail(daemon: Embedded, lease_id: str, body: dict[str, Any]) -> None:
    """``fail`` outside any channel (the worker is being cancelled)."""
    await InProcessChannel(daemon).call("fail", lease_id, body)


# --------------------------------------------------------------------------- the clients


class SyncEmbedded:
    """`stepd.Client`'s backend for an embedded daemon (from any thread but its loop's)."""

    def __init__(self, daemon: Embedded) -> None:
        self.daemon = daemon
        self._calls = _Daemon(daemon)

    def send(self, call: _wire.Call) -> dict[str, Any]:
        args, kwargs = call.inproc_args()
        calls = self._calls

        async def invoke() -> dict[str, Any]:
            return await calls.call(call.op, *args, **kwargs)

        return self.daemon.call_blocking(invoke)

    def close(self) -> None:
        pass


class AsyncEmbedded:
    """`stepd.AsyncClient`'s backend for an embedded daemon (from any loop)."""

    def __init__(self, daemon: Embedded) -> None:
        self.daemon = daemon
        self._calls = _Daemon(daemon)

    async def send(self, call: _wire.Call) -> dict[str, Any]:
        args, kwargs = call.inproc_args()
        calls = self._calls

        async def invoke() -> dict[str, Any]:
            return await calls.call(call.op, *args, **kwargs)

        return await self.daemon.call_async(invoke)

    async def aclose(self) -> None:
        pass
