"""The runs API and the worker calls as data, sans I/O (STYLE.md rule 1).

A `Call` says everything a backend needs to perform one operation, over HTTP
(method, path, query, JSON body) or in process (the `InProcess` method name and
its arguments), and whether retrying it is safe. The sync and async clients
and the worker build calls here and hand them to a backend; only the backends
do I/O. The shapes are PROTOCOL.md's and ``transport/openapi.json``'s.
"""

from __future__ import annotations

import string
from dataclasses import field
from typing import Any, Final
from urllib.parse import quote

from stepd.sansio.frozen import frozen

__all__ = ["NO_BODY", "Call"]

NO_BODY: Final = None


@frozen
class Call:
    """One operation of the protocol.

    Attributes:
        op: the `stepd.transport.inprocess.InProcess` method name.
        method, path: the HTTP request line.
        target: the path id (run or lease), passed first in process.
        query: query parameters (None values are left out).
        body: the JSON body, or None for none.
        idempotent: safe to send again when the answer was lost (or 503).
        hold_s: how long the daemon may hold the request (long-polls), added
            to the client's timeout.
    """

    op: str
    method: str
    path: str
    target: str | None = None
    query: dict[str, Any] = field(default_factory=dict)
    body: Any = NO_BODY
    idempotent: bool = False
    hold_s: float = 0.0

    def params(self) -> dict[str, Any]:
        return {k: v for k, v in self.query.items() if v is not None}

    def inproc_args(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Positional and keyword arguments of the `InProcess` method."""
        args: list[Any] = []
        if self.target is not None:
            args.append(self.target)
        if self.body is not NO_BODY:
            args.append(self.body)
        return tuple(args), self.params()


SAFE_ID: Final = frozenset(string.ascii_letters + string.digits + "_-.~")
"""What a path segment holds unquoted (RFC 3986's unreserved): every id stepd makes."""


def _seg(value: str) -> str:
    # `quote` is ~10 calls in Python (a result call's path, even in process, where it
    # is not used): only an id that needs it pays them.
    return value if SAFE_ID.issuperset(value) else quote(value, safe="")


# --------------------------------------------------------------------------- runs API


def start_run(workflow: str, input: Any, *, version: str | None, correlation: Any,
              idempotency_key: str | None, deadline_ms: int | None) -> Call:
    body: dict[str, Any] = {"workflow": workflow, "input": input}
    if version is not None:
        body["version"] = version
    if correlation is not None:
        body["correlation"] = correlation
    if idempotency_key is not None:
        body["idempotency_key"] = idempotency_key
    if deadline_ms is not None:
        body["deadline_ms"] = deadline_ms
    # With a key, sending again returns the original run: safe to retry.
    return Call("start_run", "POST", "/v1/api/runs", body=body,
                idempotent=idempotency_key is not None)


def get_run(run_id: str) -> Call:
    return Call("get_run", "GET", f"/v1/api/runs/{_seg(run_id)}", target=run_id, idempotent=True)


def result(run_id: str, wait_ms: int) -> Call:
    return Call("result", "GET", f"/v1/api/runs/{_seg(run_id)}/result", target=run_id,
                query={"wait_ms": wait_ms}, idempotent=True, hold_s=wait_ms / 1000)


def journal(run_id: str, after_seq: int, limit: int) -> Call:
    return Call("journal", "GET", f"/v1/api/runs/{_seg(run_id)}/journal", target=run_id,
                query={"after_seq": after_seq, "limit": limit}, idempotent=True)


def export(run_id: str) -> Call:
    return Call("export", "GET", f"/v1/api/runs/{_seg(run_id)}/export", target=run_id,
                idempotent=True)


def signal(run_id: str, name: str, payload: Any) -> Call:
    return Call("signal", "POST", f"/v1/api/runs/{_seg(run_id)}/signal", target=run_id,
                body={"name": name, "payload": payload})


def cancel(run_id: str, reason: str | None = None) -> Call:
    body = {} if reason is None else {"reason": reason}
    return Call("cancel", "POST", f"/v1/api/runs/{_seg(run_id)}/cancel", target=run_id, body=body)


def retry(run_id: str) -> Call:
    # Not retried: a retry whose answer was lost may have resumed the run already.
    return Call("retry", "POST", f"/v1/api/runs/{_seg(run_id)}/retry", target=run_id, body={})


def fork(run_id: str, from_step: str, idempotency_key: str | None) -> Call:
    body: dict[str, Any] = {"from_step": from_step}
    if idempotency_key is not None:
        body["idempotency_key"] = idempotency_key
    # With a key, sending again returns the same fork: safe to retry.
    return Call("fork", "POST", f"/v1/api/runs/{_seg(run_id)}/fork", target=run_id, body=body,
                idempotent=idempotency_key is not None)


def list_runs(workflow: str | None, status: str | None, limit: int, cursor: str | None) -> Call:
    return Call("list_runs", "GET", "/v1/api/runs",
                query={"workflow": workflow, "status": status, "limit": limit, "cursor": cursor},
                idempotent=True)


def workers() -> Call:
    return Call("workers", "GET", "/v1/api/workers", idempotent=True)


def actors() -> Call:
    return Call("actors", "GET", "/v1/api/actors", idempotent=True)


def kill_actor(path: str) -> Call:
    # Not retried: a second kill would kill the restarted actor.
    return Call("kill", "POST", "/v1/api/actors/kill", body={"path": path})


# --------------------------------------------------------------------------- worker calls


def register(body: dict[str, Any]) -> Call:
    return Call("register", "POST", "/v1/api/workers/register", body=body, idempotent=True)


def claim(worker_id: str, max: int, wait_ms: int) -> Call:
    return Call("claim", "POST", "/v1/api/steps/claim",
                body={"worker_id": worker_id, "max": max, "wait_ms": wait_ms},
                hold_s=wait_ms / 1000)


def lease_call(op: str, lease_id: str, body: dict[str, Any]) -> Call:
    """``started``, ``heartbeat``, ``complete`` or ``fail`` on a lease.

    All four are safe to repeat: a repeated ``complete``/``fail`` whose first
    answer was lost is answered ``already_applied`` (PROTOCOL.md).
    """
    return Call(op, "POST", f"/v1/api/steps/{_seg(lease_id)}/{op}", target=lease_id, body=body,
                idempotent=True)


# --------------------------------------------------------------------------- answers


JOURNAL_PAGE: Final = 1000
LIST_PAGE_MAX: Final = 1000
RESULT_CHUNK_MS: Final = 20_000
"""The longest single ``result?wait_ms=`` the clients send; they loop for longer waits."""
