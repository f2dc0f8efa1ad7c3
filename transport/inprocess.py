"""The protocol without sockets, for the embedded daemon (``stepd.embedded(path)``).

`InProcess` has one async method per operation of the HTTP API. Each takes
what the HTTP request carries (the path id, the query parameters, the JSON
body as a dict) and returns what the HTTP answer carries (the JSON body as a
dict), through the same `Protocol.call` the HTTP and WebSocket transports use:
the same validation, the same daemon calls, the same audit entries. Where HTTP
answers with an error status, these methods raise the error itself
(`stepd.sansio.errors.Invalid`, `NotFound`, the `Conflict` subclasses,
`SignalRefused`, `Unprocessable`, `Unavailable`, `stepd.transport.protocol.TooLarge`,
`stepd.transport.auth.Unauthorized` / `Forbidden`), with the same fields the
HTTP error body shows (`stepd.transport.protocol.error_reply` maps one to the
other).

Values cross by copy: every body goes in (`copy_in`), and every answer comes
out (`copy_out`), as a JSON round trip would give them, so a caller can never
reach the daemon's state through a shared dict (and a value JSON cannot carry,
such as bytes or NaN, is refused as `Invalid`, as it would be over HTTP). The
copies walk the containers instead of encoding text (`transport._json`: the
same values, a few calls instead of ~20 per value; three per embedded step).

A worker's lease calls (``started``, ``heartbeat``, ``complete``, ``fail``)
are counted for the drain (`Protocol.call_begins`) without a cancel scope of
their own, as WebSocket frames are: each waits only for its own commit, which
ends either way (committed, or `StorageClosed`), and the embedded daemon
never aborts (it stops its workers before it closes). A scope cost ~20 calls
per step. Every other call is tracked through its task on asyncio
(`Drain.task_tracking`, as an HTTP request under stepd's uvicorn protocol is: a
long-poll the drain ends, or a call the grace period's end aborts, raises
`Unavailable` here), and with `Protocol.tracking`'s cancel scope on trio: the
two scopes of a run's ``result`` and the one of its start cost ~90 calls a run.

``start_run`` returns ``{"run_id", "created"}``: ``created`` says what the
HTTP status (201 or 200) says.
"""

from __future__ import annotations

import asyncio
from typing import Any, Final

import sniffio

from stepd.sansio.errors import Unavailable

from ._json import copy_in, copy_out
from .auth import Forbidden
from .protocol import LONG_POLLS, NO_BODY, Operation, Protocol

__all__ = ["InProcess"]

_UNSCOPED: Final = {"started": Operation.STARTED, "heartbeat": Operation.HEARTBEAT,
                    "complete": Operation.COMPLETE, "fail": Operation.FAIL}
"""The lease calls by name (`InProcess.lease_call`): counted for the drain, not given a
cancel scope (the module says why)."""


