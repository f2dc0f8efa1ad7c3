"""The worker's connections (mixed into `stepd.Worker`): connect, register, pump, reconnect.

One connection at a time (`stepd.channels`): the WebSocket by default, HTTP
long-poll when the WebSocket is refused (or asked for), the in-process channel
for an embedded daemon. A lost connection is replaced with bounded, jittered
backoff, registering again with the worker's ``worker_id`` so its leases stay
its own; a daemon that no longer knows the id gets a fresh registration.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import anyio

from stepd._bodies import Definition
from stepd._calls import backoff
from stepd._errors import NotFound, StepdError, Unavailable
from stepd._loop import on_trio
from stepd._manifest import capability_declaration
from stepd.actors import Waiter
from stepd.channels import Channel, Lost, Refused

if TYPE_CHECKING:
    import threading

    import httpx

    from stepd._http1 import Http1Client
    from stepd.embedded import Embedded

log = logging.getLogger("stepd.worker")

class Connections:
    """The connection loop; it reads the worker's state below."""

    name: str
    url: str | None
    key: str | None
    timeout: float
    concurrency: int
    build_id: str | None
    worker_id: str | None
    protocol_version: str
    local_steps: bool
    transport_choice: str
    stopping: bool
    _daemon: Embedded | None
    _http: httpx.AsyncClient | Http1Client | None
    _trust_env: bool
    _defs: dict[tuple[str, str | None], Definition]
    _ready_thread: threading.Event
    _task_status: Any

    if TYPE_CHECKING:
        def _sessions_manifest(self) -> dict[str, Any] | None: ...  # `_work_sessions`

        def _sticky_manifest(self) -> dict[str, Any] | None: ...  # `_sticky`

    def _init_connections(self) -> None:
        self._channel: Channel | None = None
        self._channel_kind: str | None = None
        self._channel_ready = Waiter()
        self._fallback = False
        self._attempt = 0
        self._in_pump = False
        self._session_scope: anyio.CancelScope | None = None
        self._finished_waiter = Waiter()
        self._heartbeat_s = 10.0
        self._lease_ttl_s = 30.0
        self._max_request_ms = 20_000
        self._fold_started = False  # the daemon said complete/fail may carry `started`

    def _kind(self) -> str:
        if self._daemon is not None:
            return "inprocess"
        if self.transport_choice == "http" or self._fallback:
            return "http"
        if self.transport_choice == "websocket":
            return "websocket"
        if on_trio():
            try:
                import websockets.trio.client  # noqa: F401
            except ImportError:
                return "http"
        return "websocket"

    async def _connection_loop(self) -> None:
        finished = self._finished_waiter
        while not finished.is_set():
            kind = self._kind()
            scope = anyio.CancelScope()
            self._session_scope = scope
            try:
                with scope:
                    if finished.is_set():
                        scope.cancel()
                    await self._session(kind)
                return  # the session ended because the worker finished
            except Refused as exc:
                if self.transport_choice == "websocket":
                    raise StepdError(f"worker {self.name}: {exc}") from exc
                log.warning("worker %s: %s; falling back to HTTP long-poll", self.name, exc)
                self._fallback = True
                continue
            except NotFound as exc:
                # The daemon does not know our worker id (its data was replaced):
                # register afresh. Leases held keep going: they are not per worker.
                log.warning("worker %s: %s; registering as a new worker", self.name, exc)
                self.worker_id = None
            except (Lost, Unavailable) as exc:
                log.info("worker %s: connection lost (%s); reconnecting", self.name, exc)
            finally:
                self._session_scope = None
            delay = backoff(self._attempt)
            self._attempt += 1
            with anyio.move_on_after(delay):
                await finished.wait()

    async def _session(self, kind: str) -> None:
        if kind == "inprocess":
            from stepd.channels.inprocess import InProcessChannel

            assert self._daemon is not None
            await self._serve_channel(InProcessChannel(self._daemon))
        elif kind == "http":
            from stepd.channels.http import HttpChannel

            assert self._http is not None
            await self._serve_channel(HttpChannel(self._http, self.timeout))
        else:
            from stepd.channels import websocket

            assert self.url is not None
            trio = on_trio()
            lean = websocket.use_lean(self.url, self._trust_env, trio=trio)
            async with websocket.connect(self.url, self.key, trust_env=self._trust_env,
                                         open_timeout=self.timeout, lean=lean,
                                         trio=trio) as channel:
                await self._serve_channel(channel)

    def _register_body(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "name": self.name,
            "protocol_version": self.protocol_version,
            "concurrency": self.concurrency,
            "definitions": [d.wire for d in self._defs.values()],
        }
        body.update(capability_declaration(self.protocol_version, local_steps=self.local_steps,
                                           sessions=self._sessions_manifest(),
                                           sticky=self._sticky_manifest()))
        if self.build_id is not None:
            body["build_id"] = self.build_id
        if self.worker_id is not None:
            body["worker_id"] = self.worker_id
        return body

    async def _serve_channel(self, channel: Channel) -> None:
        answer = await channel.register(self._register_body())
        self._on_registered(answer)
        self._attempt = 0
        self._channel, self._channel_kind = channel, channel.kind
        ready, self._channel_ready = self._channel_ready, Waiter()
        ready.set()
        if self.stopping:
            channel.stop_taking()
        log.info("worker %s registered as %s over %s", self.name, self.worker_id, channel.kind)
        if not self._ready_thread.is_set():
            self._ready_thread.set()
            self._task_status.started(self)
        if self._finished_waiter.is_set():
            channel.end()
        try:
            self._in_pump = True
            await channel.pump(self, self._max_request_ms)  # type: ignore[arg-type]
        finally:
            self._in_pump = False
            self._channel = None

    def _on_registered(self, answer: dict[str, Any]) -> None:
        self.worker_id = answer["worker_id"]
        self._heartbeat_s = max(0.001, int(answer.get("heartbeat_ms", 10_000)) / 1000)
        self._lease_ttl_s = max(0.001, int(answer.get("lease_ttl_ms", 30_000)) / 1000)
        self._max_request_ms = int(answer.get("max_request_ms", 30_000))
        self._fold_started = answer.get("fold_started") is True
        for entry in answer.get("definitions") or ():
            held = self._defs.get((entry.get("name"), entry.get("version")))
            theirs = entry.get("definition_hash")
            if held is not None and isinstance(theirs, str) and theirs != held.definition_hash:
                log.warning("worker %s: the daemon hashes %s %s as %s, the SDK as %s; using the "
                            "daemon's", self.name, held.name, held.version, theirs,
                            held.definition_hash)
                held.definition_hash = theirs
