"""`Client` and `AsyncClient`: start runs, read them, wait for their results.

::

    client = stepd.Client("http://127.0.0.1:7707", key="...")   # or stepd.Client(daemon)
    run = client.start("support", {"ticket": 42}, idempotency_key="ticket:42")
    client.status(run).definition_hash
    print(run.result(timeout=60))

`start` returns a `RunHandle` (an `AsyncRunHandle` from `AsyncClient`): the
run id (``str(run)``, ``run.run_id``), whether this call created it
(``run.created``; False when the idempotency key was used before) and the
client's calls bound to the run (``run.status()``, ``run.result()``, ...).
Every client method takes a handle or a bare run id.

Transports. A URL means HTTP/1.1 with keep-alive and ``Authorization: Bearer
<key>``: `Client` through httpx; `AsyncClient` through `stepd._http1` (a lean
keep-alive client, about a quarter of httpx's CPU per request at 100 in
flight) for ``http://`` URLs, and through httpx for ``https://`` or when a
proxy from the environment applies. An embedded daemon
(`stepd.embedded`) means the in-process transport: the same calls, the same
errors, no socket.

Errors are typed (`stepd._errors` lists them): `NotFound`, `Invalid` (with
``field``), `Unauthorized`, `Forbidden`, `Unprocessable` (an unknown workflow),
the `Conflict` subclasses (`RunTerminal` when signalling or cancelling a run
that is over, `BudgetExceeded` with ``budget`` when a signal is refused),
`Unavailable`. Idempotent calls (reads, ``result``, a ``start`` with an
idempotency key) are retried on 503 and on connection failures, a few times
with jittered exponential backoff; the others raise at once. A connection
failure is raised as `Unavailable` (its cause is the transport's error).
"""

from __future__ import annotations

import datetime
import math
import time
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self

from stepd import _wire
from stepd._client_common import (
    DEFAULT_RETRIES,
    DEFAULT_TIMEOUT_S,
    Handle,
    embedded_of,
    outcome,
    run_id_of,
    start_call,
)
from stepd._listing import AsyncRunList, RunList, check_size, list_query
from stepd._runs import TERMINAL, RunStatus
from stepd._schedules import ScheduleCalls
from stepd.async_client import AsyncClient, AsyncRunHandle
from stepd.channels.http import SyncHttp, base_url
from stepd.channels.inprocess import SyncEmbedded
from stepd.sansio.durations import Duration
from stepd.sansio.errors import Invalid

if TYPE_CHECKING:
    from stepd.embedded import Embedded
    from stepd.workflow import Workflow

__all__ = ["AsyncClient", "AsyncRunHandle", "AsyncRunList", "Client", "RunHandle", "RunList"]


class RunHandle(Handle):
    """A run, as `Client.start` returns it: its id and the client's calls bound to it.

    ``str(handle)`` is the run id; a handle equals its run id (``handle == "r_..."``).

    Attributes:
        run_id: the run id.
        created: False when ``start`` found the idempotency key already used
            (this is the original run); True otherwise (also for `Client.handle`).
    """

    __slots__ = ()
    _client: Client

    def __init__(self, client: Client, run_id: str, created: bool = True) -> None:
        super().__init__(client, run_id, created)

    def status(self) -> RunStatus:
        """`Client.status` of this run."""
        return self._client.status(self.run_id)

    def result(self, timeout: float | None = None) -> Any:
        """`Client.result` of this run."""
        return self._client.result(self.run_id, timeout=timeout)

    def signal(self, name: str, payload: Any = None) -> None:
        """`Client.signal` to this run."""
        self._client.signal(self.run_id, name, payload)

    def cancel(self, reason: str | None = None) -> None:
        """`Client.cancel` of this run."""
        self._client.cancel(self.run_id, reason)

    def retry(self) -> dict[str, Any]:
        """`Client.retry` of this run."""
        return self._client.retry(self.run_id)

    def fork(self, from_step: str, *, idempotency_key: str | None = None) -> RunHandle:
        """`Client.fork` of this run."""
        return self._client.fork(self.run_id, from_step, idempotency_key=idempotency_key)

    def journal(self) -> list[dict[str, Any]]:
        """`Client.journal` of this run."""
        return self._client.journal(self.run_id)

    def export(self) -> dict[str, Any]:
        """`Client.export` of this run."""
        return self._client.export(self.run_id)



# --------------------------------------------------------------------------- the client


