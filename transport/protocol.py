"""The one protocol handler every transport shares (STYLE.md rule 20).

HTTP (`stepd.transport.http`), the worker WebSocket
(`stepd.transport.websocket`) and the in-process adapter
(`stepd.transport.inprocess`) all call `Protocol`: the same request validation,
the same engine calls, the same rejections, the same audit entries. The
transports only frame bytes; they never validate a body or map an error
themselves, so a rejection cannot drift between them.

What `Protocol` does, per call (`Protocol.call`):

1. refuse with 503 while the daemon drains (`Protocol.drain`);
2. validate the path id (an id that does not match its pattern names nothing:
   404), the query and the body exactly as ``transport/openapi.json`` says:
   unknown keys are refused at every level except free JSON, types and ranges
   are checked, and the `Invalid` names the offending field
   (``error.class``, ``spans[0].usage.model``);
3. call the engine (`stepd.actors.daemon.Engine`);
4. shape the answer as the OpenAPI document fixes it;
5. record an audit entry for the audited operations (reads of runs, starts,
   signals, cancels, kills, the workers list, the actor tree and the audit log
   itself; never worker calls). Mutations await their entry's commit before
   answering; reads queue it (docs/http-api.md "Audit log").

`Protocol.handle` is `call` with every `StepdError` mapped to an HTTP status
and body (`error_reply`); the in-process adapter uses `call` and gets the
exceptions.

Errors (closed; STYLE.md rule 15). Besides the engine's (`Invalid` 400,
`NotFound` 404, the four `Conflict`\\ s and `SignalRefused` 409,
`Unprocessable` 422, `Unavailable` 503) and auth's (`Unauthorized` 401,
`Forbidden` 403), this module adds one:

    StepdError
    +-- TooLarge     a request body (or WebSocket message) over the limit: 413
    +-- CrossSite    a keyless daemon refusing a browser-originated request: 403
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Final

import anyio

from stepd.actors import ActorDead, ActorNotFound
from stepd.actors.daemon import Engine, SignalRefused
from stepd.actors.daemon import store as _store
from stepd.actors.daemon.listing import Query as ListQuery
from stepd.actors.daemon.store import InTxn
from stepd.sansio.enums import IdentityEnum
from stepd.sansio.errors import (
    Conflict,
    Invalid,
    NotFound,
    StepdError,
    Unavailable,
    Unprocessable,
)
from stepd.sansio.lease import Op
from stepd.sansio.run import iso_ms
from stepd.storage import StorageClosed, WriteTxn

from ._validate import (
    MAX_CLAIM,
    NO_BODY,
    RUN_STATUSES,
    check_name,
    copy_json,
    decode_json,
    encode_json,
    is_lease_id,
    is_run_id,
    parse_cancel,
    parse_claim,
    parse_complete,
    parse_fail,
    parse_heartbeat,
    parse_kill,
    parse_register,
    parse_signal,
    parse_start_run,
    parse_started,
    query_int,
    query_json,
    query_str,
    query_time,
)
from .audit import AuditAction, AuditEntry, AuditLog, append_txn
from .auth import Forbidden, KeyRing, Need, Principal, Unauthorized, is_loopback_host
from .metrics import DaemonMetrics, Registry, daemon_metrics

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "MAX_CLAIM",
    "NO_BODY",
    "CrossSite",
    "Operation",
    "OperationSpec",
    "Protocol",
    "Reply",
    "TooLarge",
    "copy_json",
    "decode_json",
    "encode_json",
    "error_reply",
    "status_of",
]

log = logging.getLogger("stepd.transport")

DEFAULT_MAX_BODY_BYTES: Final = 8 << 20
"""The default limit on a request body (HTTP) or a message (WebSocket): 8 MiB."""


class TooLarge(StepdError):
    """A request body or WebSocket message over the daemon's limit (HTTP 413)."""


class CrossSite(StepdError):
    """A keyless daemon refusing a request a web page could have made (HTTP 403).

    Without keys, anything that reaches the port may drive the daemon, and a
    web page open in a local browser can reach a loopback port: a cross-site
    ``fetch`` or WebSocket carries an ``Origin`` header, and a DNS-rebinding
    page sends its own host name in ``Host``. So a daemon without keys refuses
    both (never audited: there is no key). With keys a page cannot present one
    (stepd uses no cookies), so the check is off.

    Attributes:
        message: why.
        reason: ``browser_origin`` or ``host_not_loopback``.
    """

    def __init__(self, message: str, *, reason: str) -> None:
        super().__init__(message)
        self.message = message
        self.reason = reason


# --------------------------------------------------------------------------- replies


