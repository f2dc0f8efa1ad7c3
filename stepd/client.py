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

import abc
import collections
import dataclasses
import datetime
import json
import math
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol, Self

import anyio
import httpx

from stepd import _wire
from stepd._errors import Unavailable, error_from_answer, run_error
from stepd._http1 import Http1Client, Http1Error, wants_httpx
from stepd._runs import TERMINAL, RunStatus, RunSummary
from stepd.actors import current_time
from stepd.sansio.canonical import canonical_json
from stepd.sansio.durations import Duration, parse_duration
from stepd.sansio.errors import Invalid

if TYPE_CHECKING:
    from stepd.embedded import Embedded
    from stepd.workflow import Workflow

__all__ = ["AsyncClient", "AsyncRunHandle", "AsyncRunList", "Client", "RunHandle", "RunList"]

DEFAULT_TIMEOUT_S = 10.0
DEFAULT_RETRIES = 3
_BACKOFF_BASE_S = 0.05
_BACKOFF_CAP_S = 2.0


_JITTER = random.Random()
"""Our own generator: backoff jitter never touches the `random` module's global state
(which the application, or hypothesis in a test, may own)."""


def _backoff(attempt: int) -> float:
    """Full-jitter exponential backoff (bounded)."""
    return _JITTER.uniform(0.5, 1.0) * min(_BACKOFF_CAP_S, _BACKOFF_BASE_S * float(2 ** min(attempt, 16)))


def _run_id(run: RunHandle | AsyncRunHandle | str) -> str:
    if isinstance(run, (RunHandle, AsyncRunHandle)):
        return run.run_id
    if isinstance(run, str) and run:
        return run
    raise Invalid(f"must be a run handle or a run id, got {run!r}", field="run")


def _workflow_name(workflow: Workflow | str, version: str | None) -> tuple[str, str | None]:
    if isinstance(workflow, str):
        return workflow, version
    name = getattr(workflow, "name", None)
    if not isinstance(name, str):
        raise Invalid(f"must be a workflow name or a stepd.Workflow, got {workflow!r}",
                      field="workflow")
    return name, version if version is not None else workflow.version


def _start_call(workflow: Workflow | str, input: Any, *, idempotency_key: str | None,
                correlation: Any, version: str | None, deadline: Duration | None) -> _wire.Call:
    name, version = _workflow_name(workflow, version)
    deadline_ms = None if deadline is None else parse_duration(deadline, field="deadline")
    return _wire.start_run(name, input, version=version, correlation=correlation,
                           idempotency_key=idempotency_key, deadline_ms=deadline_ms)


def _outcome(answer: dict[str, Any]) -> Any:
    """The result of a terminal ``result`` answer, or the typed error it stands for."""
    status = answer["status"]
    if status == "completed":
        return answer.get("result")
    raise run_error(answer["run_id"], status, answer.get("error"))


def _base_url(url: str) -> str:
    if not url.startswith(("http://", "https://")):
        raise Invalid(f"must be an http:// or https:// URL, got {url!r}", field="url")
    return url.rstrip("/")


def _headers(key: str | None) -> dict[str, str]:
    headers = {"accept": "application/json", "user-agent": "stepd-python"}
    if key is not None:
        headers["authorization"] = f"Bearer {key}"
    return headers


class _Response(Protocol):
    """What `_answer` reads of an answer: an httpx.Response or a `Http1Response`."""

    @property
    def status_code(self) -> int: ...
    @property
    def content(self) -> bytes: ...
    @property
    def text(self) -> str: ...
    def json(self) -> Any: ...


def encode_body(body: Any) -> bytes:
    """JSON exactly as httpx encodes ``json=`` (UTF-8, compact, NaN refused)."""
    return json.dumps(body, ensure_ascii=False, separators=(",", ":"),
                      allow_nan=False).encode("utf-8")