class InProcess:
    """In-process calls to the daemon's protocol handler.

    Args:
        protocol: the daemon's protocol handler.
        authorization: the ``Authorization`` header every call presents
            (``"Bearer <key>"``); None when the daemon runs without keys.
    """

    def __init__(self, protocol: Protocol, *, authorization: str | None = None) -> None:
        self.protocol = protocol
        self.authorization = authorization
        # Whether calls come on asyncio (tracked through their task) or trio (a cancel
        # scope each): the daemon's loop, known at the first call.
        self._on_asyncio: bool | None = None

    async def _call(
        self,
        op: Operation,
        *,
        target: str | None = None,
        query: dict[str, Any] | None = None,
        body: Any = NO_BODY,
    ) -> dict[str, Any]:
        protocol = self.protocol
        try:
            principal = protocol.authorize(op, self.authorization)
        except Forbidden as exc:
            await protocol.refused(op, exc, target)  # audited, as over HTTP
            raise
        if body is not NO_BODY:
            body = copy_in(body)
        if query:
            query = {k: v for k, v in query.items() if v is not None}
        on_asyncio = self._on_asyncio
        if on_asyncio is None:
            on_asyncio = self._on_asyncio = sniffio.current_async_library() == "asyncio"
        done = None
        if on_asyncio:
            tracking = protocol.task_tracking(asyncio.current_task(), poll=op in LONG_POLLS)
            with tracking:
                done = await protocol.call(op, principal, target=target, query=query,
                                           body=body, held=tracking.poll)
        else:
            with protocol.tracking():
                done = await protocol.call(op, principal, target=target, query=query,
                                           body=body)
        if done is None:  # the drain ended a long-poll, or the grace period ran out
            raise Unavailable("the daemon is shutting down")
        answer = done.body
        return copy_out(answer) if answer else {}

    async def lease_call(self, op: str, lease_id: str,
                         body: dict[str, Any] | None = None) -> dict[str, Any]:
        """A worker's ``started``, ``heartbeat``, ``complete`` or ``fail``, by name.

        What `_call` does, without a cancel scope (the module says why) and in one
        frame over `Protocol.lease_call` (one frame too): the worker's runner awaits
        this once per step (`stepd.channels.inprocess`).

        Raises:
            KeyError: ``op`` is not one of the four.
        """
        operation = _UNSCOPED[op]
        protocol = self.protocol
        try:
            protocol.authorize(operation, self.authorization)  # its scope; nothing audited
        except Forbidden as exc:
            await protocol.refused(operation, exc, lease_id)
            raise
        protocol.call_begins()
        try:
            reply = await protocol.lease_call(operation, lease_id,
                                              NO_BODY if body is None else copy_in(body), None)
        finally:
            protocol.call_ends()
        answer = reply.body
        return copy_out(answer) if answer else {}

    # -- worker calls ------------------------------------------------------------------

    async def register(self, body: dict[str, Any]) -> dict[str, Any]:
        """``POST /v1/api/workers/register``."""
        return await self._call(Operation.REGISTER, body=body)

    async def claim(self, body: dict[str, Any]) -> dict[str, Any]:
        """``POST /v1/api/steps/claim`` -> ``{"leases": [...]}`` (may hold up to the claim hold)."""
        return await self._call(Operation.CLAIM, body=body)

    async def started(self, lease_id: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        """``POST /v1/api/steps/{lease}/started``."""
        return await self.lease_call("started", lease_id, body)

    async def heartbeat(self, lease_id: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        """``POST /v1/api/steps/{lease}/heartbeat`` -> ``{"lease_ttl_ms"}``."""
        return await self.lease_call("heartbeat", lease_id, body)

    async def complete(self, lease_id: str, body: dict[str, Any]) -> dict[str, Any]:
        """``POST /v1/api/steps/{lease}/complete`` (returns once durable)."""
        return await self.lease_call("complete", lease_id, body)

    async def fail(self, lease_id: str, body: dict[str, Any]) -> dict[str, Any]:
        """``POST /v1/api/steps/{lease}/fail`` (returns once durable)."""
        return await self.lease_call("fail", lease_id, body)

    async def history(self, lease_id: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        """``GET /v1/api/steps/{lease}/history`` (docs/affinity.md "Sticky execution")."""
        return await self._call(Operation.HISTORY, target=lease_id,
                                body=NO_BODY if not body else body)

    async def session_renew(self, session_id: str, body: dict[str, Any]) -> dict[str, Any]:
        """``POST /v1/api/sessions/{session}/renew`` (docs/affinity.md "Worker sessions")."""
        return await self._call(Operation.SESSION_RENEW, target=session_id, body=body)

    async def session_close(self, session_id: str, body: dict[str, Any]) -> dict[str, Any]:
        """``POST /v1/api/sessions/{session}/close``."""
        return await self._call(Operation.SESSION_CLOSE, target=session_id, body=body)

    # -- runs ------------------------------------------------------------------------------

    async def start_run(self, body: dict[str, Any]) -> dict[str, Any]:
        """``POST /v1/api/runs`` -> ``{"run_id", "created"}``."""
        return await self._call(Operation.START_RUN, body=body)

    async def list_runs(self, **query: Any) -> dict[str, Any]:
        """``GET /v1/api/runs`` -> ``{"runs", "next_cursor"}``.

        Every keyword is a query parameter, passed through as the HTTP
        transport passes the URL's (None values left out): ``workflow``,
        ``status``, ``created_after``, ``created_before``, ``correlation``,
        ``idempotency_key``, ``order``, ``limit``, ``cursor``. The protocol
        handler validates them, so both transports accept and refuse the same
        parameters.
        """
        return await self._call(Operation.LIST_RUNS, query=query)

    async def get_run(self, run_id: str) -> dict[str, Any]:
        """``GET /v1/api/runs/{run}``: the run status."""
        return await self._call(Operation.GET_RUN, target=run_id)

    async def journal(self, run_id: str, *, after_seq: int | None = None,
                      limit: int | None = None) -> dict[str, Any]:
        """``GET /v1/api/runs/{run}/journal`` -> ``{"run_id", "events"}``."""
        return await self._call(Operation.JOURNAL, target=run_id,
                                query={"after_seq": after_seq, "limit": limit})

    async def export(self, run_id: str) -> dict[str, Any]:
        """``GET /v1/api/runs/{run}/export``."""
        return await self._call(Operation.EXPORT, target=run_id)

    async def result(self, run_id: str, *, wait_ms: int | None = None) -> dict[str, Any]:
        """``GET /v1/api/runs/{run}/result`` -> ``{"run_id", "status", "result", "error"}``."""
        return await self._call(Operation.RESULT, target=run_id, query={"wait_ms": wait_ms})

    async def signal(self, run_id: str, body: dict[str, Any]) -> dict[str, Any]:
        """``POST /v1/api/runs/{run}/signal``."""
        return await self._call(Operation.SIGNAL, target=run_id, body=body)

    async def cancel(self, run_id: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        """``POST /v1/api/runs/{run}/cancel``."""
        return await self._call(Operation.CANCEL, target=run_id,
                                body=NO_BODY if body is None else body)

    async def retry(self, run_id: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        """``POST /v1/api/runs/{run}/retry`` -> ``{"run_id", "status", "step_id"}``."""
        return await self._call(Operation.RETRY, target=run_id,
                                body=NO_BODY if body is None else body)

    async def fork(self, run_id: str, body: dict[str, Any]) -> dict[str, Any]:
        """``POST /v1/api/runs/{run}/fork`` -> ``{"run_id", "created", "forked_from"}``."""
        return await self._call(Operation.FORK, target=run_id, body=body)

    # -- operations ----------------------------------------------------------------------

    async def workers(self) -> dict[str, Any]:
        """``GET /v1/api/workers`` -> ``{"workers"}``."""
        return await self._call(Operation.LIST_WORKERS)

    async def audit(self, *, limit: int | None = None,
                    cursor: str | None = None) -> dict[str, Any]:
        """``GET /v1/api/audit`` -> ``{"entries", "next_cursor"}``."""
        return await self._call(Operation.AUDIT, query={"limit": limit, "cursor": cursor})

    async def actors(self) -> dict[str, Any]:
        """``GET /v1/api/actors`` -> ``{"tree"}``."""
        return await self._call(Operation.ACTORS)

    async def kill(self, body: dict[str, Any]) -> dict[str, Any]:
        """``POST /v1/api/actors/kill`` -> ``{"path"}``."""
        return await self._call(Operation.KILL, body=body)

    async def definitions(self) -> dict[str, Any]:
        """``GET /v1/api/definitions`` -> ``{"definitions"}``: every registered definition."""
        return await self._call(Operation.DEFINITIONS)

    async def stats(self) -> dict[str, Any]:
        """``GET /v1/api/stats`` -> ``{"runs_by_status", "workers", "live_leases"}``."""
        return await self._call(Operation.STATS)

    async def daemon(self) -> dict[str, Any]:
        """``GET /v1/api/daemon`` -> ``{"version", "otel", "retention", "data_dir_bytes", ...}``."""
        return await self._call(Operation.DAEMON)


    # -- schedules, retention (docs/schedules.md, docs/storage.md "Retention") ---------------

    async def create_schedule(self, body: dict[str, Any]) -> dict[str, Any]:
        """``POST /v1/api/schedules`` -> the schedule."""
        return await self._call(Operation.CREATE_SCHEDULE, body=body)

    async def list_schedules(self, **query: Any) -> dict[str, Any]:
        """``GET /v1/api/schedules`` -> ``{"schedules", "next_cursor"}`` (``limit``, ``cursor``)."""
        return await self._call(Operation.LIST_SCHEDULES, query=query)

    async def get_schedule(self, schedule_id: str) -> dict[str, Any]:
        """``GET /v1/api/schedules/{schedule}``."""
        return await self._call(Operation.GET_SCHEDULE, target=schedule_id)

    async def pause_schedule(self, schedule_id: str,
                             body: dict[str, Any] | None = None) -> dict[str, Any]:
        """``POST /v1/api/schedules/{schedule}/pause`` -> the schedule."""
        return await self._call(Operation.PAUSE_SCHEDULE, target=schedule_id,
                                body=NO_BODY if body is None else body)

    async def resume_schedule(self, schedule_id: str,
                              body: dict[str, Any] | None = None) -> dict[str, Any]:
        """``POST /v1/api/schedules/{schedule}/resume`` -> the schedule."""
        return await self._call(Operation.RESUME_SCHEDULE, target=schedule_id,
                                body=NO_BODY if body is None else body)

    async def delete_schedule(self, schedule_id: str) -> dict[str, Any]:
        """``DELETE /v1/api/schedules/{schedule}``."""
        return await self._call(Operation.DELETE_SCHEDULE, target=schedule_id)

    async def prune_runs(self, body: dict[str, Any]) -> dict[str, Any]:
        """``POST /v1/api/runs/prune`` -> ``{"deleted", "more"}``."""
        return await self._call(Operation.PRUNE_RUNS, body=body)
