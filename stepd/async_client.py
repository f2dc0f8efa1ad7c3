"""`AsyncClient`: the async twin of `stepd.Client` (asyncio or trio), and its `AsyncRunHandle`."""

from __future__ import annotations

import datetime
import math
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
from stepd._listing import AsyncRunList, check_size, list_query
from stepd._runs import TERMINAL, RunStatus
from stepd._schedules import AsyncScheduleCalls
from stepd.actors import current_time
from stepd.channels.http import AsyncHttp, base_url
from stepd.channels.inprocess import AsyncEmbedded
from stepd.sansio.durations import Duration
from stepd.sansio.errors import Invalid

if TYPE_CHECKING:
    from stepd.embedded import Embedded
    from stepd.workflow import Workflow

__all__ = ["AsyncClient", "AsyncRunHandle"]


class AsyncRunHandle(Handle):
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

    async def cancel(self, reason: str | None = None) -> None:
        await self._client.cancel(self.run_id, reason)

    async def retry(self) -> dict[str, Any]:
        return await self._client.retry(self.run_id)

    async def fork(self, from_step: str, *, idempotency_key: str | None = None) -> AsyncRunHandle:
        return await self._client.fork(self.run_id, from_step, idempotency_key=idempotency_key)

    async def journal(self) -> list[dict[str, Any]]:
        return await self._client.journal(self.run_id)

    async def export(self) -> dict[str, Any]:
        return await self._client.export(self.run_id)



# --------------------------------------------------------------------------- the client


class AsyncClient(AsyncScheduleCalls):
    """The async twin of `Client` (asyncio or trio); every method is a coroutine.

    Args: as `Client`. Close it with ``await client.aclose()`` or ``async with``.
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
        self._backend: AsyncHttp | AsyncEmbedded
        if daemon is not None:
            self._backend = AsyncEmbedded(daemon)
        elif isinstance(target, str):
            self._backend = AsyncHttp(target, key, timeout, retries, trust_env)
            self.url = base_url(target)
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
        return AsyncRunHandle(self, run_id_of(run_id))

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
        call = start_call(workflow, input, idempotency_key=idempotency_key,
                           correlation=correlation, version=version, deadline=deadline)
        answer = await self._backend.send(call)
        return AsyncRunHandle(self, answer["run_id"], bool(answer.get("created", True)))

    async def status(self, run: Handle | str) -> RunStatus:
        """`Client.status`."""
        return RunStatus.from_json(await self._backend.send(_wire.get_run(run_id_of(run))))

    async def result(self, run: Handle | str,
                     timeout: float | None = None) -> Any:
        """`Client.result`."""
        run_id = run_id_of(run)
        deadline = None if timeout is None else current_time() + timeout
        while True:
            left = math.inf if deadline is None else deadline - current_time()
            wait_ms = int(min(left * 1000, _wire.RESULT_CHUNK_MS)) if left > 0 else 0
            answer = await self._backend.send(_wire.result(run_id, wait_ms))
            if answer["status"] in TERMINAL:
                return outcome(answer)
            if deadline is not None and current_time() >= deadline:
                raise TimeoutError(f"run {run_id} is still {answer['status']} after {timeout} s")

    async def journal(self, run: Handle | str, *, after_seq: int = 0) -> list[dict[str, Any]]:
        """`Client.journal`."""
        run_id = run_id_of(run)
        events: list[dict[str, Any]] = []
        after = after_seq
        while True:
            answer = await self._backend.send(_wire.journal(run_id, after, _wire.JOURNAL_PAGE))
            page = answer["events"]
            events.extend(page)
            if len(page) < _wire.JOURNAL_PAGE:
                return events
            after = int(page[-1]["seq"])

    async def export(self, run: Handle | str) -> dict[str, Any]:
        """`Client.export`."""
        return await self._backend.send(_wire.export(run_id_of(run)))

    async def signal(self, run: Handle | str, name: str,
                     payload: Any = None) -> None:
        """`Client.signal`."""
        await self._backend.send(_wire.signal(run_id_of(run), name, payload))

    async def cancel(self, run: Handle | str, reason: str | None = None) -> None:
        """`Client.cancel`."""
        await self._backend.send(_wire.cancel(run_id_of(run), reason))

    async def retry(self, run: Handle | str) -> dict[str, Any]:
        """`Client.retry`."""
        return dict(await self._backend.send(_wire.retry(run_id_of(run))))

    async def fork(self, run: Handle | str, from_step: str, *,
                   idempotency_key: str | None = None) -> AsyncRunHandle:
        """`Client.fork`."""
        answer = await self._backend.send(_wire.fork(run_id_of(run), from_step, idempotency_key))
        return AsyncRunHandle(self, answer["run_id"], bool(answer.get("created", True)))

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
        check_size(limit, "limit")
        check_size(page_size, "page_size")
        query = list_query(workflow=workflow, status=status, created_after=created_after,
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
