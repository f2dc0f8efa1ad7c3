"""`Worker`: runs step bodies for the leases a daemon offers.

::

    worker = stepd.Worker(client, concurrency=8).register(support)
    worker.serve()                 # blocks (any thread); worker.stop() from elsewhere
    await worker.run()             # or inside an event loop (asyncio or trio)

Bodies. A body is ``async def`` or a plain function (run in a thread pool of
``concurrency`` threads). It is called ``body(ctx, input, steps)``: its
`StepContext`, its rendered input, the earlier steps' outputs by step id. A
body may take fewer positional parameters, ``body(ctx, input)``, ``body(ctx)``
or ``body()``: the worker passes the first ones of (ctx, input, steps), decided
once when the workflow is registered. It returns the step's output (any JSON)
or raises: `stepd.Retryable` (class ``retryable``), `stepd.StepFailure(cls,
msg)` (class ``cls``), anything else (class ``fatal``, with the message
``"<ExceptionType>: <message>"``; the traceback is logged here, never sent).

Transports. On a URL the worker connects over the WebSocket (push: it grants
credit for its free slots and leases arrive the moment work appears), and
falls back to HTTP long-poll when the WebSocket is refused (the upgrade is
answered with anything but 101, 401, 403 or 503). On trio it uses
``websockets.trio`` (websockets >= 17), else HTTP long-poll. It reconnects with
bounded, jittered backoff and registers again with its ``worker_id``, so the
leases it holds stay its own across reconnects. On an embedded daemon it uses
the in-process transport and push. ``transport="http"`` or ``"websocket"``
forces one.

The protocol, per lease (PROTOCOL.md):

* a lease for a workflow, version, definition hash or body this worker did not
  register is failed ``unservable`` before anything runs;
* ``started`` is sent before the body runs. For ``at_most_once`` steps the body
  waits for its answer; for ``at_least_once`` steps the body starts at once and
  ``complete`` waits for ``started``'s answer (a refused ``started`` cancels the
  body);
* heartbeats every ``heartbeat_ms`` (from ``register``) while the body runs;
  ``ctx.heartbeat(progress)`` asks for one sooner (coalesced, last progress wins);
* every 409 is answered by its reason: ``already_applied`` is success, post
  nothing more; ``fenced`` abandons the lease (a running body is cancelled);
  ``run_terminal`` stops every body of that run and takes nothing more of it
  (the run id is remembered for ten minutes); ``not_started`` is a worker bug:
  logged at error level, the worker stops (gracefully) and ``run()``/``serve()``
  raise `stepd.NotStarted`;
* a WebSocket ``cancel`` push, or a heartbeat answered ``fenced``/``run_terminal``
  (404: ``lost``), cancels the body through its context.

Stopping. ``stop(grace)`` (thread-safe): take no more leases (no more credit;
a held claim is cancelled; an embedded push session is closed), let running
bodies finish within ``grace`` seconds, then cancel them and fail them back as
``retryable``. A lease that arrives while stopping (credit granted before) is
failed ``unservable`` at once, without spending retry budget. If ``run()`` is
cancelled from outside, bodies are cancelled and failed back as ``retryable``
(shielded, bounded). No lease is dropped silently.
"""

from __future__ import annotations

import collections
import functools
import itertools
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Final

import anyio
import anyio.abc
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread
import httpx

from stepd._bodies import Active, Body, Definition
from stepd._channels import (
    Channel,
    HttpChannel,
    InProcessChannel,
    Lost,
    Refused,
    WebSocketChannel,
    classify_handshake_error,
    websocket_connect,
)
from stepd._errors import Invalid, NotFound, StepdError, Unavailable
from stepd._http1 import Http1Client, wants_httpx
from stepd._leases import LeaseProtocol, backoff
from stepd.actors import Waiter
from stepd.workflow import Workflow

if TYPE_CHECKING:
    from stepd.client import AsyncClient, Client
    from stepd.embedded import Embedded

__all__ = ["Worker"]

log = logging.getLogger("stepd.worker")