@dataclass(frozen=True, slots=True)
class Reply:
    """An answer as every transport sends it: an HTTP status and a JSON body."""

    status: int
    body: dict[str, Any]
    headers: tuple[tuple[bytes, bytes], ...] = ()


def status_of(exc: BaseException) -> int:
    """The HTTP status an error answers with (500 for anything unexpected)."""
    if isinstance(exc, Invalid):
        return 400
    if isinstance(exc, Unauthorized):
        return 401
    if isinstance(exc, (Forbidden, CrossSite)):
        return 403
    if isinstance(exc, NotFound):
        return 404
    if isinstance(exc, Conflict):
        return 409
    if isinstance(exc, TooLarge):
        return 413
    if isinstance(exc, Unprocessable):
        return 422
    if isinstance(exc, (Unavailable, StorageClosed)):
        return 503
    return 500


def _reason_of(exc: BaseException) -> str:
    """The audit entry's short reason for a refusal."""
    if isinstance(exc, Conflict):
        return exc.reason
    if isinstance(exc, (Unauthorized, Forbidden)):
        return exc.reason
    return {
        400: "invalid",
        404: "not_found",
        413: "too_large",
        422: "unprocessable",
        503: "unavailable",
    }.get(status_of(exc), "internal")


def _message(exc: BaseException) -> str:
    return getattr(exc, "message", None) or str(exc) or type(exc).__name__


MAX_ECHO: Final = 128
"""The most characters of one run of non-blank text an error repeats (docs/http-api.md "Errors").

Error messages quote what the client sent (a lease or run id, an unknown key,
a path): cut, an answer stays small whatever the input (a 1 MB lease id was
echoed whole in every 404, and a WebSocket queues 256 answers). 128 keeps
every well-formed id and name whole (ids are at most 64 characters, names and
step ids 128).
"""
MAX_MESSAGE: Final = 1024
"""The most characters of an error's ``message`` (and of its ``field``)."""

def _bounded(text: str) -> str:
    """``text`` as an error may repeat it: every run of more than `MAX_ECHO`
    characters without a space cut to its first 64 (``'l_aaa...(1048578 chars)``),
    and at most `MAX_MESSAGE` characters in all."""
    if len(text) <= MAX_ECHO:
        return text
    words = text.split(" ")  # C speed; a regex over a 1 MB id cost ~10 ms
    if any(len(word) > MAX_ECHO for word in words):
        text = " ".join(word if len(word) <= MAX_ECHO else f"{word[:64]}...({len(word)} chars)"
                        for word in words)
    if len(text) > MAX_MESSAGE:
        text = text[:MAX_MESSAGE - 3] + "..."
    return text


def error_reply(exc: BaseException) -> Reply:
    """The status and body an error answers with (OpenAPI "Errors").

    400 ``{"error": "invalid", "message", "field"[, "definition"]}``; 401
    ``unauthorized`` (with ``WWW-Authenticate``); 403 ``forbidden``; 404
    ``not_found``; 409 ``{"error": "conflict", "reason", "message"}`` (and
    ``budget`` for a refused signal); 413 ``too_large``; 422 ``unprocessable``;
    503 ``unavailable``; anything else 500 ``internal``. What the body repeats
    of the client's input is cut (`_bounded`).
    """
    status = status_of(exc)
    if isinstance(exc, Invalid):
        field = exc.field
        body: dict[str, Any] = {"error": "invalid", "message": _bounded(str(exc)),
                                "field": field if field is None else _bounded(field)}
        if exc.definition is not None:
            body["definition"] = _bounded(exc.definition)
        return Reply(400, body)
    if isinstance(exc, Unauthorized):
        return Reply(
            401,
            {"error": "unauthorized", "message": _bounded(exc.message)},
            ((b"www-authenticate", exc.www_authenticate.encode("latin-1")),),
        )
    if isinstance(exc, (Forbidden, CrossSite)):
        return Reply(403, {"error": "forbidden", "message": _bounded(exc.message)})
    if isinstance(exc, SignalRefused):
        return Reply(
            409,
            {"error": "conflict", "reason": exc.reason, "budget": exc.budget,
             "message": _bounded(exc.message)},
        )
    if isinstance(exc, Conflict):
        return Reply(
            409,
            {"error": "conflict", "reason": exc.reason,
             "message": _bounded(exc.message or exc.reason)},
        )
    if isinstance(exc, Unprocessable):
        return Reply(422, {"error": "unprocessable", "message": _bounded(_message(exc)),
                           "field": None})
    code = {
        404: "not_found",
        413: "too_large",
        503: "unavailable",
    }.get(status, "internal")
    message = _bounded(_message(exc)) if status != 500 else "internal error; see the daemon's log"
    return Reply(status, {"error": code, "message": message})


