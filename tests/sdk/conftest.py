"""Fixtures for the SDK tests: real daemons (uvicorn on 127.0.0.1, or embedded), a TCP proxy.

* ``net`` / ``fast_net``: ``stepd.daemon.Daemon`` (the transports engineer's
  ``stepd serve``: uvicorn, HTTP and the worker WebSocket on one port) running in
  this process on its own event-loop thread, on a free port. ``fast_net`` has
  short lease timings (TTL 300 ms, heartbeats every 100 ms, recovery window
  200 ms). Both carry a price book (model ``m``: 1 USD per million input
  tokens, 2 per million output tokens). Shared by the session: tests use their
  own workflow names (`unique`).
* ``stack`` / ``fast_stack``: one way to reach a daemon, parametrised over
  ``websocket``, ``http`` (a network worker forced to long-poll) and
  ``embedded`` (``stepd.embedded`` on a fresh data directory, sync form).
* `Proxy`: a TCP proxy in front of a network daemon that can cut every
  connection, swallow the daemon's answers for a while, or refuse WebSocket
  upgrades with a 404: real network faults for the reconnect,
  ``already_applied`` and fallback tests.
* `serving`: ``worker.serve()`` on a thread, stopped and joined (bounded).

Every wait is bounded; nothing sleeps longer than the behaviour needs.
"""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import anyio.from_thread
import pytest

import stepd
from stepd.sansio.pricing import PriceBook
from tests._waiting import eventually as _eventually

PRICES = {"models": {"m": {"input_per_million": 1.0, "output_per_million": 2.0}}}
PRICES_TOML = '[models."m"]\ninput_per_million = 1.0\noutput_per_million = 2.0\n'
FAST = {"lease_ttl_ms": 300, "heartbeat_ms": 100, "recovery_window_ms": 200}
JOIN_TIMEOUT_S = 20.0


def unique(prefix: str = "wf") -> str:
    """A workflow name no other test uses."""
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def eventually(check: Callable[[], Any], *, timeout: float = 10.0, what: str = "") -> Any:
    """Poll ``check`` until it returns something truthy (bounded)."""
    return _eventually(check, timeout=timeout, what=what, interval=0.01)


def journal_types(client: stepd.Client, run: Any) -> list[str]:
    return [e["type"] for e in client.journal(run)]


# --------------------------------------------------------------------------- network daemons


@dataclass
class NetDaemon:
    url: str
    daemon: Any
    portal: anyio.from_thread.BlockingPortal

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])


@contextlib.contextmanager
def _net_daemon(data: Path, **timings: int) -> Iterator[NetDaemon]:
    from stepd.daemon import ServeConfig, Server

    prices = data.parent / f"{data.name}.prices.toml"
    data.parent.mkdir(parents=True, exist_ok=True)
    prices.write_text(PRICES_TOML)
    config = ServeConfig(data=str(data), port=0, max_request_ms=2000, prices=str(prices),
                         shutdown_grace_ms=2000, **timings)
    daemon = Server(config, announce=lambda line: None)
    with anyio.from_thread.start_blocking_portal("asyncio") as portal:
        future, _ = portal.start_task(daemon.run)
        try:
            assert daemon.url is not None
            yield NetDaemon(daemon.url, daemon, portal)
        finally:
            portal.call(daemon.request_stop)
            assert future.result(timeout=JOIN_TIMEOUT_S) == 0


@pytest.fixture(scope="session")
def net(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NetDaemon]:
    with _net_daemon(tmp_path_factory.mktemp("net") / "data") as d:
        yield d


@pytest.fixture(scope="session")
def fast_net(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NetDaemon]:
    with _net_daemon(tmp_path_factory.mktemp("fastnet") / "data", **FAST) as d:
        yield d


# --------------------------------------------------------------------------- stacks


@dataclass
class Stack:
    """One way to reach a daemon: a client and a worker factory on the same transport."""

    kind: str  # websocket | http | embedded
    client: stepd.Client
    target: Any  # what Client/Worker/AsyncClient take (a URL or the embedded daemon)
    url: str | None = None
    workers: list[stepd.Worker] = field(default_factory=list)

    def worker(self, *workflows: stepd.Workflow, **options: Any) -> stepd.Worker:
        if self.kind in ("websocket", "http"):
            options.setdefault("transport", self.kind)
        bodies = options.pop("bodies", None)
        w = stepd.Worker(self.client, **options).register(*workflows, bodies=bodies)
        self.workers.append(w)
        return w

    @property
    def transport(self) -> str:
        return "inprocess" if self.kind == "embedded" else self.kind


@contextlib.contextmanager
def _stack(kind: str, daemon: NetDaemon | None, path: Path, timings: dict[str, int]
           ) -> Iterator[Stack]:
    if kind == "embedded":
        with stepd.embedded(path, prices=PriceBook.from_dict(PRICES), **timings) as d:
            client = stepd.Client(d)
            yield Stack(kind, client, d)
    else:
        assert daemon is not None
        with stepd.Client(daemon.url, trust_env=False) as client:
            yield Stack(kind, client, daemon.url, url=daemon.url)


@pytest.fixture(params=["websocket", "http", "embedded"])
def stack(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Stack]:
    daemon = None if request.param == "embedded" else request.getfixturevalue("net")
    with _stack(request.param, daemon, tmp_path / "data", {}) as s:
        yield s


@pytest.fixture(params=["websocket", "http", "embedded"])
def fast_stack(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Stack]:
    daemon = None if request.param == "embedded" else request.getfixturevalue("fast_net")
    with _stack(request.param, daemon, tmp_path / "data", FAST) as s:
        yield s