def _answer(response: _Response) -> dict[str, Any]:
    try:
        body = response.json() if response.content else {}
    except ValueError:
        body = {"message": response.text[:500]}
    if response.status_code >= 300:
        raise error_from_answer(response.status_code, body)
    return body if isinstance(body, dict) else {"value": body}


def _embedded_of(target: Any) -> Embedded | None:
    from stepd.embedded import Embedded

    if isinstance(target, Embedded):
        return target
    return None


# --------------------------------------------------------------------------- list_runs

_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)
_ORDERS = ("desc", "asc")


def _created(value: int | str | datetime.datetime | None, field: str) -> int | str | None:
    """A ``created_after``/``created_before`` bound as the API takes it: epoch ms or ISO-8601."""
    if value is None:
        return None
    if isinstance(value, datetime.datetime):
        if value.tzinfo is None:  # local or UTC? refuse to guess
            raise Invalid("must be a timezone-aware datetime", field=field)
        return (value - _EPOCH) // datetime.timedelta(milliseconds=1)
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise Invalid("must be epoch ms (an int), an ISO-8601 string or an aware datetime",
                      field=field)
    return value


def _size(value: int | None, field: str) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                              or value < 1):
        raise Invalid("must be an integer >= 1 or None", field=field)


def _list_query(*, workflow: str | None, status: str | None,
                created_after: int | str | datetime.datetime | None,
                created_before: int | str | datetime.datetime | None, correlation: Any,
                idempotency_key: str | None, order: str | None) -> dict[str, Any]:
    """The filters of ``GET /v1/api/runs`` as query parameters (None: not sent).

    ``correlation`` travels as its canonical JSON (the form the daemon compares),
    so ``{"b": 1, "a": 2}`` and ``{"a": 2, "b": 1}`` find the same runs.

    Raises:
        Invalid: a bound, an order or a correlation the API cannot take.
    """
    if order is not None and order not in _ORDERS:
        raise Invalid("must be 'desc' or 'asc'", field="order")
    corr = None
    if correlation is not None:
        try:
            corr = canonical_json(correlation).decode()
        except Invalid as exc:
            raise Invalid(exc.message, field="correlation") from exc
    return {
        "workflow": workflow,
        "status": status,
        "created_after": _created(created_after, "created_after"),
        "created_before": _created(created_before, "created_before"),
        "correlation": corr,
        "idempotency_key": idempotency_key,
        "order": order,
    }


def _list_call(query: dict[str, Any], page_size: int, cursor: str | None) -> _wire.Call:
    base = _wire.list_runs(query["workflow"], query["status"], page_size, cursor)
    return dataclasses.replace(base, query={**base.query, **query})


class _Listing:
    """What both run listings share: the paging arithmetic and ``next_cursor``."""

    def __init__(self, query: dict[str, Any], limit: int | None, page_size: int | None,
                 cursor: str | None) -> None:
        self.next_cursor: str | None = cursor
        self._query = query
        self._left = limit
        self._page_size = min(page_size or _wire.LIST_PAGE_MAX, _wire.LIST_PAGE_MAX)
        self._buffer: collections.deque[dict[str, Any]] = collections.deque()
        self._started = False

    def _next_call(self) -> _wire.Call | None:
        """The next page to fetch, or None when the listing is over."""
        if self._left is not None and self._left <= 0:
            return None
        if self._started and self.next_cursor is None:
            return None
        self._started = True
        size = self._page_size if self._left is None else min(self._left, self._page_size)
        return _list_call(self._query, size, self.next_cursor)

    def _take(self, page: dict[str, Any]) -> None:
        runs = list(page["runs"])
        if self._left is not None:
            runs = runs[: self._left]  # never more than asked, even from a daemon that sends more
            self._left -= len(runs)
        self._buffer.extend(runs)
        self.next_cursor = page.get("next_cursor") or None


