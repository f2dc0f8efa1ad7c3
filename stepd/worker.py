"""`Worker`: runs step bodies for the leases a daemon offers.

::

    worker = stepd.Worker(client).register(support)     # 100 slots by default
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
import logging
import os
import socket
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Final

import anyio
import anyio.abc
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread

from stepd._bodies import Active, Body, Definition, Runner
from stepd._connections import Connections
from stepd._errors import Invalid
from stepd._heartbeats import Heartbeats
from stepd._leases import LeaseProtocol
from stepd._local import LocalSteps
from stepd._manifest import PROTOCOL_VERSION, check_protocol_version
from stepd._serving import Serving
from stepd._sticky import DEFAULT_CACHE_BYTES, DEFAULT_CACHE_TTL_S, StickyHistory
from stepd._work_sessions import SessionAcquired, WorkSessions
from stepd.actors import Waiter, current_time
from stepd.workflow import Workflow

if TYPE_CHECKING:
    import httpx

    from stepd._http1 import Http1Client
    from stepd.client import AsyncClient, Client
    from stepd.embedded import Embedded

__all__ = ["Worker"]

log = logging.getLogger("stepd.worker")

DEFAULT_CONCURRENCY: Final = 100
"""Slots of a worker by default (issue 16). At 8, one worker process held B (1000 x seq(3),
100 runs in flight) to a fraction of what the daemon can do, and cost more CPU per step on
both sides (credit and leases trickle in small batches); at 100 a worker takes what one
client keeps in flight. Slots cost nothing until used: runner tasks and the sync bodies'
threads are made on demand. Temporal's Python SDK defaults to 100 activity slots too."""
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


