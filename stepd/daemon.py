"""``stepd serve``: the daemon and the network transports in one process, one event loop.

`Server` opens the daemon (`stepd.actors.daemon.Daemon`) and runs uvicorn
programmatically inside the same event loop (``uvicorn.Server.serve()`` in a
task group next to the daemon's actors), serving the ASGI app of
`stepd.transport.http` (HTTP and the worker WebSocket on one port). The
network transport runs on asyncio (uvloop when installed): uvicorn is
asyncio-only.

Shutdown (STYLE.md rule 22), on SIGTERM or SIGINT (or `Server.request_stop`),
in stages, each idempotent:

1. stop accepting: every new request and WebSocket upgrade answers 503 (the
   port stays open, so clients see a clear refusal rather than a reset);
2. stop handing out leases: the daemon stops offering, held claims and result
   long-polls end (503), every WebSocket stops reading and pushing (its push
   session returns unoffered slots to the queue);
3. close WebSockets with 1001 once the frames they had in flight are answered;
4. wait for the calls in flight (their commits) up to ``shutdown_grace_ms``;
5. stop uvicorn, stop the actors, close the storage last (its writer drains
   what was queued).

A second signal, or the grace period running out, skips what is left of
stage 4: uvicorn cancels the requests still running (their writes, once
submitted, still commit: the storage never abandons a commit halfway) and
stage 5 runs as usual.

uvicorn runs with the daemon's own protocol classes, subclasses of uvicorn's
(`stepd.transport._uvicorn`), for what uvicorn does not bound: every
HTTP request is answered or closed within ``max_request_ms`` of its first byte
(the server's tick expires them), request heads are bounded (64 KiB, 100
fields), and a WebSocket whose peer does not read can still be closed
(docs/serve.md "Limits").

One line is printed on stdout once the port is open (tests wait for it)::

    stepd listening on http://127.0.0.1:7707 data=/var/lib/stepd auth=on keys=3
"""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import uvicorn

from stepd.actors.daemon import Daemon, DaemonConfig
from stepd.gc_policy import tune_gc
from stepd.otel import open_export
from stepd.sansio.durations import parse_duration
from stepd.sansio.errors import Invalid
from stepd.sansio.pricing import PriceBook
from stepd.sansio.run import DEFAULT_MAX_CHILD_DEPTH
from stepd.transport._uvicorn_http import HttpProtocol, http_protocol
from stepd.transport._uvicorn_ws import WebSocketProtocol
from stepd.transport.auth import KeyRing, check_bind_address
from stepd.transport.http import create_app
from stepd.transport.protocol import DEFAULT_MAX_BODY_BYTES, Protocol
from stepd.transport.websocket import DEFAULT_MAX_QUEUE_BYTES

__all__ = ["ServeConfig", "Server", "StartupError", "run"]

log = logging.getLogger("stepd.daemon")


class StartupError(Exception):
    """The daemon could not start serving (the port is taken, the data directory is in use)."""