# --------------------------------------------------------------------------- operations


class Operation(IdentityEnum):
    """Every call of PROTOCOL.md, whatever carries it."""

    REGISTER = "register"
    CLAIM = "claim"
    STARTED = "started"
    HEARTBEAT = "heartbeat"
    COMPLETE = "complete"
    FAIL = "fail"
    START_RUN = "start_run"
    LIST_RUNS = "list_runs"
    GET_RUN = "get_run"
    JOURNAL = "journal"
    EXPORT = "export"
    RESULT = "result"
    SIGNAL = "signal"
    CANCEL = "cancel"
    LIST_WORKERS = "list_workers"
    AUDIT = "audit"
    ACTORS = "actors"
    KILL = "kill"
    DEFINITIONS = "definitions"
    STATS = "stats"


@dataclass(frozen=True, slots=True)
class OperationSpec:
    """What an operation needs and how it is recorded.

    Attributes:
        need: the scope group (`Need`).
        audit: the audit action, or None (worker calls are never audited).
        target: which path id the operation takes: ``"run"``, ``"lease"`` or None.
        body: ``"none"``, ``"optional"`` (omitted means ``{}``) or ``"required"``.
        mutation: an audited change (its entry is committed before the answer).
    """

    need: Need
    audit: AuditAction | None
    target: str | None
    body: str
    mutation: bool = False


SPECS: Final[Mapping[Operation, OperationSpec]] = {
    Operation.REGISTER: OperationSpec(Need.WORKER, None, None, "required"),
    Operation.CLAIM: OperationSpec(Need.WORKER, None, None, "required"),
    Operation.STARTED: OperationSpec(Need.WORKER, None, "lease", "optional"),
    Operation.HEARTBEAT: OperationSpec(Need.WORKER, None, "lease", "optional"),
    Operation.COMPLETE: OperationSpec(Need.WORKER, None, "lease", "required"),
    Operation.FAIL: OperationSpec(Need.WORKER, None, "lease", "required"),
    Operation.START_RUN: OperationSpec(Need.EXECUTE, AuditAction.RUNS_START, None, "required",
                                       mutation=True),
    Operation.LIST_RUNS: OperationSpec(Need.READ, AuditAction.RUNS_LIST, None, "none"),
    Operation.GET_RUN: OperationSpec(Need.READ, AuditAction.RUNS_READ, "run", "none"),
    Operation.JOURNAL: OperationSpec(Need.READ, AuditAction.RUNS_JOURNAL, "run", "none"),
    Operation.EXPORT: OperationSpec(Need.READ, AuditAction.RUNS_EXPORT, "run", "none"),
    Operation.RESULT: OperationSpec(Need.READ, AuditAction.RUNS_RESULT, "run", "none"),
    Operation.SIGNAL: OperationSpec(Need.EXECUTE, AuditAction.RUNS_SIGNAL, "run", "required",
                                    mutation=True),
    Operation.CANCEL: OperationSpec(Need.EXECUTE, AuditAction.RUNS_CANCEL, "run", "optional",
                                    mutation=True),
    Operation.LIST_WORKERS: OperationSpec(Need.READ, AuditAction.WORKERS_READ, None, "none"),
    Operation.AUDIT: OperationSpec(Need.ADMIN, AuditAction.AUDIT_READ, None, "none"),
    Operation.ACTORS: OperationSpec(Need.ADMIN, AuditAction.ACTORS_READ, None, "none"),
    Operation.KILL: OperationSpec(Need.ADMIN, AuditAction.ACTORS_KILL, None, "required",
                                  mutation=True),
    Operation.DEFINITIONS: OperationSpec(Need.READ, AuditAction.DEFINITIONS_READ, None, "none"),
    Operation.STATS: OperationSpec(Need.READ, AuditAction.STATS_READ, None, "none"),
}

_LEASE_OPS: Final[Mapping[Operation, Op]] = {
    Operation.STARTED: Op.STARTED,
    Operation.HEARTBEAT: Op.HEARTBEAT,
    Operation.COMPLETE: Op.COMPLETE,
    Operation.FAIL: Op.FAIL,
}
_LEASE_PARSERS: Final[Mapping[Operation, Callable[[Any], dict[str, Any]]]] = {
    Operation.STARTED: parse_started,
    Operation.HEARTBEAT: parse_heartbeat,
    Operation.COMPLETE: parse_complete,
    Operation.FAIL: parse_fail,
}