class RunList(_Listing, Iterator[RunSummary]):
    """What `Client.list_runs` returns: an iterator of `RunSummary` that fetches pages as it goes.

    A page may hold fewer runs than asked while more follow (the daemon bounds
    the work one page costs); the iterator keeps fetching until ``limit`` runs
    or the last one.

    Attributes:
        next_cursor: once the iteration has ended, the cursor of the runs after
            the last one yielded (pass it as ``cursor=`` to go on), or None when
            there are no more.
    """

    def __init__(self, send: Callable[[_wire.Call], dict[str, Any]], query: dict[str, Any],
                 limit: int | None, page_size: int | None, cursor: str | None) -> None:
        super().__init__(query, limit, page_size, cursor)
        self._send = send

    def __iter__(self) -> Self:
        return self

    def __next__(self) -> RunSummary:
        while not self._buffer:
            call = self._next_call()
            if call is None:
                raise StopIteration
            self._take(self._send(call))
        return RunSummary.from_json(self._buffer.popleft())


class AsyncRunList(_Listing, AsyncIterator[RunSummary]):
    """`RunList` for `AsyncClient`: ``async for run in client.list_runs(...)``."""

    def __init__(self, send: Callable[[_wire.Call], Awaitable[dict[str, Any]]],
                 query: dict[str, Any], limit: int | None, page_size: int | None,
                 cursor: str | None) -> None:
        super().__init__(query, limit, page_size, cursor)
        self._send = send

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> RunSummary:
        while not self._buffer:
            call = self._next_call()
            if call is None:
                raise StopAsyncIteration
            self._take(await self._send(call))
        return RunSummary.from_json(self._buffer.popleft())


# --------------------------------------------------------------------------- backends


class _SyncBackend(abc.ABC):
    @abc.abstractmethod
    def send(self, call: _wire.Call) -> dict[str, Any]: ...

    def close(self) -> None:
        pass


class _SyncHttp(_SyncBackend):
    def __init__(self, url: str, key: str | None, timeout: float, retries: int,
                 trust_env: bool) -> None:
        self.url = _base_url(url)
        self.timeout = timeout
        self.retries = retries
        self.http = httpx.Client(base_url=self.url, headers=_headers(key), timeout=timeout,
                                 trust_env=trust_env, http1=True, http2=False)

    def send(self, call: _wire.Call) -> dict[str, Any]:
        attempt = 0
        while True:
            try:
                response = self.http.request(
                    call.method, call.path, params=call.params() or None,
                    json=call.body if call.body is not _wire.NO_BODY else None,
                    timeout=self.timeout + call.hold_s,
                )
                return _answer(response)
            except Unavailable:
                if not call.idempotent or attempt >= self.retries:
                    raise
            except httpx.TransportError as exc:
                if not call.idempotent or attempt >= self.retries:
                    raise Unavailable(f"cannot reach the daemon at {self.url}: {exc!r}") from exc
            time.sleep(_backoff(attempt))
            attempt += 1

    def close(self) -> None:
        self.http.close()


class _SyncEmbedded(_SyncBackend):
    def __init__(self, daemon: Embedded) -> None:
        self.daemon = daemon

    def send(self, call: _wire.Call) -> dict[str, Any]:
        args, kwargs = call.inproc_args()
        daemon = self.daemon

        async def invoke() -> dict[str, Any]:
            return await getattr(daemon.inprocess, call.op)(*args, **kwargs)  # type: ignore[no-any-return]

        return daemon.call_blocking(invoke)


class _AsyncBackend(abc.ABC):
    @abc.abstractmethod
    async def send(self, call: _wire.Call) -> dict[str, Any]: ...

    async def aclose(self) -> None:
        pass