class Client(ScheduleCalls):
    """A blocking client of a stepd daemon.

    Args:
        target: the daemon's URL (``http://127.0.0.1:7707``), or an embedded
            daemon (`stepd.embedded`).
        key: the API key (``Authorization: Bearer <key>``); None without auth.
        timeout: seconds any one request may take (long-polls add their hold).
        retries: how many times an idempotent call is retried on 503 or a
            connection failure.
        trust_env: let httpx read proxy settings from the environment.

    Use it as a context manager, or call `close`, to release its connections.
    A client may be shared between threads (httpx's pool is thread-safe).
    """

    def __init__(self, target: str | Embedded, key: str | None = None, *,
                 timeout: float = DEFAULT_TIMEOUT_S, retries: int = DEFAULT_RETRIES,
                 trust_env: bool = True) -> None:
        daemon = embedded_of(target)
        self.url: str | None = None
        self.key = key
        self.timeout = timeout
        self.retries = retries
        self.trust_env = trust_env
        self._daemon = daemon
        self._backend: SyncHttp | SyncEmbedded
        if daemon is not None:
            self._backend = SyncEmbedded(daemon)
        elif isinstance(target, str):
            self._backend = SyncHttp(target, key, timeout, retries, trust_env)
            self.url = base_url(target)
        else:
            raise Invalid(f"must be a URL or a stepd.embedded daemon, got {target!r}",
                          field="target")

    def __repr__(self) -> str:
        return f"<stepd.Client {self.url or self._daemon!r}>"

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection pool (an embedded daemon stays open)."""
        self._backend.close()

    def handle(self, run_id: str) -> RunHandle:
        """A handle of an existing run (nothing is sent)."""
        return RunHandle(self, run_id_of(run_id))

    def start(
        self,
        workflow: Workflow | str,
        input: Any = None,
        *,
        idempotency_key: str | None = None,
        correlation: Any = None,
        version: str | None = None,
        deadline: Duration | None = None,
    ) -> RunHandle:
        """Start a run (``POST /v1/api/runs``).

        Args:
            workflow: the workflow name, or its `stepd.Workflow` (which also pins
                its version unless ``version`` is given).
            input: the run's input (any JSON value).
            idempotency_key: a key used before returns the original run
                (``created`` False) instead of starting another. Keys are global
                across workflows.
            correlation: any JSON value kept with the run (``run.correlation``).
            version: the version to start; None: the most recently registered.
            deadline: bound on the run's whole duration (ms, ``"1h"``, a
                timedelta); None: the definition's, if any.

        Returns:
            The run's `RunHandle`.

        Raises:
            Invalid: a malformed argument (``field`` names it).
            Unprocessable: no worker registered this workflow (and version).
            Unauthorized, Forbidden: the key.
            Unavailable: the daemon is shutting down or unreachable.
        """
        call = start_call(workflow, input, idempotency_key=idempotency_key,
                           correlation=correlation, version=version, deadline=deadline)
        answer = self._backend.send(call)
        return RunHandle(self, answer["run_id"], bool(answer.get("created", True)))

    def status(self, run: RunHandle | str) -> RunStatus:
        """The run's status (``GET /v1/api/runs/{run}``).

        Raises:
            NotFound: no such run.
        """
        return RunStatus.from_json(self._backend.send(_wire.get_run(run_id_of(run))))

    def result(self, run: RunHandle | str, timeout: float | None = None) -> Any:
        """Wait until the run ends; return its result.

        Args:
            run: the run.
            timeout: seconds to wait at most; None waits as long as it takes.

        Returns:
            The run's result (the output of its last step).

        Raises:
            RunFailed: the run failed (``reason``, ``message``, ``step_id``, ``error``).
            RunCancelled: it was cancelled.
            RunTimedOut: it passed its deadline.
            TimeoutError: ``timeout`` passed first (the run goes on).
            NotFound: no such run.
        """
        run_id = run_id_of(run)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = math.inf if deadline is None else deadline - time.monotonic()
            wait_ms = int(min(left * 1000, _wire.RESULT_CHUNK_MS)) if left > 0 else 0
            answer = self._backend.send(_wire.result(run_id, wait_ms))
            if answer["status"] in TERMINAL:
                return outcome(answer)
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"run {run_id} is still {answer['status']} after {timeout} s")

    def journal(self, run: RunHandle | str, *, after_seq: int = 0) -> list[dict[str, Any]]:
        """Every journal event of the run after ``after_seq``, in order (fetched in pages).

        Raises:
            NotFound: no such run.
        """
        run_id = run_id_of(run)
        events: list[dict[str, Any]] = []
        after = after_seq
        while True:
            page = self._backend.send(_wire.journal(run_id, after, _wire.JOURNAL_PAGE))["events"]
            events.extend(page)
            if len(page) < _wire.JOURNAL_PAGE:
                return events
            after = int(page[-1]["seq"])

    def export(self, run: RunHandle | str) -> dict[str, Any]:
        """Definition, version, hash, idempotency key, budget, state, journal and spans.

        Raises:
            NotFound: no such run.
        """
        return self._backend.send(_wire.export(run_id_of(run)))

    def signal(self, run: RunHandle | str, name: str, payload: Any = None) -> None:
        """Send the signal ``name`` (with ``payload``) to the run.

        Raises:
            BudgetExceeded: the ``wait`` it completes would breach ``budget``;
                nothing was recorded and the run keeps waiting.
            RunTerminal: the run is over.
            NotFound: no such run.
            Invalid: a bad name (``field`` ``name``) or a payload that is not JSON.
        """
        self._backend.send(_wire.signal(run_id_of(run), name, payload))

    def cancel(self, run: RunHandle | str, reason: str | None = None) -> None:
        """Cancel the run; its running steps' leases end with ``run_terminal``.

        Args:
            run: the run.
            reason: why (at most 1000 characters): the run's ``error.message``
                and its ``run_cancelled`` journal entry.

        Raises:
            RunTerminal: the run is over already.
            NotFound: no such run.
            Invalid: a blank or too long reason (``field`` ``reason``).
        """
        self._backend.send(_wire.cancel(run_id_of(run), reason))

    def retry(self, run: RunHandle | str) -> dict[str, Any]:
        """Resume a failed run at the step it failed on, with a fresh retry budget.

        Not retried on a lost answer (the run may have resumed already).

        Returns:
            ``{"run_id", "status", "step_id"}``: the status right after (``failed``
            again if the step failed at once) and the step entered again.

        Raises:
            NotRetryable: the run is not failed, failed on a budget (``budget``),
                or its deadline has passed.
            NotFound: no such run.
        """
        return dict(self._backend.send(_wire.retry(run_id_of(run))))

    def fork(self, run: RunHandle | str, from_step: str, *,
             idempotency_key: str | None = None) -> RunHandle:
        """Start a new run from the last completion of ``from_step`` in ``run``.

        The new run keeps the journal up to there, and the state, step outputs
        and budget usage as they were, then goes on with the next step. Its
        status links back (``forked_from``), the source's lists it (``forks``).

        Args:
            run: the run to fork.
            from_step: a step of the run that has completed.
            idempotency_key: a key used before returns that fork (``created`` False).

        Returns:
            The new run's `RunHandle`.

        Raises:
            Invalid: ``from_step`` is not a completed step of the run (``field``
                ``from_step``).
            NotFound: no such run.
            Unprocessable: the run's journal is from before forks were possible.
        """
        answer = self._backend.send(_wire.fork(run_id_of(run), from_step, idempotency_key))
        return RunHandle(self, answer["run_id"], bool(answer.get("created", True)))

    def list_runs(
        self,
        workflow: str | None = None,
        status: str | None = None,
        limit: int | None = 100,
        *,
        created_after: int | str | datetime.datetime | None = None,
        created_before: int | str | datetime.datetime | None = None,
        correlation: Any = None,
        idempotency_key: str | None = None,
        order: str | None = None,
        cursor: str | None = None,
        page_size: int | None = None,
    ) -> RunList:
        """Runs, newest first unless ``order="asc"``, fetched page by page as you iterate.

        Every filter is a query parameter of ``GET /v1/api/runs``; None leaves it out.

        Args:
            workflow: only this workflow's runs.
            status: only runs in this status.
            limit: stop after this many runs; None for all.
            created_after, created_before: only runs created after / before this
                instant: epoch ms, an ISO-8601 string (``"2026-12-01T10:00:00Z"``)
                or a timezone-aware datetime.
            correlation: only runs whose correlation is this JSON value (sent as
                its canonical JSON); None does not filter.
            idempotency_key: only the run started with this key.
            order: ``"desc"`` (the daemon's default: newest first) or ``"asc"``.
            cursor: start after an earlier listing (its `RunList.next_cursor`).
            page_size: the most runs asked per request (default: up to 1000).

        Returns:
            A `RunList`: iterate it; afterwards its ``next_cursor`` says where
            the next runs start.

        Raises:
            Invalid: a bad filter, limit or page size (a bad argument at once;
                one the daemon refuses when iteration starts).
        """
        check_size(limit, "limit")
        check_size(page_size, "page_size")
        query = list_query(workflow=workflow, status=status, created_after=created_after,
                            created_before=created_before, correlation=correlation,
                            idempotency_key=idempotency_key, order=order)
        return RunList(self._backend.send, query, limit, page_size, cursor)

    def workers(self) -> list[dict[str, Any]]:
        """Registered workers: id, name, build, whether connected, their leases."""
        return list(self._backend.send(_wire.workers())["workers"])

    def actors(self) -> dict[str, Any]:
        """The daemon's supervision tree (admin scope): the root node, nested.

        Each node has ``path``, ``kind``, ``state``, ``restarts``,
        ``mailbox_depth``, ``mailbox_size``, ``timers``, ``started_at`` and
        ``children``.

        Raises:
            Unauthorized, Forbidden: the key is not an admin key.
        """
        return dict(self._backend.send(_wire.actors())["tree"])

    def kill_actor(self, path: str) -> list[str]:
        """Kill one actor (fault injection, admin scope); its supervisor restarts it.

        Not retried (a second kill would hit the restarted actor).

        Returns:
            The actors the supervisor restarts because of the kill, the killed
            one first (``rest_for_one`` restarts its later siblings too).

        Raises:
            NotFound: no actor runs at ``path`` (or it is being restarted; for a
                passivated run the message says so).
            Invalid: ``path`` is not an actor path, or is the root.
            Unauthorized, Forbidden: the key is not an admin key.
        """
        answer = self._backend.send(_wire.kill_actor(path))
        return list(answer.get("restarted") or [path])