LONG_POLLS: Final = frozenset({Operation.CLAIM, Operation.RESULT})
"""Operations that may hold the request open: they end at once when the daemon drains."""

WORKER_OPERATIONS: Final = frozenset(op for op, spec in SPECS.items() if spec.need is Need.WORKER)


# --------------------------------------------------------------------------- the handler


class Protocol:
    """The protocol handler: validation, engine calls, error mapping, audit, drain.

    One per daemon; every transport holds the same one.

    Attributes:
        engine: the engine it drives.
        keyring: the configured keys (auth disabled when empty).
        audit: the audit log (None: nothing is audited, for tests of the engine alone).
        registry: the Prometheus registry ``/metrics`` renders.
        metrics: the daemon's metric set, registered in ``registry``.
        max_body_bytes: the largest request body (HTTP) or message (WebSocket).
        draining: True once `drain` began: every new call answers 503.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        keyring: KeyRing | None = None,
        audit: AuditLog | None = None,
        registry: Registry | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    ) -> None:
        if isinstance(max_body_bytes, bool) or not isinstance(max_body_bytes, int) \
                or max_body_bytes < 1:
            raise Invalid("must be a positive integer", field="max_body_bytes")
        self.engine = engine
        self.keyring = keyring if keyring is not None else KeyRing.from_config()
        self.audit = audit
        self.registry = registry if registry is not None else Registry()
        self.metrics: DaemonMetrics = daemon_metrics(self.registry)
        self.max_body_bytes = max_body_bytes
        self.draining = False
        self._inflight = 0
        # Made only by wait_quiet (shutdown) while calls are in flight: an
        # Event per call going from idle to busy cost more than the call's
        # bookkeeping.
        self._idle: anyio.Event | None = None
        self._polls: set[anyio.CancelScope] = set()
        self._calls: set[anyio.CancelScope] = set()
        self._aborted = False
        self._claiming: dict[str, int] = {}
        self._connections: set[Any] = set()  # WorkerConnection: close_for_shutdown(), abort()
        self._batches_seen: tuple[int, ...] = ()  # storage batch-size buckets already observed
        self.metrics.runs_by_status.set_function(lambda: self._runs_by_status)
        self._runs_by_status: dict[str, int] = {}

    # ------------------------------------------------------------------ auth

    def authorize(self, op: Operation, authorization: str | None) -> Principal:
        """Who calls, and may they do ``op`` (PROTOCOL.md "Authentication and scopes").

        Raises:
            Unauthorized: no key, a malformed header, an unknown key.
            Forbidden: a known key without the scope.
        """
        return self.keyring.authorize(authorization, SPECS[op].need)

    def check_keyless(self, host: str | None, origin: str | None) -> None:
        """Without keys, refuse what a web page could send (`CrossSite`); with keys, nothing.

        Args:
            host: the ``Host`` header (``127.0.0.1:7707``), None when absent.
            origin: the ``Origin`` header, None when absent.

        Raises:
            CrossSite: an ``Origin`` header of another site (a browser page
                elsewhere), or a ``Host`` that does not name a loopback address
                (DNS rebinding). The daemon's own pages (the console at ``/ui``)
                are same-origin: ``Origin`` is ``http://`` plus the loopback
                ``Host`` itself, which no other site can send.
        """
        if self.keyring.enabled:
            return
        if origin is not None and not (
                host is not None and origin == f"http://{host}"
                and is_loopback_host(_host_name(host))):
            raise CrossSite(
                "a daemon without API keys does not serve browser requests (Origin "
                f"{origin!r}); configure keys to serve them", reason="browser_origin")
        if host is None or not is_loopback_host(_host_name(host)):
            raise CrossSite(
                "a daemon without API keys answers only requests addressed to a loopback "
                f"host, not {host!r}", reason="host_not_loopback")

    async def refused(self, op: Operation, exc: Unauthorized | Forbidden,
                      target: str | None = None) -> Reply:
        """The answer to a refused authorization; a 403 is audited, a 401 is not."""
        if isinstance(exc, Forbidden):
            await self._audit(op, None, target, 403, exc.reason, key_id=exc.key_id)
        return error_reply(exc)

    # ------------------------------------------------------------------ calls

    async def call(
        self,
        op: Operation,
        principal: Principal,
        *,
        target: str | None = None,
        query: Mapping[str, Any] | None = None,
        body: Any = NO_BODY,
        error: StepdError | None = None,
        worker_id: str | None = None,
    ) -> Reply:
        """Run one operation for an authorized caller; record its audit entry.

        Args:
            op: the operation.
            principal: the caller (`authorize`).
            target: the path id (run or lease id) when the operation takes one.
            query: query parameters (strings, or ints in process).
            body: the decoded JSON body, or `NO_BODY`.
            error: a refusal the transport found before the body could be
                decoded (413, malformed JSON): recorded and raised as is.
            worker_id: the worker registered on the caller's connection, for
                the lease operations: a lease held by another worker is then
                unknown to it (404). None where the transport cannot know
                (plain HTTP); "" for a connection not registered yet.

        Returns:
            The success `Reply` (status 200 or 201).

        Raises:
            StepdError: the refusal (`error_reply` maps it); `Unavailable` while
                draining.
        """
        spec = SPECS[op]
        audit_target = target
        try:
            if self.draining:
                raise Unavailable("the daemon is shutting down")
            if error is not None:
                raise error
            if spec.body == "none" and body is not NO_BODY:
                raise Invalid("this call takes no body")
            if op is Operation.KILL:
                audit_target = parse_kill(body)
            if op in LONG_POLLS:
                with self.long_poll() as scope:
                    reply = await self._run(op, target, query or {}, body)
                if scope.cancelled_caught:
                    raise Unavailable("the daemon is shutting down")
            elif op in _AUDITED_IN_TXN:
                audit = _TxnAudit(self, principal, op)
                reply = await self._run(op, target, query or {}, body, audit)
                if audit.written:
                    return reply  # its audit entry committed with the change
            else:
                reply = await self._run(op, target, query or {}, body, worker_id=worker_id)
        except StepdError as exc:
            status = status_of(exc)
            if status != 503:
                await self._audit(op, principal, audit_target, status, _reason_of(exc))
            raise
        if op is Operation.START_RUN:
            audit_target = reply.body["run_id"]  # who started (or re-found) which run
        await self._audit(op, principal, audit_target, reply.status, None)
        return reply

    async def handle(
        self,
        op: Operation,
        principal: Principal,
        *,
        target: str | None = None,
        query: Mapping[str, Any] | None = None,
        body: Any = NO_BODY,
        error: StepdError | None = None,
        worker_id: str | None = None,
    ) -> Reply:
        """`call`, with every error mapped to its status and body (`error_reply`).

        An unexpected exception (a bug) is logged with its traceback and
        answered 500; it does not take the connection down with it.
        """
        try:
            return await self.call(op, principal, target=target, query=query, body=body,
                                   error=error, worker_id=worker_id)
        except (StepdError, StorageClosed) as exc:
            return error_reply(exc)
        except Exception as exc:
            log.exception("%s failed (target %r): answered 500", op.value,
                          _bounded(target) if isinstance(target, str) else target)
            return error_reply(exc)

    async def _start_run(self, body: Any, in_txn: InTxn | None) -> Reply:
        args = parse_start_run(body)
        run_id, created = await self.engine.start_run(
            args["workflow"], args["input"], version=args["version"],
            correlation=args["correlation"], idempotency_key=args["idempotency_key"],
            deadline_ms=args["deadline_ms"], in_txn=in_txn,
        )
        return Reply(201 if created else 200, {"run_id": run_id, "created": created})

    async def _run(self, op: Operation, target: str | None, query: Mapping[str, Any],
                   body: Any, audit: _TxnAudit | None = None, *,
                   worker_id: str | None = None) -> Reply:
        e = self.engine
        spec = SPECS[op]
        run_id = lease_id = ""
        if spec.target == "run":
            if not is_run_id(target):
                raise NotFound(f"run {target!r} not found")
            run_id = target
        elif spec.target == "lease":
            if not is_lease_id(target):
                raise NotFound(f"lease {target!r} not found")
            lease_id = target

        lease_op = _LEASE_OPS.get(op)
        if lease_op is not None:
            parsed = _LEASE_PARSERS[op](body)
            answer = await e.lease_call(lease_id, lease_op, parsed, caller=worker_id)
            return Reply(200, dict(answer))

        if op is Operation.CLAIM:
            args = parse_claim(body)
            return Reply(200, {"leases": await self._claim(**args)})
        if op is Operation.REGISTER:
            args = parse_register(body)
            wid = args.get("worker_id")
            if wid is not None and e.storage.get(_store.WORKERS, wid) is None:
                raise NotFound(f"worker {wid!r} is not registered: register without worker_id")
            return Reply(200, await e.register_worker(**args))

        in_txn = audit.write if audit is not None and audit.enabled else None
        if op is Operation.START_RUN:
            return await self._start_run(body, in_txn)
        if op is Operation.GET_RUN:
            return Reply(200, e.status(run_id))
        if op is Operation.LIST_RUNS:
            return Reply(200, self._list_runs(query))
        if op is Operation.JOURNAL:
            after = query_int(query, "after_seq", 0, minimum=0)
            limit = query_int(query, "limit", 1000, minimum=1, maximum=10_000)
            events = e.journal(run_id, after_seq=after, limit=limit)
            return Reply(200, {"run_id": run_id, "events": events})
        if op is Operation.EXPORT:
            return Reply(200, e.export(run_id))
        if op is Operation.RESULT:
            wait_ms = query_int(query, "wait_ms", 0, minimum=0)
            view = await e.result(run_id, wait_ms=min(wait_ms, e.config.claim_hold_ms))
            return Reply(200, {"run_id": view["run_id"], "status": view["status"],
                               "result": view["result"], "error": view["error"]})
        if op is Operation.SIGNAL:
            args = parse_signal(body)
            await e.signal(run_id, args["name"], args["payload"], in_txn=in_txn)
            return Reply(200, {})
        if op is Operation.CANCEL:
            parse_cancel(body)
            await e.cancel(run_id, in_txn=in_txn)
            return Reply(200, {})
        if op is Operation.LIST_WORKERS:
            return Reply(200, {"workers": self._workers()})
        if op is Operation.AUDIT:
            if self.audit is None:
                return Reply(200, {"entries": [], "next_cursor": None})
            limit = query_int(query, "limit", 100, minimum=1, maximum=1000)
            entries, cursor = self.audit.page(limit, query_str(query, "cursor"))
            return Reply(200, {"entries": [x.to_dict() for x in entries], "next_cursor": cursor})
        if op is Operation.ACTORS:
            return Reply(200, {"tree": e.actors()})
        if op is Operation.KILL:
            path = parse_kill(body)
            restarted = await e.kill(path)
            return Reply(200, {"path": path, "restarted": restarted})
        if op is Operation.DEFINITIONS:
            return Reply(200, {"definitions": [dict(d, registered_at=iso_ms(d["registered_at"]))
                                               for d in e.definitions()]})
        if op is Operation.STATS:
            # Runs by status from the engine's counters (kept by every transition,
            # as /metrics reads them); workers as GET /v1/api/workers lists them.
            workers = self._workers()
            return Reply(200, {
                "runs_by_status": {s: max(0, e.status_counts.get(s, 0))
                                   for s in sorted(RUN_STATUSES)},
                "workers": {"registered": len(workers),
                            "connected": sum(1 for w in workers if w["connected"])},
                "live_leases": sum(len(w["leases"]) for w in workers),
            })
        raise AssertionError(f"unhandled operation {op}")  # pragma: no cover

    # -- the operations that need more than one engine call --------------------------------

    async def _claim(self, *, worker_id: str, max: int, wait_ms: int,
                     run_id: str | None) -> list[dict[str, Any]]:
        e = self.engine
        if run_id is not None and e.storage.get(_store.RUNS, run_id) is None:
            raise NotFound(f"run {run_id!r} not found")
        self._claiming[worker_id] = self._claiming.get(worker_id, 0) + 1
        try:
            return await e.claim(worker_id, max=max, wait_ms=wait_ms, run_id=run_id)
        finally:
            left = self._claiming[worker_id] - 1
            if left:
                self._claiming[worker_id] = left
            else:
                del self._claiming[worker_id]

    def _list_runs(self, query: Mapping[str, Any]) -> dict[str, Any]:
        workflow = query_str(query, "workflow")
        if workflow is not None:
            check_name(workflow, "workflow")
        status = query_str(query, "status")
        if status is not None and status not in RUN_STATUSES:
            raise Invalid(f"must be one of {', '.join(sorted(RUN_STATUSES))}", field="status")
        order = query_str(query, "order") or "desc"
        if order not in ("desc", "asc"):
            raise Invalid("must be desc (newest first) or asc", field="order")
        key = query_str(query, "idempotency_key")
        if key is not None and (not key or len(key.encode("utf-8", "surrogatepass")) > 256):
            raise Invalid("must be a non-empty string of at most 256 bytes",
                          field="idempotency_key")
        cursor = query_str(query, "cursor")
        if cursor is not None and not 0 < len(cursor) <= 2048:
            raise Invalid("must be the next_cursor of an earlier page of the same query",
                          field="cursor")
        q = ListQuery(
            workflow=workflow, status=status,
            created_after=query_time(query, "created_after"),
            created_before=query_time(query, "created_before"),
            correlation=query_json(query, "correlation"), idempotency_key=key, order=order,
            limit=query_int(query, "limit", 100, minimum=1, maximum=1000), cursor=cursor,
        )
        runs, next_cursor = self.engine.list_runs(q)
        for run in runs:
            for k in ("created_at", "updated_at"):
                if isinstance(run.get(k), int):
                    run[k] = iso_ms(run[k])
        return {"runs": runs, "next_cursor": next_cursor}

    def connected_workers(self) -> set[str]:
        """Workers with an open WebSocket or a claim in flight."""
        connected = set(self._claiming)
        for conn in self._connections:
            wid = getattr(conn, "worker_id", None)
            if wid is not None:
                connected.add(wid)
        return connected

    def _workers(self) -> list[dict[str, Any]]:
        """Connected workers first, then the most recently active."""
        connected = self.connected_workers() | self.engine.connected_workers()
        active = self.engine.worker_active
        out = []
        for info in self.engine.workers():
            info = dict(info)
            info["connected"] = bool(info.get("connected")) or info["worker_id"] in connected
            seen = info.get("last_heartbeat_at")
            info["last_heartbeat_at"] = None if seen is None else iso_ms(seen)
            out.append(info)
        out.sort(key=lambda w: (not w["connected"], -active.get(w["worker_id"], 0)))
        return out

    # ------------------------------------------------------------------ audit

    async def _audit(self, op: Operation, principal: Principal | None, target: str | None,
                     status: int, reason: str | None, *, key_id: str | None = None) -> None:
        spec = SPECS[op]
        if spec.audit is None or self.audit is None:
            return
        entry = self.audit.new_entry(
            key_id=principal.key_id if principal is not None else key_id,
            scope=principal.scope.value if principal is not None else None,
            action=spec.audit,
            # A refused path id may be 64 KiB: the durable entry keeps it bounded.
            target=_bounded(target) if isinstance(target, str) else None,
            status=status,
            reason=reason,
        )
        try:
            if spec.mutation:
                # The entry is durable before the answer: acknowledged implies audited.
                await self.engine.storage.write(append_txn, entry, self.audit.next_seq())
            else:
                await self.audit.record(entry)
        except StorageClosed:
            log.warning("audit entry dropped: the storage is closed (%s %s)", entry.action,
                        entry.target)

    # ------------------------------------------------------------------ drain

    @contextlib.contextmanager
    def tracking(self) -> Iterator[anyio.CancelScope]:
        """Count one call in flight for the duration; `abort` cancels its scope.

        Shutdown waits for the calls in flight (`wait_quiet`); once the grace
        period is over it cancels them (`abort`): the transport then answers
        503 if it still can (a write already submitted still commits).
        """
        self._inflight += 1
        scope = anyio.CancelScope()
        if self._aborted:
            scope.cancel()
        self._calls.add(scope)
        try:
            with scope:
                yield scope
        finally:
            self._calls.discard(scope)
            self._call_done()

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        """`tracking` without a cancel scope of its own: counted, not cancelled by `abort`.

        For calls that `abort` reaches another way: a WebSocket frame's call
        runs in its connection's task group, which `abort` cancels as a whole
        (`WorkerConnection.abort`). That spares two cancel scopes per step.
        """
        self._inflight += 1
        try:
            yield
        finally:
            self._call_done()

    def _call_done(self) -> None:
        self._inflight -= 1
        if self._inflight == 0 and self._idle is not None:
            self._idle.set()
            self._idle = None

    @property
    def inflight(self) -> int:
        """Calls in flight (HTTP requests and WebSocket frames being answered)."""
        return self._inflight

    @contextlib.contextmanager
    def long_poll(self) -> Iterator[anyio.CancelScope]:
        """A cancel scope `begin_drain` cancels: long-polls end at once when the daemon drains."""
        scope = anyio.CancelScope()
        if self.draining:
            scope.cancel()
        self._polls.add(scope)
        try:
            with scope:
                yield scope
        finally:
            self._polls.discard(scope)

    def add_connection(self, conn: Any) -> None:
        """A WebSocket connection the drain must close (``close_for_shutdown()``, ``abort()``)."""
        self._connections.add(conn)

    def remove_connection(self, conn: Any) -> None:
        self._connections.discard(conn)

    def begin_drain(self) -> None:
        """Shutdown stages 1 and 2 (STYLE.md rule 22): refuse new calls, stop handing out leases.

        Every new call answers 503; the engine stops offering leases; held
        long-polls end (503); every WebSocket stops reading and pushing and
        closes with 1001 once its in-flight frames are answered. Idempotent.
        """
        if self.draining:
            return
        self.draining = True
        self.engine.closing = True
        for scope in list(self._polls):
            scope.cancel()
        for conn in list(self._connections):
            conn.close_for_shutdown()

    async def wait_quiet(self) -> None:
        """Wait until no call is in flight and every WebSocket has closed."""
        while True:
            if self._inflight:
                if self._idle is None:
                    self._idle = anyio.Event()
                await self._idle.wait()
            if not self._connections:
                return
            await anyio.sleep(0.005)

    def abort(self) -> None:
        """The grace period is over: cancel every call in flight and every WebSocket."""
        self._aborted = True
        for scope in list(self._calls):
            scope.cancel()
        for conn in list(self._connections):
            conn.abort()

    async def drain(self, grace_s: float) -> bool:
        """`begin_drain`; wait for calls in flight at most ``grace_s``; then `abort` the rest.

        Returns:
            True when everything in flight finished within the grace period.
        """
        self.begin_drain()
        with anyio.move_on_after(grace_s):
            await self.wait_quiet()
            return True
        self.abort()
        with anyio.move_on_after(1.0):
            await self.wait_quiet()
        return False

    # ------------------------------------------------------------------ metrics

    async def render_metrics(self) -> str:
        """The Prometheus exposition text (docs/http-api.md "Metrics")."""
        e = self.engine
        m = self.metrics
        self._runs_by_status = {k: v for k, v in e.status_counts.items() if v > 0}
        try:
            m.live_leases.set(len(e.system.supervisor("/leases").which_children()))
        except (ActorDead, ActorNotFound):
            log.debug("/leases is restarting: stepd_live_leases keeps its last value")
        try:
            stats = await e.registry_stats()
            m.waiting_claims.set(stats.waiting_claims)
        except (ActorDead, ActorNotFound, Unavailable):
            log.debug("/registry is restarting: stepd_waiting_claims keeps its last value")
        m.connected_workers.set(len(self.connected_workers()))
        _drain_into(e.run_to_complete, m.run_to_complete_seconds.observe)
        _drain_into(e.schedule_to_start, m.step_schedule_to_start_seconds.observe)
        # Batch sizes: the storage counts batches per power-of-two size bucket;
        # each new batch is observed at its bucket's upper bound (the buckets
        # of stepd_commit_batch_size are the same powers of two, so counts and
        # buckets are exact; the sum is an upper bound).
        s = e.storage.statistics()
        seen = self._batches_seen
        for i, count in enumerate(s.batch_sizes):
            new = count - (seen[i] if i < len(seen) else 0)
            for _ in range(min(new, 10_000)):
                m.commit_batch_size.observe(float(1 << i))
        self._batches_seen = s.batch_sizes
        return self.registry.render()


def _host_name(host: str) -> str:
    """The host of a ``Host`` header, without its port (``[::1]:80`` -> ``[::1]``)."""
    host = host.strip()
    if host.startswith("["):
        return host[: host.find("]") + 1] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _drain_into(samples: list[float], observe: Callable[[float], None]) -> None:
    n = len(samples)
    for value in samples[:n]:
        if isinstance(value, (int, float)) and math.isfinite(value):
            observe(max(0.0, float(value)))
    del samples[:n]


_AUDITED_IN_TXN: Final = frozenset({Operation.START_RUN, Operation.SIGNAL, Operation.CANCEL})
"""Mutations whose audit entry is written inside the change's own transaction."""