@dataclass(frozen=True, slots=True)
class ServeConfig:
    """Everything ``stepd serve`` takes (docs/serve.md lists flags and variables).

    Attributes:
        data: the data directory (created if missing).
        host, port: where to listen (port 0: any free port; the line printed says which).
        admin_keys, write_keys, worker_keys, execute_keys, read_keys: API keys per scope.
        lease_ttl_ms, heartbeat_ms, recovery_window_ms, max_request_ms: the
            protocol's numbers (PROTOCOL.md "Defaults").
        max_body_bytes: the largest HTTP request body and WebSocket message.
        prices: a TOML price book (`PriceBook.load`), or None.
        shutdown_grace_ms: how long shutdown waits for calls in flight.
        ws_ping_interval_ms, ws_ping_timeout_ms: WebSocket keepalive (a peer that
            does not answer a ping within the timeout is closed).
        ws_max_in_flight: request frames answered concurrently per WebSocket.
        ws_max_queue: frames queued for sending per WebSocket.
        ws_max_queue_bytes: bytes of frames waiting to be sent per WebSocket;
            past it the connection is closed with 1013 (its peer does not read).
        max_header_bytes: the most bytes of request line and headers of an
            HTTP request (414 or 431 past it).
        max_headers: the most header fields of an HTTP request (431 past it).
        log_level: the level of stepd's and uvicorn's logs.
        gc: ``tuned`` (`stepd.gc_policy.tune_gc` at startup) or ``default``
            (CPython's collector settings, untouched).
        max_child_depth: how deep child runs may nest (`start_workflows`).
        worker_expiry_ms: forget a worker with no connection, claim or live
            lease for this long (0: never).
        otlp_endpoint: export runs, step attempts and body spans over OTLP/HTTP
            to this collector (docs/otel.md; needs ``stepd[otel]``), or None.
        retention: delete finished runs this long after they ended (a duration
            such as ``30d``, or ms; None or ``0``: keep them; docs/storage.md "Retention").
        idempotency_retention: keep a pruned run's idempotency key this long
            after it was taken (default: as ``retention``).
        unsafe_no_sync: commit without fsync. Loses acknowledged work on a
            power cut; it exists so the power-loss test has a control that can
            fail (tests/campaign), never for production.
        commit_on_loop: ``auto`` (a storage batch runs on the event loop while
            the writer thread idles and commits are quick; docs/storage.md) or
            ``never`` (every batch on the writer thread).
        sync_mode: ``log`` (a commit is durable after one synced append to the
            storage's write-ahead log; LMDB commits without its own sync) or
            ``lmdb`` (LMDB syncs each commit itself: two device flushes);
            docs/storage.md "The write-ahead log".
    """

    data: str
    host: str = "127.0.0.1"
    port: int = 7707
    admin_keys: tuple[str, ...] = ()
    write_keys: tuple[str, ...] = ()
    worker_keys: tuple[str, ...] = ()
    execute_keys: tuple[str, ...] = ()
    read_keys: tuple[str, ...] = ()
    lease_ttl_ms: int = 30_000
    heartbeat_ms: int = 10_000
    recovery_window_ms: int = 5_000
    max_request_ms: int = 30_000
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    prices: str | None = None
    shutdown_grace_ms: int = 10_000
    ws_ping_interval_ms: int = 20_000
    ws_ping_timeout_ms: int = 20_000
    ws_max_in_flight: int = 64
    ws_max_queue: int = 256
    ws_max_queue_bytes: int = DEFAULT_MAX_QUEUE_BYTES
    max_header_bytes: int = 64 << 10
    max_headers: int = 100
    log_level: str = "warning"
    gc: str = "tuned"
    unsafe_no_sync: bool = False
    max_child_depth: int = DEFAULT_MAX_CHILD_DEPTH
    worker_expiry_ms: int = 600_000
    otlp_endpoint: str | None = None
    retention: str | int | None = None
    idempotency_retention: str | int | None = None
    commit_on_loop: str = "auto"
    sync_mode: str = "log"

    def keyring(self) -> KeyRing:
        """The configured keys.

        Raises:
            Invalid: a key is empty or holds a character a Bearer token cannot carry.
        """
        return KeyRing.from_config(
            admin=self.admin_keys, write=self.write_keys, worker=self.worker_keys,
            execute=self.execute_keys, read=self.read_keys,
        )

    def daemon_config(self) -> DaemonConfig:
        """The daemon's numbers and price book.

        Raises:
            Invalid: a number out of range, or a price book that does not load.
        """
        prices = PriceBook.load(self.prices) if self.prices else PriceBook()
        config = DaemonConfig(
            lease_ttl_ms=self.lease_ttl_ms, heartbeat_ms=self.heartbeat_ms,
            recovery_window_ms=self.recovery_window_ms, max_request_ms=self.max_request_ms,
            prices=prices, sync=not self.unsafe_no_sync, max_child_depth=self.max_child_depth,
            worker_expiry_ms=self.worker_expiry_ms,
            commit_on_loop=_choice(self.commit_on_loop, "commit_on_loop", "auto", "never"),
            write_ahead_log=_choice(self.sync_mode, "sync_mode", "log", "lmdb"),
            retention_ms=_duration(self.retention, "retention"),
            idempotency_retention_ms=_duration(self.idempotency_retention, "idempotency_retention"),
        )
        config.check()
        return config


def _choice(value: str, field: str, on: str, off: str) -> bool:
    """A two-way flag (``commit_on_loop``: auto/never, ``sync_mode``: log/lmdb) as a bool.

    Raises:
        Invalid: neither word, naming the field.
    """
    if value not in (on, off):
        raise Invalid(f"must be {on!r} or {off!r}, got {value!r}", field=field)
    return value == on


def _duration(value: str | int | None, field: str) -> int:
    """A retention flag as ms (``30d``, ``12h``, or ms); None: 0 (off).

    Raises:
        Invalid: not a duration (naming the flag).
    """
    if value is None:
        return 0
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    return parse_duration(value, field=field, allow_zero=True)