class Worker(Serving, Connections, LeaseProtocol, Heartbeats, WorkSessions, LocalSteps,
             StickyHistory):
    """Serves the step bodies of registered workflows.

    Args:
        target: a `stepd.Client` / `stepd.AsyncClient` (its URL, key and timeout
            are used; the worker opens its own connections), a daemon URL, or an
            embedded daemon (`stepd.embedded`).
        concurrency: bodies run at once (async and sync together); sync bodies
            run in a thread pool of this size (threads made on demand). Default
            100 (`DEFAULT_CONCURRENCY`); lower it for bodies that each hold much
            memory or a scarce resource.
        name: the worker's name in the journal and ``workers()``; default
            ``<hostname>-<pid>``.
        build_id: an identifier of this worker's code build, sent at register.
        key: the API key when ``target`` is a URL (a client's key otherwise).
        transport: ``"auto"`` (WebSocket, falling back to HTTP long-poll),
            ``"websocket"`` or ``"http"``. Ignored for an embedded daemon.
        grace: seconds `stop` lets running bodies finish, by default.
        timeout: seconds a connection attempt or a request may take.
        resources: what this worker offers worker sessions (``{"gpu": "a100"}``);
            a session is created on a worker whose resources match its requirements.
        max_sessions: how many worker sessions it holds at once; 0 (default): none
            (docs/affinity.md "Worker sessions").
        on_session_acquired: called with a `SessionAcquired` before the first step
            of each session this worker acquires (also `Worker.on_session_acquired`).
        local_steps: run a workflow's ``"local": true`` steps inside this worker,
            right after the task step before them (AFFINITY.md "Local steps";
            `stepd._local`). Off by default: local steps then come as ordinary
            leases. Declared at register in the capability manifest.
        protocol_version: the protocol version to register with (default: the
            newest this SDK speaks, 1.20). Below 1.18 the worker declares no
            capability: ``local_steps``, ``max_sessions`` and
            ``sticky_cache_capacity`` must be off.
        worker_id: register as this already registered worker (a replacement
            process taking over its identity: its leases, its sticky routing).
        sticky_cache_capacity: runs whose history the sticky cache keeps; 0
            (the default) turns sticky execution off (docs/affinity.md).
        sticky_cache_bytes: the most encoded history bytes the cache keeps.
        sticky_cache_ttl: seconds an entry is kept after it was stored.
        sticky_schedule_ms: how long the daemon holds a run's next step for
            this worker when it ran the previous one (None: the daemon's 5000).

    Attributes:
        running: leases held now (bodies running, or being reported).
        stopping: True once `stop` was called (or the worker stops itself).

    Raises:
        Invalid: a bad argument.
    """

    def __init__(
        self,
        target: Client | AsyncClient | Embedded | str,
        concurrency: int = DEFAULT_CONCURRENCY,
        name: str | None = None,
        build_id: str | None = None,
        *,
        key: str | None = None,
        transport: str = "auto",
        grace: float = DEFAULT_GRACE_S,
        timeout: float = DEFAULT_TIMEOUT_S,
        resources: Mapping[str, Any] | None = None,
        max_sessions: int = 0,
        on_session_acquired: Callable[[SessionAcquired], Any] | None = None,
        local_steps: bool = False,
        protocol_version: str = PROTOCOL_VERSION,
        worker_id: str | None = None,
        sticky_cache_capacity: int = 0,
        sticky_cache_bytes: int = DEFAULT_CACHE_BYTES,
        sticky_cache_ttl: float = DEFAULT_CACHE_TTL_S,
        sticky_schedule_ms: int | None = None,
    ) -> None:
        from stepd.channels.http import base_url
        from stepd.client import AsyncClient, Client
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
            self.url = base_url(target)
        else:
            raise Invalid(f"must be a Client, a URL or a stepd.embedded daemon, got {target!r}",
                          field="target")
        self.concurrency = concurrency
        self.local_steps = bool(local_steps)
        self.name = name if name is not None else _default_name()
        self.build_id = build_id
        self.transport_choice = transport
        self.grace = float(grace)
        if worker_id is not None and (not isinstance(worker_id, str)
                                      or not worker_id.startswith("w_")):
            raise Invalid("must be a worker id returned by an earlier register (w_...)",
                          field="worker_id")
        self.worker_id: str | None = worker_id
        self._init_sticky(sticky_cache_capacity, sticky_cache_bytes, sticky_cache_ttl,
                          sticky_schedule_ms)
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

        # Loop state.
        self._tg: anyio.abc.TaskGroup | None = None
        self._active: dict[str, Active] = {}
        self._idle: list[Runner] = []
        self._runners = 0
        self._handoffs = 0  # leases a runner took as its own call returned (`_bodies.REPORTING`)
        self._done_running = False
        self.running = 0
        self.stopping = False
        self._grace_deadline: float | None = None
        self._stop_requested = Waiter()
        self._slots_waiter: Waiter | None = None
        self._terminal_runs: collections.OrderedDict[str, float] = collections.OrderedDict()
        self._fatal: list[BaseException] = []
        self._http: httpx.AsyncClient | Http1Client | None = None
        self._threads: anyio.CapacityLimiter | None = None
        self._init_connections()
        self._init_heartbeats()
        self._init_work_sessions(resources, max_sessions, on_session_acquired)
        self.protocol_version = check_protocol_version(protocol_version, self.local_steps,
                                                       sessions=self.max_sessions > 0,
                                                       sticky=self.sticky_cache is not None)

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
    def errors(self) -> list[BaseException]:
        """Fatal worker errors seen so far (``not_started`` answers...)."""
        return list(self._fatal)

    # ------------------------------------------------------------------ running

    async def _run_here(self) -> None:
        self._done = anyio.Event()
        self._threads = anyio.CapacityLimiter(self.concurrency)
        daemon = self._daemon
        if daemon is None:
            from stepd.channels.http import worker_http

            self._http = worker_http(self.url or "", self.key, self.timeout, self._trust_env)
        else:
            daemon._attach(self)
        with self._lock:
            self._token = anyio.lowlevel.current_token()
            self._loop_thread = threading.get_ident()
            pre, self._pre_stop = self._pre_stop, None
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                tg.start_soon(self._connection_loop, name="stepd worker connection")
                tg.start_soon(self._lifecycle, name="stepd worker lifecycle")
                tg.start_soon(self._run_ticker, name="stepd worker heartbeats")
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
                     self.running)
        self._stop_requested.set()
        self._slots_changed()

    async def _wait_stopped(self) -> None:
        if self._ran and not self._done_thread.is_set():
            await self._done.wait()

    async def _lifecycle(self) -> None:
        """Graceful stop (STYLE.md rule 22): stop taking, grace, cancel, wait, finish."""
        await self._stop_requested.wait()
        self.stopping = True
        if self._channel is not None:
            self._channel.stop_taking()
        self._slots_changed()
        while self.running > 0:
            assert self._grace_deadline is not None
            left = self._grace_deadline - current_time()
            if left <= 0:
                break
            with anyio.move_on_after(left):
                await self._wait_slots()
        for active in list(self._active.values()):
            if active.ctx._cancel("shutdown"):
                log.warning("worker %s: cancelling %s/%s (lease %s) after the grace period",
                            self.name, active.ctx.run_id, active.ctx.step_id, active.ctx.lease_id)
            if active.in_body:
                active.scope.cancel()  # a sync body's thread is abandoned
        while self.running > 0:
            await self._wait_slots()
        await self._close_sessions()
        self._finish()

    def _finish(self) -> None:
        """Every lease is reported: end the ticker, the runners and the connection."""
        self._done_running = True
        if self._ticker_scope is not None:
            self._ticker_scope.cancel()  # no body runs: no heartbeat to start
        idle, self._idle = self._idle, []
        for runner in idle:
            runner.lease = None
            if runner.waiter is not None:
                runner.waiter.set()
        self._finished_waiter.set()
        if self._channel is not None:
            self._channel.end()
        if not self._in_pump and self._session_scope is not None:
            self._session_scope.cancel()

    # ------------------------------------------------------------------ slots

    async def _wait_slots(self) -> None:
        """Until the next change of slots (a lease ended, a stop began)."""
        waiter = self._slots_waiter
        if waiter is None:
            waiter = self._slots_waiter = Waiter()
        await waiter.wait()

    def _slots_changed(self) -> None:
        channel = self._channel
        if channel is not None:
            channel.slots_changed()
        waiter = self._slots_waiter
        if waiter is not None:
            self._slots_waiter = None
            waiter.set()