class _AsyncHttp(_AsyncBackend):
    """HTTP to a daemon URL: `stepd._http1` for plain http, httpx for https and proxies."""

    def __init__(self, url: str, key: str | None, timeout: float, retries: int,
                 trust_env: bool) -> None:
        self.url = _base_url(url)
        self.timeout = timeout
        self.retries = retries
        self.http: httpx.AsyncClient | None = None
        self.lean: Http1Client | None = None
        if wants_httpx(self.url, trust_env):
            self.http = httpx.AsyncClient(base_url=self.url, headers=_headers(key),
                                          timeout=timeout, trust_env=trust_env, http1=True,
                                          http2=False)
        else:
            self.lean = Http1Client(self.url, _headers(key))

    async def _request(self, call: _wire.Call) -> _Response:
        timeout = self.timeout + call.hold_s
        params = call.params() or None
        if self.lean is None:
            assert self.http is not None
            return await self.http.request(
                call.method, call.path, params=params,
                json=call.body if call.body is not _wire.NO_BODY else None, timeout=timeout)
        content = None if call.body is _wire.NO_BODY else encode_body(call.body)
        return await self.lean.request(call.method, call.path, params=params, content=content,
                                       timeout=timeout)

    async def send(self, call: _wire.Call) -> dict[str, Any]:
        attempt = 0
        while True:
            try:
                return _answer(await self._request(call))
            except Unavailable:
                if not call.idempotent or attempt >= self.retries:
                    raise
            except (httpx.TransportError, Http1Error) as exc:
                if not call.idempotent or attempt >= self.retries:
                    raise Unavailable(f"cannot reach the daemon at {self.url}: {exc!r}") from exc
            await anyio.sleep(_backoff(attempt))
            attempt += 1

    async def aclose(self) -> None:
        if self.http is not None:
            await self.http.aclose()
        if self.lean is not None:
            await self.lean.aclose()


class _AsyncEmbedded(_AsyncBackend):
    def __init__(self, daemon: Embedded) -> None:
        self.daemon = daemon

    async def send(self, call: _wire.Call) -> dict[str, Any]:
        args, kwargs = call.inproc_args()
        method = getattr(self.daemon.inprocess, call.op)

        async def invoke() -> dict[str, Any]:
            return await method(*args, **kwargs)  # type: ignore[no-any-return]

        return await self.daemon.call_async(invoke)


# --------------------------------------------------------------------------- handles


class _Handle:
    """What both run handles share: a run id that compares and prints as itself."""

    __slots__ = ("_client", "created", "run_id")

    def __init__(self, client: Any, run_id: str, created: bool) -> None:
        self._client = client
        self.run_id = run_id
        self.created = created

    def __str__(self) -> str:
        return self.run_id

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.run_id!r}, created={self.created})"

    def __eq__(self, other: object) -> bool:
        if isinstance(other, _Handle):
            return self.run_id == other.run_id
        if isinstance(other, str):
            return self.run_id == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.run_id)


class RunHandle(_Handle):
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

    def cancel(self) -> None:
        """`Client.cancel` of this run."""
        self._client.cancel(self.run_id)

    def journal(self) -> list[dict[str, Any]]:
        """`Client.journal` of this run."""
        return self._client.journal(self.run_id)

    def export(self) -> dict[str, Any]:
        """`Client.export` of this run."""
        return self._client.export(self.run_id)


class AsyncRunHandle(_Handle):
    """`RunHandle` for `AsyncClient`: the same, with coroutine methods."""

    __slots__ = ()
    _client: AsyncClient

    def __init__(self, client: AsyncClient, run_id: str, created: bool = True) -> None:
        super().__init__(client, run_id, created)

    async def status(self) -> RunStatus:
        return await self._client.status(self.run_id)

    async def result(self, timeout: float | None = None) -> Any:
        return await self._client.result(self.run_id, timeout=timeout)

    async def signal(self, name: str, payload: Any = None) -> None:
        await self._client.signal(self.run_id, name, payload)

    async def cancel(self) -> None:
        await self._client.cancel(self.run_id)

    async def journal(self) -> list[dict[str, Any]]:
        return await self._client.journal(self.run_id)

    async def export(self) -> dict[str, Any]:
        return await self._client.export(self.run_id)