class _Server(uvicorn.Server):
    """uvicorn's server without its signal handlers (the daemon owns SIGTERM/SIGINT),
    and without its ten wake-ups a second when idle.

    uvicorn's main loop sleeps 0.1 s between ticks to notice `should_exit` and
    refresh its Date header once a second; an idle daemon then wakes the CPU
    twenty times a second (PEERS.md workload C counts that). Here it ticks once
    a second, and `should_exit` wakes it at once. Each tick also expires the
    HTTP requests past their deadline (`HttpProtocol.expire`); with a short
    ``max_request_ms`` it ticks more often (a tenth of it, at least every
    50 ms), so a request is cut at most a tick after its deadline.
    """

    _exit_asked: anyio.Event | None = None
    tick_s: float = 1.0

    @property
    def should_exit(self) -> bool:
        return self._exit_flag

    @should_exit.setter
    def should_exit(self, value: bool) -> None:
        self._exit_flag = value
        if value and self._exit_asked is not None:
            self._exit_asked.set()

    async def main_loop(self) -> None:
        self._exit_asked = anyio.Event()
        if self._exit_flag:
            self._exit_asked.set()
        should_exit = await self.on_tick(0)
        next_second = anyio.current_time() + 1.0
        while not should_exit:
            with anyio.move_on_after(self.tick_s):
                await self._exit_asked.wait()
            now = anyio.current_time()
            self.expire_requests(now)
            counter = 1  # on_tick refreshes the Date header when counter % 10 == 0
            if now >= next_second:
                counter, next_second = 0, now + 1.0
            should_exit = await self.on_tick(counter)

    def expire_requests(self, now: float) -> None:
        """Cut the HTTP requests past their deadline (the loop's clock, ``now``)."""
        for conn in list(self.server_state.connections):
            if isinstance(conn, HttpProtocol):
                conn.expire(now)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _url(host: str, port: int) -> str:
    shown = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"http://{shown}:{port}"


class Server:
    """One ``stepd serve``: the daemon, the protocol handler, uvicorn, and the staged shutdown.

    Args:
        config: the settings.
        announce: called with the listening line once the port is open
            (default: print it on stdout and flush).
    """

    def __init__(self, config: ServeConfig, *,
                 announce: Callable[[str], None] | None = None) -> None:
        self.config = config
        self.announce = announce or _print_line
        self.url: str | None = None
        self.port: int | None = None
        self.protocol: Protocol | None = None
        self.daemon: Daemon | None = None
        self.forced = False
        self._stop = anyio.Event()
        self._force = anyio.Event()

    # -- control -------------------------------------------------------------------

    def request_stop(self) -> None:
        """Begin the staged shutdown; called again, cut the grace period short.

        Call from the daemon's event loop (signals are routed there).
        """
        if not self._stop.is_set():
            log.warning("stepd: shutting down (again to force)")
            self._stop.set()
            if self.protocol is not None:
                self.protocol.begin_drain()
        else:
            self.forced = True
            self._force.set()

    # -- the main task ---------------------------------------------------------------

    async def run(self, *, task_status: anyio.abc.TaskStatus[Server] = anyio.TASK_STATUS_IGNORED
                  ) -> int:
        """Serve until stopped; return the exit status (0).

        Raises:
            Invalid: a setting is out of range, or no key is configured and the
                host is not loopback (``field="listen"``).
            StartupError: the port could not be opened.
            storage errors: the data directory could not be opened.
        """
        config = self.config
        keyring = config.keyring()
        check_bind_address(config.host, keyring)
        daemon_config = config.daemon_config()
        Path(config.data).mkdir(parents=True, exist_ok=True)
        noise = _HandshakeNoise()
        logging.getLogger("uvicorn.error").addFilter(noise)
        async with (open_export(config.otlp_endpoint) as trace,
                    Daemon.open(config.data, config=daemon_config, trace=trace) as daemon):
            self.daemon = daemon
            protocol = Protocol(daemon, keyring=keyring,
                                max_body_bytes=config.max_body_bytes)
            self.protocol = protocol
            app = create_app(protocol, max_in_flight=config.ws_max_in_flight,
                             max_queue=config.ws_max_queue,
                             max_queue_bytes=config.ws_max_queue_bytes)
            http = http_protocol(max_request_ms=config.max_request_ms,
                                 max_header_bytes=config.max_header_bytes,
                                 max_headers=config.max_headers)
            server = _Server(uvicorn.Config(
                app, host=config.host, port=config.port, http=http,
                ws=WebSocketProtocol, lifespan="off", log_config=None, proxy_headers=False,
                log_level=config.log_level, access_log=False, server_header=False,
                ws_max_size=config.max_body_bytes + 4096,
                ws_ping_interval=config.ws_ping_interval_ms / 1000,
                ws_ping_timeout=config.ws_ping_timeout_ms / 1000,
                ws_per_message_deflate=False,
                timeout_graceful_shutdown=1,
            ))
            server.tick_s = min(1.0, max(0.05, config.max_request_ms / 10_000))
            startup_error: StartupError | None = None
            async with anyio.create_task_group() as tg:
                served = anyio.Event()
                failure: list[BaseException] = []
                tg.start_soon(self._serve_uvicorn, server, served, failure)
                while not server.started:
                    if served.is_set():
                        # Raised after the task group, so it leaves unwrapped.
                        startup_error = StartupError(
                            f"cannot listen on {_url(config.host, config.port)}"
                        )
                        startup_error.__cause__ = failure[0] if failure else None
                        tg.cancel_scope.cancel()
                        break
                    await anyio.sleep(0.002)
                else:
                    await self._serve(config, server, served, protocol, daemon, keyring, tg,
                                      task_status)
            if startup_error is not None:
                raise startup_error
        return 0

    async def _serve(self, config: Any, server: Any, served: anyio.Event, protocol: Any,
                     daemon: Any, keyring: Any, tg: Any, task_status: Any) -> None:
        """Listening: announce, serve until told to stop, drain, then stop uvicorn."""
        sockets = server.servers[0].sockets if server.servers else ()
        self.port = sockets[0].getsockname()[1] if sockets else config.port
        self.url = _url(config.host, self.port)
        if self._stop.is_set():
            protocol.begin_drain()
        self.announce(
            f"stepd listening on {self.url} data={daemon.storage.path} "
            f"auth={'on' if keyring.enabled else 'off'} keys={len(keyring.key_ids())}"
        )
        task_status.started(self)
        with _signals_to(self, tg):
            await self._stop.wait()
            await self._drain(protocol)
        server.should_exit = True
        if self.forced:
            server.force_exit = True
        with anyio.move_on_after(5):
            await served.wait()
        tg.cancel_scope.cancel()

    async def _drain(self, protocol: Protocol) -> None:
        """Stages 1-4: refuse, stop leasing, close WebSockets, wait for what is in flight.

        The wait ends when nothing is in flight, when the grace period runs
        out, or at a second signal; then what is still running is cancelled
        (`Protocol.abort`: HTTP calls answer 503, WebSockets end).
        """
        protocol.begin_drain()
        quiet = False
        with anyio.move_on_after(self.config.shutdown_grace_ms / 1000):
            async with anyio.create_task_group() as tg:

                async def cut_short() -> None:
                    await self._force.wait()
                    tg.cancel_scope.cancel()

                tg.start_soon(cut_short)
                await protocol.wait_quiet()
                quiet = True
                tg.cancel_scope.cancel()
        if not quiet:
            self.forced = True
            log.warning("stepd: stopping %d call(s) still in flight", protocol.inflight)
            protocol.abort()
            with anyio.move_on_after(1.0):
                await protocol.wait_quiet()

    async def _serve_uvicorn(self, server: _Server, served: anyio.Event,
                             failure: list[BaseException]) -> None:
        try:
            await server.serve()
        except SystemExit as exc:  # uvicorn exits when it cannot bind
            failure.append(exc)
        except Exception as exc:
            if server.started:
                raise
            failure.append(exc)
        finally:
            served.set()