class _TxnAudit:
    """A start's, signal's or cancel's audit entry, written in the change's transaction.

    Why: the change pays for one synced commit; a second one for its audit
    entry cost ~0.2 ms per call and left a window where the change was durable
    without its entry. Inside the transaction the entry exists if and only if
    the change does. `write` may run twice (a batch re-run after map growth):
    it only sets `written`, which is read after the commit. When nothing is
    written (a refusal, a re-found idempotency key, a signal refused over
    budget) the caller records the entry itself.
    """

    __slots__ = ("base", "seq", "written")

    def __init__(self, protocol: Protocol, principal: Principal, op: Operation) -> None:
        self.base: AuditEntry | None = None
        self.seq = 0
        self.written = False
        audit = protocol.audit
        if audit is None:
            return
        spec = SPECS[op]
        assert spec.audit is not None
        self.base = audit.new_entry(key_id=principal.key_id, scope=principal.scope.value,
                                    action=spec.audit, target=None, status=200)
        self.seq = audit.next_seq()

    @property
    def enabled(self) -> bool:
        return self.base is not None

    def write(self, txn: WriteTxn, run_id: str, created: bool) -> None:
        assert self.base is not None
        entry = dataclasses.replace(self.base, target=run_id, status=201 if created else 200)
        append_txn(txn, entry, self.seq)
        self.written = True
