"""``stepd.embedded(path)``: the daemon inside this process, without sockets.

Two forms, one object::

    with stepd.embedded("./data") as daemon:          # sync: the daemon runs on a
        client = stepd.Client(daemon)                   # background event-loop thread
        ...

    async with stepd.embedded("./data") as daemon:    # async: the daemon runs in the
        client = stepd.AsyncClient(daemon)              # caller's loop (asyncio or trio)
        ...

`stepd.Client`, `stepd.AsyncClient` and `stepd.Worker` take the daemon in
place of a URL and behave exactly as over the network: every call goes
through the in-process transport (`stepd.transport.inprocess.InProcess`: the
daemon's own protocol handler, the same validation and errors as HTTP, values
copied across), and a worker receives its leases by in-process push (the
worker's session actor, the WebSocket's credit protocol without the socket).

Where things run. The daemon lives on one event loop: the background thread's
in the sync form, the caller's in the async form. A worker always runs its
leases on that loop (async bodies run there; sync bodies in its thread pool),
so a step costs no thread hop. Calls from elsewhere cross over: a sync call
from another thread through the loop's token (or the sync form's portal), an
async call from another loop through a worker thread.

Leaving the context stops the workers still serving this daemon (bodies not
done are failed back as ``retryable``), then closes the daemon.

Defaults (issue 16: fast and safe without knobs). The sync form's background
loop is asyncio on uvloop when it is installed (``uvloop=False``: asyncio's
own); the async form runs on the caller's loop, so ``uvloop.run(main())`` is
the caller's choice. While the daemon is open the collector's young threshold
is raised (``gc="young"``, `stepd.gc_policy.young_threshold`, the host's put
back on close); ``gc="tuned"`` also freezes (`stepd.tune_gc`), ``gc="default"``
leaves the collector alone.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import threading
import typing
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self, TypeVar

import anyio
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread

from stepd._errors import Invalid, translate
from stepd._loop import loop_options
from stepd.gc_policy import GC_POLICIES, gc_policy

if TYPE_CHECKING:
    from stepd.actors.daemon import Daemon
    from stepd.transport.inprocess import InProcess
    from stepd.transport.protocol import Protocol

__all__ = ["Embedded", "embedded"]

T = TypeVar("T")


class _Served(typing.Protocol):
    """What the daemon needs of a worker serving it (`stepd.Worker`): stop it, wait for it."""

    def _stop_here(self, grace: float) -> None: ...

    async def _wait_stopped(self) -> None: ...

STOP_WORKERS_TIMEOUT_S = 30.0

_DAEMON_MODULES = (
    "stepd.sansio.pricing", "stepd.otel", "stepd.transport.auth", "stepd.actors.daemon",
    "stepd.transport.inprocess", "stepd.transport.protocol",
)
"""What opening a daemon imports (`Embedded._open`, `Embedded._serving`), the last one last."""


def _import_daemon() -> None:
    for name in _DAEMON_MODULES:
        importlib.import_module(name)
"""How long closing waits for the workers it stops (they fail back what they ran)."""


class Embedded:
    """A daemon running in this process. Create it with `stepd.embedded`.

    Use it as ``with`` (sync form) or ``async with`` (async form), once.

    Attributes:
        path: the data directory.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        lease_ttl_ms: int | None = None,
        heartbeat_ms: int | None = None,
        recovery_window_ms: int | None = None,
        max_request_ms: int | None = None,
        prices: Any = None,
        audit: bool = False,
        backend: str = "asyncio",
        otlp_endpoint: str | None = None,
        gc: str = "young",
        uvloop: bool = True,
        commit_on_loop: bool = True,
        sync_mode: str = "log",
    ) -> None:
        if gc not in GC_POLICIES:
            raise Invalid(f"must be one of {', '.join(GC_POLICIES)}", field="gc")
        self.path = Path(path)
        self._gc = gc
        self._uvloop = uvloop
        self._settings = {
            k: v for k, v in {
                "lease_ttl_ms": lease_ttl_ms, "heartbeat_ms": heartbeat_ms,
                "recovery_window_ms": recovery_window_ms, "max_request_ms": max_request_ms,
            }.items() if v is not None
        }
        self._settings["commit_on_loop"] = bool(commit_on_loop)
        if sync_mode not in ("log", "lmdb"):
            raise Invalid(f"must be 'log' or 'lmdb', got {sync_mode!r}", field="sync_mode")
        self._settings["write_ahead_log"] = sync_mode == "log"
        self._prices = prices
        self._audit = audit
        self._backend = backend
        self._otlp_endpoint = otlp_endpoint
        self._daemon: Daemon | None = None
        self._protocol: Protocol | None = None
        self._inprocess: InProcess | None = None
        self._token: Any = None
        self._loop_thread: int | None = None
        self._portal: anyio.from_thread.BlockingPortal | None = None
        self._portal_cm: Any = None
        self._context_cm: Any = None
        self._async_cm: Any = None
        self._used = False
        self._workers: set[_Served] = set()

    def __repr__(self) -> str:
        state = "open" if self._daemon is not None else "closed"
        return f"<stepd.Embedded {str(self.path)!r} {state}>"

    # -- what the SDK reaches ---------------------------------------------------------

    @property
    def daemon(self) -> Daemon:
        """The daemon core (`stepd.actors.daemon.Daemon`; for tests and tools, the SDK
        goes through `inprocess`).

        Raises:
            RuntimeError: the daemon is not open.
        """
        if self._daemon is None:
            raise RuntimeError("the embedded daemon is not open: use `with stepd.embedded(...)`")
        return self._daemon

    @property
    def inprocess(self) -> InProcess:
        """The in-process transport every SDK call goes through."""
        if self._inprocess is None:
            raise RuntimeError("the embedded daemon is not open: use `with stepd.embedded(...)`")
        return self._inprocess

    @property
    def config(self) -> Any:
        """The daemon's `DaemonConfig`."""
        return self.daemon.config

    def on_loop(self) -> bool:
        """True when called on the thread that runs the daemon's event loop."""
        return threading.get_ident() == self._loop_thread

    def call_blocking(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``await fn(*args)`` on the daemon's loop from another thread; wait for it.

        Raises:
            RuntimeError: called on the daemon's own loop thread (it would
                deadlock: use the async API there), or the daemon is closed.
            whatever ``fn`` raises, translated to the SDK's errors.
        """
        if self._token is None:
            raise RuntimeError("the embedded daemon is not open")
        if self.on_loop():
            raise RuntimeError(
                "a blocking stepd call on the embedded daemon's own event loop would deadlock; "
                "use stepd.AsyncClient (and `await worker.run()`) inside the loop"
            )
        try:
            if self._portal is not None:
                return self._portal.call(fn, *args)
            return anyio.from_thread.run(fn, *args, token=self._token)  # type: ignore[arg-type]
        except Exception as exc:  # noqa: BLE001 - translated and re-raised
            raise translate(exc) from None

    async def call_async(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """``await fn(*args)`` on the daemon's loop, from any loop.

        Raises:
            whatever ``fn`` raises, translated to the SDK's errors.
        """
        if self.on_loop():
            try:
                return await fn(*args)
            except Exception as exc:  # noqa: BLE001 - translated and re-raised
                raise translate(exc) from None
        return await anyio.to_thread.run_sync(self.call_blocking, fn, *args,
                                              abandon_on_cancel=True)

    # -- workers ------------------------------------------------------------------------

    def _attach(self, worker: _Served) -> None:
        self._workers.add(worker)

    def _detach(self, worker: _Served) -> None:
        self._workers.discard(worker)

    # -- lifecycle ----------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _open(self) -> AsyncIterator[Embedded]:
        if _DAEMON_MODULES[-1] not in sys.modules:
            # The daemon's modules are imported the first time a daemon opens (a
            # worker process never needs them). On the loop, that import held the
            # caller's event loop for ~0.5 s (more where bytecode is not cached):
            # in a thread, the loop keeps serving meanwhile.
            await anyio.to_thread.run_sync(_import_daemon)
        from stepd.actors.daemon import Daemon, DaemonConfig
        from stepd.otel import open_export
        from stepd.sansio.pricing import PriceBook

        prices = self._prices
        if isinstance(prices, (str, Path)):
            prices = PriceBook.load(prices)
        settings: dict[str, Any] = dict(self._settings)
        if prices is not None:
            settings["prices"] = prices
        config = DaemonConfig(**settings)
        await anyio.to_thread.run_sync(lambda: self.path.mkdir(parents=True, exist_ok=True))
        with gc_policy(self._gc):
            async with open_export(self._otlp_endpoint) as trace:
                async with self._serving(Daemon.open(str(self.path), config=config, trace=trace)):
                    yield self

    @contextlib.asynccontextmanager
    async def _serving(self, opening: Any) -> AsyncIterator[None]:
        """The open daemon wired to its protocol and in-process transport, until closed."""
        from stepd.transport.auth import KeyRing
        from stepd.transport.inprocess import InProcess
        from stepd.transport.protocol import Protocol

        async with opening as daemon:
            protocol = Protocol(daemon, keyring=KeyRing.from_config(), audited=self._audit)
            self._daemon, self._protocol = daemon, protocol
            self._inprocess = InProcess(protocol)
            self._token = anyio.lowlevel.current_token()
            self._loop_thread = threading.get_ident()
            try:
                yield
            finally:
                with anyio.CancelScope(shield=True):
                    await self._stop_workers()
                self._token = None
                self._inprocess = None
                self._protocol = None
                self._daemon = None

    async def _stop_workers(self) -> None:
        workers = list(self._workers)
        for worker in workers:
            worker._stop_here(0.0)
        with anyio.move_on_after(STOP_WORKERS_TIMEOUT_S):
            for worker in workers:
                await worker._wait_stopped()

    def _claim_use(self) -> None:
        if self._used:
            raise RuntimeError("an Embedded daemon can be opened once; call stepd.embedded() again")
        self._used = True

    def __enter__(self) -> Self:
        self._claim_use()
        self._portal_cm = anyio.from_thread.start_blocking_portal(
            self._backend, loop_options(self._backend) if self._uvloop else None
        )
        self._portal = self._portal_cm.__enter__()
        try:
            self._context_cm = self._portal.wrap_async_context_manager(self._open())
            self._context_cm.__enter__()
        except BaseException:
            self._portal_cm.__exit__(None, None, None)
            self._portal = None
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            self._context_cm.__exit__(exc_type, exc, tb)
        finally:
            portal_cm, self._portal_cm = self._portal_cm, None
            self._portal = None
            portal_cm.__exit__(None, None, None)

    async def __aenter__(self) -> Self:
        self._claim_use()
        self._async_cm = self._open()
        await self._async_cm.__aenter__()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self._async_cm.__aexit__(exc_type, exc, tb)


def embedded(
    path: str | Path,
    *,
    lease_ttl_ms: int | None = None,
    heartbeat_ms: int | None = None,
    recovery_window_ms: int | None = None,
    max_request_ms: int | None = None,
    prices: Any = None,
    audit: bool = False,
    backend: str = "asyncio",
    otlp_endpoint: str | None = None,
    gc: str = "young",
    uvloop: bool = True,
    commit_on_loop: bool = True,
    sync_mode: str = "log",
) -> Embedded:
    """A daemon in this process on the data directory ``path`` (created if missing).

    Use it as ``with stepd.embedded(path) as daemon:`` (the daemon runs on a
    background event-loop thread; sync code works unchanged) or
    ``async with stepd.embedded(path) as daemon:`` (in the caller's loop,
    asyncio or trio). Pass the daemon to `stepd.Client`, `stepd.AsyncClient`
    or `stepd.Worker` in place of a URL.

    Args:
        path: the data directory (LMDB). One process may open it at a time.
        lease_ttl_ms, heartbeat_ms, recovery_window_ms, max_request_ms: the
            protocol's numbers (PROTOCOL.md "Defaults"); None keeps the default.
        prices: a price book: a `stepd.sansio.pricing.PriceBook`, or the path of
            its TOML file.
        audit: keep the audit log of runs calls, as ``stepd serve`` does
            (off by default: every caller is this process).
        backend: the sync form's event loop, ``"asyncio"`` or ``"trio"`` (the
            async form runs on the caller's).
        otlp_endpoint: export runs, step attempts and body spans over OTLP/HTTP
            to this collector (docs/otel.md; needs ``pip install 'stepd[otel]'``).
        gc: the collector while the daemon is open: ``"young"`` (the young
            generation's threshold raised, the host's restored on close),
            ``"tuned"`` (`stepd.tune_gc`: a freeze too, for good) or
            ``"default"`` (left alone). `stepd.gc_policy` says why.
        uvloop: the sync form's asyncio loop on uvloop when it is installed
            (False: asyncio's own loop).
        commit_on_loop: let a storage batch commit on the daemon's event loop
            while the storage writer thread is idle and commits are quick (the
            default; docs/storage.md "On the loop while the writer is idle");
            False: every batch on the writer thread.
        sync_mode: ``"log"`` (the default: a commit is durable after one synced
            append to the storage's write-ahead log) or ``"lmdb"`` (LMDB syncs
            each commit itself, two device flushes); docs/storage.md "The
            write-ahead log".

    Returns:
        An `Embedded`, to open with ``with`` or ``async with``.

    Raises:
        Invalid: ``gc`` is not one of the three (at once); a setting out of
            range, or ``otlp_endpoint`` without the OpenTelemetry packages (on entering).
        storage errors: the directory is in use or cannot be opened (on entering).
    """
    return Embedded(path, lease_ttl_ms=lease_ttl_ms, heartbeat_ms=heartbeat_ms,
                    recovery_window_ms=recovery_window_ms, max_request_ms=max_request_ms,
                    prices=prices, audit=audit, backend=backend, otlp_endpoint=otlp_endpoint,
                    gc=gc, uvloop=uvloop, commit_on_loop=commit_on_loop,
                    sync_mode=sync_mode)