@contextlib.contextmanager
def serving(worker: stepd.Worker, *, grace: float | None = None,
            backend: str = "asyncio") -> Iterator[stepd.Worker]:
    """Run ``worker.serve()`` on a thread until the block ends; then stop and join it."""
    errors: list[BaseException] = []

    def target() -> None:
        try:
            worker.serve(backend=backend)
        except BaseException as exc:  # noqa: BLE001 - reported by the test below
            errors.append(exc)

    thread = threading.Thread(target=target, name=f"serve {worker.name}", daemon=True)
    thread.start()
    try:
        assert worker.wait_ready(JOIN_TIMEOUT_S), f"worker did not register: {errors}"
        yield worker
    finally:
        worker.stop(grace)
        thread.join(JOIN_TIMEOUT_S)
        assert not thread.is_alive(), "worker.serve() did not return after stop()"
    if errors:
        raise errors[0]


# --------------------------------------------------------------------------- TCP proxy


class Proxy:
    """A TCP proxy in front of a daemon, with faults on demand (thread-safe controls).

    Attributes:
        refuse_websocket: answer WebSocket upgrades with 404 instead of forwarding.
        swallow: drop what the daemon sends (the client's bytes still go through).
        unavailable: answer this many more new connections' first request with
            503 (and close), as a daemon shutting down would.
    """

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.refuse_websocket = False
        self.swallow = False
        self.unavailable = 0
        self.answered_503 = 0
        self.port = 0
        self.connections = 0
        self.refused = 0
        self._scopes: set[anyio.CancelScope] = set()
        self._portal: anyio.from_thread.BlockingPortal | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def serve(self, *, task_status: anyio.abc.TaskStatus[int] = anyio.TASK_STATUS_IGNORED
                    ) -> None:
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
        async with listener:
            self.port = listener.extra(anyio.abc.SocketAttribute.local_port)
            task_status.started(self.port)
            await listener.serve(self._handle)

    async def _handle(self, client: anyio.abc.SocketStream) -> None:
        scope = anyio.CancelScope()
        self._scopes.add(scope)
        try:
            with scope:
                async with client:
                    await self._proxy(client)
        finally:
            self._scopes.discard(scope)

    async def _proxy(self, client: anyio.abc.SocketStream) -> None:
        try:
            first = await client.receive()
        except (anyio.EndOfStream, anyio.BrokenResourceError, OSError):
            return
        if self.refuse_websocket and first.startswith(b"GET /v1/api/workers/connect"):
            self.refused += 1
            body = b'{"error":"not_found","message":"no WebSocket here"}'
            await client.send(b"HTTP/1.1 404 Not Found\r\ncontent-type: application/json\r\n"
                              b"content-length: %d\r\nconnection: close\r\n\r\n%s"
                              % (len(body), body))
            return
        if self.unavailable > 0:
            self.unavailable -= 1
            self.answered_503 += 1
            body = b'{"error":"unavailable","message":"the daemon is shutting down"}'
            await client.send(b"HTTP/1.1 503 Service Unavailable\r\n"
                              b"content-type: application/json\r\ncontent-length: %d\r\n"
                              b"connection: close\r\n\r\n%s" % (len(body), body))
            return
        try:
            upstream = await anyio.connect_tcp("127.0.0.1", self.target_port)
        except OSError:
            return
        self.connections += 1
        async with upstream:
            await upstream.send(first)
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._pipe, client, upstream, False, tg)
                tg.start_soon(self._pipe, upstream, client, True, tg)

    async def _pipe(self, src: anyio.abc.ByteStream, dst: anyio.abc.ByteStream, down: bool,
                    tg: anyio.abc.TaskGroup) -> None:
        try:
            while True:
                data = await src.receive()
                if down and self.swallow:
                    continue
                await dst.send(data)
        except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError,
                OSError):
            pass
        finally:
            tg.cancel_scope.cancel()

    def _cut(self) -> None:
        for scope in list(self._scopes):
            scope.cancel()

    def cut(self) -> None:
        """Close every proxied connection now (from any thread)."""
        assert self._portal is not None
        self._portal.call(self._cut)


@pytest.fixture
def make_proxy() -> Iterator[Callable[[NetDaemon], Proxy]]:
    with anyio.from_thread.start_blocking_portal("asyncio") as portal:
        tasks: list[Any] = []

        def make(daemon: NetDaemon) -> Proxy:
            proxy = Proxy(daemon.port)
            proxy._portal = portal
            future, _ = portal.start_task(proxy.serve)
            tasks.append(future)
            return proxy

        yield make
        for future in tasks:
            future.cancel()


KEYS = {
    "worker": "sdk-worker-key-0123456789abcdef",
    "execute": "sdk-execute-key-0123456789abcdef",
    "read": "sdk-read-key-0123456789abcdef",
}


@pytest.fixture(scope="session")
def auth_net(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NetDaemon]:
    """A network daemon with keys per scope: worker; execute (which may also read); read."""
    from stepd.daemon import ServeConfig, Server

    config = ServeConfig(data=str(tmp_path_factory.mktemp("auth") / "data"), port=0,
                         max_request_ms=2000, worker_keys=(KEYS["worker"],),
                         execute_keys=(KEYS["execute"],),
                         read_keys=(KEYS["read"], KEYS["execute"]),
                         shutdown_grace_ms=2000)
    daemon = Server(config, announce=lambda line: None)
    with anyio.from_thread.start_blocking_portal("asyncio") as portal:
        future, _ = portal.start_task(daemon.run)
        try:
            assert daemon.url is not None
            yield NetDaemon(daemon.url, daemon, portal)
        finally:
            portal.call(daemon.request_stop)
            assert future.result(timeout=JOIN_TIMEOUT_S) == 0