PROTOCOL_VERSION: Final = "1.0"
DEFAULT_GRACE_S: Final = 10.0
DEFAULT_TIMEOUT_S: Final = 10.0


def _default_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"[:128]


def _leaves(group: BaseExceptionGroup[Any]) -> list[BaseException]:
    out: list[BaseException] = []
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            out.extend(_leaves(exc))
        else:
            out.append(exc)
    return out


# --------------------------------------------------------------------------- the worker


class Worker(LeaseProtocol):
    """Serves the step bodies of registered workflows.

    Args:
        target: a `stepd.Client` / `stepd.AsyncClient` (its URL, key and timeout
            are used; the worker opens its own connections), a daemon URL, or an
            embedded daemon (`stepd.embedded`).
        concurrency: bodies run at once (async and sync together); sync bodies
            run in a thread pool of this size.
        name: the worker's name in the journal and ``workers()``; default
            ``<hostname>-<pid>``.
        build_id: an identifier of this worker's code build, sent at register.
        key: the API key when ``target`` is a URL (a client's key otherwise).
        transport: ``"auto"`` (WebSocket, falling back to HTTP long-poll),
            ``"websocket"`` or ``"http"``. Ignored for an embedded daemon.
        grace: seconds `stop` lets running bodies finish, by default.
        timeout: seconds a connection attempt or a request may take.

    Raises:
        Invalid: a bad argument.
    """

    def __init__(
        self,
        target: Client | AsyncClient | Embedded | str,
        concurrency: int = 8,
        name: str | None = None,
        build_id: str | None = None,
        *,
        key: str | None = None,
        transport: str = "auto",
        grace: float = DEFAULT_GRACE_S,
        timeout: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        from stepd.client import AsyncClient, Client, _base_url
        from stepd.embedded import Embedded

        if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
            raise Invalid("must be an integer >= 1", field="concurrency")
        if transport not in ("auto", "websocket", "http"):
            raise Invalid('must be "auto", "websocket" or "http"', field="transport")
        self._daemon: Embedded | None = None
        self.url: str | None = None
        self.key = key
        self.timeout = timeout
        self._trust_env = True
        if isinstance(target, Embedded):
            self._daemon = target
        elif isinstance(target, (Client, AsyncClient)):
            self._daemon = target._daemon
            self.url = target.url
            self.key = key if key is not None else target.key
            self.timeout = target.timeout
            self._trust_env = target.trust_env
        elif isinstance(target, str):
            self.url = _base_url(target)
        else:
            raise Invalid(f"must be a Client, a URL or a stepd.embedded daemon, got {target!r}",
                          field="target")
        self.concurrency = concurrency
        self.name = name if name is not None else _default_name()
        self.build_id = build_id
        self.transport_choice = transport
        self.grace = float(grace)
        self.worker_id: str | None = None
        self._defs: dict[tuple[str, str | None], Definition] = {}

        # Thread-safe control (stop() from any thread).
        self._lock = threading.Lock()
        self._token: Any = None
        self._loop_thread: int | None = None
        self._pre_stop: float | None = None
        self._ran = False
        self._done_thread = threading.Event()
        self._ready_thread = threading.Event()
        self._task_status: anyio.abc.TaskStatus[Worker] = anyio.TASK_STATUS_IGNORED

        # Loop state, created by run().
        self._tg: anyio.abc.TaskGroup | None = None
        self._channel: Channel | None = None
        self._channel_kind: str | None = None
        self._fallback = False
        self._active: dict[str, Active] = {}
        self._beats_due: list[tuple[float, int, Active, anyio.CancelScope]] = []
        self._beats_seq = itertools.count()
        self._beats_wake = Waiter()
        self._beats_scope: anyio.CancelScope | None = None  # made in the loop, by run()
        self._running = 0
        self._stopping = False
        self._grace_deadline: float | None = None
        self._terminal_runs: collections.OrderedDict[str, float] = collections.OrderedDict()
        self._fatal: list[BaseException] = []
        self._http: httpx.AsyncClient | Http1Client | None = None
        self._threads: anyio.CapacityLimiter | None = None
        self._heartbeat_s = 10.0
        self._lease_ttl_s = 30.0
        self._max_request_ms = 20_000
        self._attempt = 0
        self._in_pump = False
        self._session_scope: anyio.CancelScope | None = None

    def __repr__(self) -> str:
        where = self.url or repr(self._daemon)
        return f"<stepd.Worker {self.name!r} {where} id={self.worker_id}>"

    # ------------------------------------------------------------------ registration

    def register(self, *workflows: Workflow, bodies: Mapping[str, Callable[..., Any]] | None = None
                 ) -> Worker:
        """Hold these workflows: their definitions are registered and their bodies served.

        Args:
            workflows: `stepd.Workflow` builders; their callables are the bodies.
            bodies: bodies by name for steps given by name only (``.then("x")``).

        Returns:
            The worker itself.

        Raises:
            Invalid: an invalid definition, a body with an unusable signature, or
                a workflow (name and version) registered twice.
            RuntimeError: the worker is running already.
        """
        if self._ran:
            raise RuntimeError("register workflows before the worker runs")
        extra = dict(bodies or {})
        for wf in workflows:
            if not isinstance(wf, Workflow):
                raise Invalid(f"must be a stepd.Workflow, got {wf!r}", field="workflows")
            wire = wf.to_json()
            key = (wf.name, wf.version)
            if key in self._defs:
                raise Invalid(f"workflow {wf.name!r} version {wf.version!r} is registered twice",
                              field="workflows", definition=wf.name)
            held: dict[str, Body] = {}
            for body_name, fn in wf.bodies.items():
                held[body_name] = Body.of(body_name, fn, wf.name)
            for step in wire["steps"]:
                body_name = step.get("body")
                if body_name is None or body_name in held:
                    continue
                if body_name in extra:
                    held[body_name] = Body.of(body_name, extra[body_name], wf.name)
                else:
                    log.info("worker %s holds no body %r of workflow %r: its leases will be "
                             "failed unservable (another worker may hold it)", self.name,
                             body_name, wf.name)
            self._defs[key] = Definition(wf.name, wf.version, wire, wf.definition_hash, held)
        return self

    # ------------------------------------------------------------------ introspection

    @property
    def transport(self) -> str | None:
        """The transport of the current connection: ``websocket``, ``http``, ``inprocess``."""
        return self._channel_kind

    @property
    def running(self) -> int:
        """Leases held now (bodies running, or being reported)."""
        return self._running

    @property
    def stopping(self) -> bool:
        return self._stopping

    @property
    def finished(self) -> anyio.Event:
        return self._finished

    @property
    def errors(self) -> list[BaseException]:
        """Fatal worker errors seen so far (``not_started`` answers...)."""
        return list(self._fatal)

    # ------------------------------------------------------------------ running

    def serve(self, *, backend: str = "asyncio", handle_signals: bool = True) -> None:
        """Run until stopped; blocks. Usable from any thread.

        On the main thread, SIGINT and SIGTERM stop the worker gracefully (a
        second one cancels the running bodies at once, failing them back).

        Args:
            backend: the event loop for a network worker, ``"asyncio"`` or
                ``"trio"`` (a worker of an embedded daemon runs on its loop).
            handle_signals: install the SIGINT/SIGTERM handling (main thread only).

        Raises:
            Invalid: a definition refused at register (``field`` names it).
            Unauthorized, Forbidden: the key.
            NotStarted: the daemon answered ``not_started`` (a worker bug).
            RuntimeError: the worker ran already.
        """
        daemon = self._daemon
        if daemon is not None:
            self._serve_embedded(daemon)
            return
        anyio.run(self._serve_main, handle_signals, backend=backend,
                  backend_options=_loop_options(backend))

    def _serve_embedded(self, daemon: Embedded) -> None:
        portal = daemon._portal
        if portal is None:
            daemon.call_blocking(self.run)
            return
        future = portal.start_task_soon(self.run)
        interrupts = 0
        while True:
            try:
                future.result()
                return
            except KeyboardInterrupt:
                interrupts += 1
                self.stop(self.grace if interrupts == 1 else 0.0)

    async def _serve_main(self, handle_signals: bool) -> None:
        if not handle_signals or threading.current_thread() is not threading.main_thread():
            await self.run()
            return
        error: list[BaseException] = []
        async with anyio.create_task_group() as tg:

            async def watch() -> None:
                try:
                    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                        count = 0
                        async for _ in signals:
                            count += 1
                            self.stop(self.grace if count == 1 else 0.0)
                except NotImplementedError:  # no signal support on this platform/loop
                    return

            async def main() -> None:
                try:
                    await self.run()
                except Exception as exc:  # noqa: BLE001 - re-raised below, outside the task group
                    error.append(exc)
                finally:
                    tg.cancel_scope.cancel()

            tg.start_soon(watch)
            tg.start_soon(main)
        if error:
            raise error[0]

    async def run(self, *, task_status: anyio.abc.TaskStatus[Worker] = anyio.TASK_STATUS_IGNORED
                  ) -> None:
        """Run in the current event loop (asyncio or trio) until stopped.

        ``await tg.start(worker.run)`` returns once the worker has registered
        (its workflows can be started from then on).

        Cancelling it cancels the running bodies and fails them back as
        ``retryable`` (shielded, bounded), then re-raises the cancellation.

        Raises:
            as `serve`.
        """
        daemon = self._daemon
        if daemon is not None and not daemon.on_loop():
            await self._run_elsewhere(daemon, task_status)
            return
        with self._lock:
            if self._ran:
                raise RuntimeError("a Worker runs once; create another to run again")
            self._ran = True
        if not self._defs:
            self._done_thread.set()
            raise Invalid("register at least one workflow before running", field="workflows")
        self._task_status = task_status
        await self._run_here()

    async def _run_elsewhere(self, daemon: Embedded, task_status: anyio.abc.TaskStatus[Worker]
                             ) -> None:
        """The embedded daemon's loop is another thread's: run the worker there."""
        error: list[BaseException] = []
        ended = threading.Event()

        def run_there() -> None:
            try:
                daemon.call_blocking(self.run)
            except Exception as exc:  # noqa: BLE001 - re-raised below, in this task
                error.append(exc)
            finally:
                ended.set()

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(functools.partial(anyio.to_thread.run_sync, run_there,
                                                abandon_on_cancel=True))
                while not (self._ready_thread.is_set() or ended.is_set()):
                    await anyio.to_thread.run_sync(self._ready_thread.wait, 0.05,
                                                   abandon_on_cancel=True)
                if self._ready_thread.is_set():
                    task_status.started(self)
        except anyio.get_cancelled_exc_class():
            self.stop(0.0)
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self._done_thread.wait, 30.0)
            raise
        if error:
            raise error[0]

    async def _run_here(self) -> None:
        self._finished = anyio.Event()
        self._stop_requested = anyio.Event()
        self._slots_ev = anyio.Event()
        self._channel_ready = anyio.Event()
        self._done = anyio.Event()
        self._threads = anyio.CapacityLimiter(self.concurrency)
        daemon = self._daemon
        if daemon is None:
            from stepd.client import _headers

            url = self.url or ""
            if wants_httpx(url, self._trust_env):
                self._http = httpx.AsyncClient(base_url=url, headers=_headers(self.key),
                                               timeout=self.timeout, trust_env=self._trust_env,
                                               http1=True, http2=False)
            else:  # plain http: the lean client (stepd._http1), a quarter of httpx's CPU
                self._http = Http1Client(url, _headers(self.key))
        else:
            daemon._attach(self)
        with self._lock:
            self._token = anyio.lowlevel.current_token()
            self._loop_thread = threading.get_ident()
            pre, self._pre_stop = self._pre_stop, None
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                self._beats_due.clear()
                self._beats_scope = anyio.CancelScope()
                tg.start_soon(self._connection_loop, name="stepd worker connection")
                tg.start_soon(self._lifecycle, name="stepd worker lifecycle")
                tg.start_soon(self._run_heartbeat_starter, name="stepd worker heartbeats")
                if pre is not None:
                    self._stop_here(pre)
        except BaseExceptionGroup as group:
            leaves = _leaves(group)
            cancelled = anyio.get_cancelled_exc_class()
            real = [e for e in leaves if not isinstance(e, cancelled)]
            if len(real) == 1:
                raise real[0] from None
            raise
        finally:
            with self._lock:
                self._token = None
            self._tg = None
            if self._http is not None:
                with anyio.CancelScope(shield=True):
                    await self._http.aclose()
            if daemon is not None:
                daemon._detach(self)
            self._done.set()
            self._done_thread.set()
        if self._fatal:
            raise self._fatal[0]

    # ------------------------------------------------------------------ stopping

    def stop(self, grace: float | None = None) -> None:
        """Stop taking leases; let running bodies finish within ``grace`` seconds.

        Then the bodies still running are cancelled and failed back as
        ``retryable``; `serve` returns (or `run` returns) once every lease is
        reported. Thread-safe and idempotent; a second call may shorten the
        grace period (``stop(0)``: cancel now). Returns at once.

        Args:
            grace: seconds; None: the worker's ``grace``.
        """
        g = self.grace if grace is None else max(0.0, float(grace))
        with self._lock:
            token = self._token
            if token is None:
                self._pre_stop = g if self._pre_stop is None else min(self._pre_stop, g)
                return
        if threading.get_ident() == self._loop_thread:
            self._stop_here(g)
            return
        try:
            anyio.from_thread.run_sync(self._stop_here, g, token=token)
        except RuntimeError:
            pass  # the loop has ended: the worker has stopped already

    def _stop_here(self, grace: float) -> None:
        if self._token is None:
            self._pre_stop = grace if self._pre_stop is None else min(self._pre_stop, grace)
            return
        deadline = anyio.current_time() + grace
        if self._grace_deadline is None or deadline < self._grace_deadline:
            self._grace_deadline = deadline
        if not self._stop_requested.is_set():
            log.info("worker %s stopping (grace %.1f s, %d lease(s) held)", self.name, grace,
                     self._running)
        self._stop_requested.set()
        self._slots_changed()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until the worker has registered (or ended); for code on other threads.

        ``threading.Thread(target=worker.serve).start(); worker.wait_ready(10)``:
        the worker's workflows can be started once this returns True.

        Returns:
            True once registered; False if ``timeout`` passed or the worker ended first.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._ready_thread.is_set():
            if self._done_thread.is_set():
                return self._ready_thread.is_set()
            left = 0.05 if deadline is None else min(0.05, deadline - time.monotonic())
            if left <= 0:
                return False
            self._ready_thread.wait(left)
        return True

    async def _wait_stopped(self) -> None:
        if self._ran and not self._done_thread.is_set():
            await self._done.wait()

    async def _run_heartbeat_starter(self) -> None:
        assert self._beats_scope is not None
        with self._beats_scope:
            await self._heartbeat_starter()

    async def _lifecycle(self) -> None:
        """Graceful stop (STYLE.md rule 22): stop taking, grace, cancel, wait, finish."""
        await self._stop_requested.wait()
        self._stopping = True
        if self._channel is not None:
            self._channel.stop_taking()
        self._slots_changed()
        while self._running > 0:
            assert self._grace_deadline is not None
            left = self._grace_deadline - anyio.current_time()
            if left <= 0:
                break
            changed = self._slots_ev
            with anyio.move_on_after(left):
                await changed.wait()
        for active in list(self._active.values()):
            if active.ctx._cancel("shutdown"):
                log.warning("worker %s: cancelling %s/%s (lease %s) after the grace period",
                            self.name, active.ctx.run_id, active.ctx.step_id, active.ctx.lease_id)
            active.hard_scope.cancel()
        while self._running > 0:
            await self._slots_ev.wait()
        if self._beats_scope is not None:
            self._beats_scope.cancel()  # no body runs: no heartbeat to start
        self._finished.set()
        if not self._in_pump and self._session_scope is not None:
            self._session_scope.cancel()

    # ------------------------------------------------------------------ slots

    def slots_event(self) -> anyio.Event:
        """An event set at the next change of slots (a lease ended, a stop began)."""
        return self._slots_ev

    def _slots_changed(self) -> None:
        event, self._slots_ev = self._slots_ev, anyio.Event()
        event.set()

    # ------------------------------------------------------------------ connections

    def _kind(self) -> str:
        if self._daemon is not None:
            return "inprocess"
        if self.transport_choice == "http" or self._fallback:
            return "http"
        if self.transport_choice == "websocket":
            return "websocket"
        if _on_trio():
            try:
                import websockets.trio.client  # noqa: F401
            except ImportError:
                return "http"
        return "websocket"

    async def _connection_loop(self) -> None:
        while not self._finished.is_set():
            kind = self._kind()
            scope = anyio.CancelScope()
            self._session_scope = scope
            try:
                with scope:
                    if self._finished.is_set():
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
                await self._finished.wait()

    async def _session(self, kind: str) -> None:
        if kind == "inprocess":
            assert self._daemon is not None
            await self._serve_channel(InProcessChannel(self._daemon))
        elif kind == "http":
            assert self._http is not None
            await self._serve_channel(HttpChannel(self._http, self.timeout))
        else:
            await self._websocket_session()

    async def _websocket_session(self) -> None:
        from websockets.exceptions import WebSocketException

        assert self.url is not None
        entered = False
        try:
            async with websocket_connect(self.url, self.key, trust_env=self._trust_env,
                                         open_timeout=self.timeout, trio=_on_trio()) as ws:
                entered = True
                await self._serve_channel(WebSocketChannel(ws))
        except (OSError, TimeoutError, WebSocketException) as exc:
            if not entered:
                raise classify_handshake_error(exc) from exc
            raise Lost(f"the WebSocket failed: {exc!r}") from exc

    def _register_body(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "name": self.name,
            "protocol_version": PROTOCOL_VERSION,
            "concurrency": self.concurrency,
            "definitions": [d.wire for d in self._defs.values()],
        }
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
        ready, self._channel_ready = self._channel_ready, anyio.Event()
        ready.set()
        if self._stopping:
            channel.stop_taking()
        log.info("worker %s registered as %s over %s", self.name, self.worker_id, channel.kind)
        if not self._ready_thread.is_set():
            self._ready_thread.set()
            self._task_status.started(self)
        try:
            self._in_pump = True
            await channel.pump(self, self._max_request_ms)
        finally:
            self._in_pump = False
            self._channel = None

    def _on_registered(self, answer: dict[str, Any]) -> None:
        self.worker_id = answer["worker_id"]
        self._heartbeat_s = max(0.001, int(answer.get("heartbeat_ms", 10_000)) / 1000)
        self._lease_ttl_s = max(0.001, int(answer.get("lease_ttl_ms", 30_000)) / 1000)
        self._max_request_ms = int(answer.get("max_request_ms", 30_000))
        for entry in answer.get("definitions") or ():
            held = self._defs.get((entry.get("name"), entry.get("version")))
            theirs = entry.get("definition_hash")
            if held is not None and isinstance(theirs, str) and theirs != held.definition_hash:
                log.warning("worker %s: the daemon hashes %s %s as %s, the SDK as %s; using the "
                            "daemon's", self.name, held.name, held.version, theirs,
                            held.definition_hash)
                held.definition_hash = theirs


def _on_trio() -> bool:
    """True inside a trio event loop (the websockets client differs)."""
    trio = sys.modules.get("trio")
    if trio is None:
        return False
    try:
        trio.lowlevel.current_trio_token()
    except RuntimeError:
        return False
    return True


def _loop_options(backend: str) -> dict[str, Any]:
    """asyncio on uvloop when it is installed: about a quarter less CPU per message."""
    if backend != "asyncio":
        return {}
    try:
        import uvloop  # noqa: F401
    except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
        return {}
    return {"use_uvloop": True}