# --------------------------------------------------------------------------- clients


class Client:
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
        daemon = _embedded_of(target)
        self.url: str | None = None
        self.key = key
        self.timeout = timeout
        self.retries = retries
        self.trust_env = trust_env
        self._daemon = daemon
        self._backend: _SyncBackend
        if daemon is not None:
            self._backend = _SyncEmbedded(daemon)
        elif isinstance(target, str):
            self._backend = _SyncHttp(target, key, timeout, retries, trust_env)
            self.url = _base_url(target)
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
        return RunHandle(self, _run_id(run_id))

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
        call = _start_call(workflow, input, idempotency_key=idempotency_key,
                           correlation=correlation, version=version, deadline=deadline)
        answer = self._backend.send(call)
        return RunHandle(self, answer["run_id"], bool(answer.get("created", True)))

    def status(self, run: RunHandle | str) -> RunStatus:
        """The run's status (``GET /v1/api/runs/{run}``).

        Raises:
            NotFound: no such run.
        """
        return RunStatus.from_json(self._backend.send(_wire.get_run(_run_id(run))))

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
        run_id = _run_id(run)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = math.inf if deadline is None else deadline - time.monotonic()
            wait_ms = int(min(left * 1000, _wire.RESULT_CHUNK_MS)) if left > 0 else 0
            answer = self._backend.send(_wire.result(run_id, wait_ms))
            if answer["status"] in TERMINAL:
                return _outcome(answer)
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"run {run_id} is still {answer['status']} after {timeout} s")

    def journal(self, run: RunHandle | str) -> list[dict[str, Any]]:
        """Every journal event of the run, in order (fetched in pages).

        Raises:
            NotFound: no such run.
        """
        run_id = _run_id(run)
        events: list[dict[str, Any]] = []
        after = 0
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
        return self._backend.send(_wire.export(_run_id(run)))

    def signal(self, run: RunHandle | str, name: str, payload: Any = None) -> None:
        """Send the signal ``name`` (with ``payload``) to the run.

        Raises:
            BudgetExceeded: the ``wait`` it completes would breach ``budget``;
                nothing was recorded and the run keeps waiting.
            RunTerminal: the run is over.
            NotFound: no such run.
            Invalid: a bad name (``field`` ``name``) or a payload that is not JSON.
        """
        self._backend.send(_wire.signal(_run_id(run), name, payload))

    def cancel(self, run: RunHandle | str) -> None:
        """Cancel the run; its running steps' leases end with ``run_terminal``.

        Raises:
            RunTerminal: the run is over already.
            NotFound: no such run.
        """
        self._backend.send(_wire.cancel(_run_id(run)))

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
        _size(limit, "limit")
        _size(page_size, "page_size")
        query = _list_query(workflow=workflow, status=status, created_after=created_after,
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


class AsyncClient:
    """The async twin of `Client` (asyncio or trio); every method is a coroutine.

    Args: as `Client`. Close it with ``await client.aclose()`` or ``async with``.
    """

    def __init__(self, target: str | Embedded, key: str | None = None, *,
                 timeout: float = DEFAULT_TIMEOUT_S, retries: int = DEFAULT_RETRIES,
                 trust_env: bool = True) -> None:
        daemon = _embedded_of(target)
        self.url: str | None = None
        self.key = key
        self.timeout = timeout
        self.retries = retries
        self.trust_env = trust_env
        self._daemon = daemon
        self._backend: _AsyncBackend
        if daemon is not None:
            self._backend = _AsyncEmbedded(daemon)
        elif isinstance(target, str):
            self._backend = _AsyncHttp(target, key, timeout, retries, trust_env)
            self.url = _base_url(target)
        else:
            raise Invalid(f"must be a URL or a stepd.embedded daemon, got {target!r}",
                          field="target")

    def __repr__(self) -> str:
        return f"<stepd.AsyncClient {self.url or self._daemon!r}>"

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connection pool (an embedded daemon stays open)."""
        await self._backend.aclose()

    def handle(self, run_id: str) -> AsyncRunHandle:
        """A handle of an existing run (nothing is sent)."""
        return AsyncRunHandle(self, _run_id(run_id))

    async def start(
        self,
        workflow: Workflow | str,
        input: Any = None,
        *,
        idempotency_key: str | None = None,
        correlation: Any = None,
        version: str | None = None,
        deadline: Duration | None = None,
    ) -> AsyncRunHandle:
        """`Client.start`."""
        call = _start_call(workflow, input, idempotency_key=idempotency_key,
                           correlation=correlation, version=version, deadline=deadline)
        answer = await self._backend.send(call)
        return AsyncRunHandle(self, answer["run_id"], bool(answer.get("created", True)))

    async def status(self, run: AsyncRunHandle | RunHandle | str) -> RunStatus:
        """`Client.status`."""
        return RunStatus.from_json(await self._backend.send(_wire.get_run(_run_id(run))))

    async def result(self, run: AsyncRunHandle | RunHandle | str,
                     timeout: float | None = None) -> Any:
        """`Client.result`."""
        run_id = _run_id(run)
        deadline = None if timeout is None else current_time() + timeout
        while True:
            left = math.inf if deadline is None else deadline - current_time()
            wait_ms = int(min(left * 1000, _wire.RESULT_CHUNK_MS)) if left > 0 else 0
            answer = await self._backend.send(_wire.result(run_id, wait_ms))
            if answer["status"] in TERMINAL:
                return _outcome(answer)
            if deadline is not None and current_time() >= deadline:
                raise TimeoutError(f"run {run_id} is still {answer['status']} after {timeout} s")

    async def journal(self, run: AsyncRunHandle | RunHandle | str) -> list[dict[str, Any]]:
        """`Client.journal`."""
        run_id = _run_id(run)
        events: list[dict[str, Any]] = []
        after = 0
        while True:
            answer = await self._backend.send(_wire.journal(run_id, after, _wire.JOURNAL_PAGE))
            page = answer["events"]
            events.extend(page)
            if len(page) < _wire.JOURNAL_PAGE:
                return events
            after = int(page[-1]["seq"])

    async def export(self, run: AsyncRunHandle | RunHandle | str) -> dict[str, Any]:
        """`Client.export`."""
        return await self._backend.send(_wire.export(_run_id(run)))

    async def signal(self, run: AsyncRunHandle | RunHandle | str, name: str,
                     payload: Any = None) -> None:
        """`Client.signal`."""
        await self._backend.send(_wire.signal(_run_id(run), name, payload))

    async def cancel(self, run: AsyncRunHandle | RunHandle | str) -> None:
        """`Client.cancel`."""
        await self._backend.send(_wire.cancel(_run_id(run)))

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
    ) -> AsyncRunList:
        """`Client.list_runs`, as an async iterator (``async for run in ...``)."""
        _size(limit, "limit")
        _size(page_size, "page_size")
        query = _list_query(workflow=workflow, status=status, created_after=created_after,
                            created_before=created_before, correlation=correlation,
                            idempotency_key=idempotency_key, order=order)
        return AsyncRunList(self._backend.send, query, limit, page_size, cursor)

    async def workers(self) -> list[dict[str, Any]]:
        """`Client.workers`."""
        return list((await self._backend.send(_wire.workers()))["workers"])

    async def actors(self) -> dict[str, Any]:
        """`Client.actors`."""
        return dict((await self._backend.send(_wire.actors()))["tree"])

    async def kill_actor(self, path: str) -> list[str]:
        """`Client.kill_actor`."""
        answer = await self._backend.send(_wire.kill_actor(path))
        return list(answer.get("restarted") or [path])