@contextlib.contextmanager
def _signals_to(daemon: Server, tg: anyio.abc.TaskGroup) -> Iterator[None]:
    """Route SIGTERM and SIGINT to `Server.request_stop` while the daemon serves.

    Only the main thread can receive signals; elsewhere (a daemon started by a
    test in a thread) `Server.request_stop` is the only way to stop it.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    scope = anyio.CancelScope()

    async def watch() -> None:
        with scope, anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for _ in signals:
                daemon.request_stop()

    tg.start_soon(watch)
    try:
        yield
    finally:
        scope.cancel()


class _HandshakeNoise(logging.Filter):
    """Drop uvicorn's false alarm after a refused WebSocket upgrade.

    uvicorn's sans-I/O WebSocket protocol logs "ASGI callable returned without
    completing handshake." after an app refused the upgrade with an HTTP answer
    (the ``websocket.http.response`` extension), which is how the daemon
    answers 401/403/400/503 on ``/v1/api/workers/connect``. The app always
    accepts or refuses, so the message says nothing here.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != "ASGI callable returned without completing handshake."


def _print_line(line: str) -> None:
    print(line, flush=True)


def _backend_options() -> dict[str, Any]:
    try:
        import uvloop  # noqa: F401
    except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
        return {}
    return {"use_uvloop": True}


def run(config: ServeConfig) -> int:
    """Run a daemon in a new event loop (asyncio, uvloop when installed) until it stops.

    Returns:
        The exit status: 0 after a shutdown (staged or forced).

    Raises:
        Invalid, StartupError, storage errors: see `Server.run`.
    """
    if config.gc not in ("tuned", "default"):
        raise Invalid("must be 'tuned' or 'default'", field="gc")
    logging.basicConfig(level=config.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    daemon = Server(config)
    if config.gc == "tuned":
        tune_gc()
    return anyio.run(daemon.run, backend="asyncio", backend_options=_backend_options())

