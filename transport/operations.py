"""Every operation of PROTOCOL.md as a row of one table: its scope, its audit action, the path
id it takes, its body, and the handler that parses the request and calls the daemon's API.

`Protocol.call` looks an operation up here and runs its handler: a table,
not a chain of ifs (the transports map their framing to an `Operation`).
Each handler parses exactly what transport/openapi.json allows (`_validate`),
calls one method of `stepd.actors.daemon.Daemon`, and shapes the answer as
the OpenAPI document fixes it.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Protocol

from stepd.actors.daemon import Daemon
from stepd.actors.daemon.audit import AuditAction, AuditEntry
from stepd.actors.daemon.listing import Query as ListQuery
from stepd.sansio.enums import IdentityEnum
from stepd.sansio.errors import Invalid
from stepd.sansio.frozen import frozen
from stepd.sansio.lease import Op
from stepd.sansio.run import iso_ms

from ._validate import (
    RUN_STATUSES,
    check_name,
    parse_cancel,
    parse_claim,
    parse_complete,
    parse_fail,
    parse_fork,
    parse_heartbeat,
    parse_kill,
    parse_prune,
    parse_register,
    parse_retry,
    parse_schedule_action,
    parse_session_call,
    parse_signal,
    parse_start_run,
    parse_started,
    query_int,
    query_json,
    query_str,
    query_time,
)
from .auth import Need
from .replies import Reply

__all__ = ["LEASE_CALLS", "LONG_POLLS", "SPECS", "WORKER_OPERATIONS", "Context", "Operation",
           "OperationSpec", "Request"]


class Operation(IdentityEnum):
    """Every call of PROTOCOL.md, whatever carries it."""

    REGISTER = "register"
    CLAIM = "claim"
    STARTED = "started"
    HEARTBEAT = "heartbeat"
    COMPLETE = "complete"
    FAIL = "fail"
    HISTORY = "history"
    START_RUN = "start_run"
    LIST_RUNS = "list_runs"
    GET_RUN = "get_run"
    JOURNAL = "journal"
    EXPORT = "export"
    RESULT = "result"
    SIGNAL = "signal"
    CANCEL = "cancel"
    RETRY = "retry"
    FORK = "fork"
    LIST_WORKERS = "list_workers"
    AUDIT = "audit"
    ACTORS = "actors"
    KILL = "kill"
    DEFINITIONS = "definitions"
    STATS = "stats"
    DAEMON = "daemon"
    SESSION_RENEW = "session_renew"
    SESSION_CLOSE = "session_close"
    CREATE_SCHEDULE = "create_schedule"
    LIST_SCHEDULES = "list_schedules"
    GET_SCHEDULE = "get_schedule"
    PAUSE_SCHEDULE = "pause_schedule"
    RESUME_SCHEDULE = "resume_schedule"
    DELETE_SCHEDULE = "delete_schedule"
    PRUNE_RUNS = "prune_runs"


@frozen
class Request:
    """One call as a handler gets it.

    Attributes:
        target: the path id (a run or lease id, already checked), or "".
        query: query parameters (strings over HTTP; ints or strings in process).
        body: the decoded JSON body, or `_validate.NO_BODY`.
        worker_id: the worker registered on the caller's connection (lease
            calls over a WebSocket or in process), None over plain HTTP.
        audit: the entry a mutation writes in its own transaction, or None.
    """

    target: str
    query: Mapping[str, Any]
    body: Any
    worker_id: str | None = None
    audit: AuditEntry | None = None


class Context(Protocol):
    """What a handler sees of the protocol handler that runs it (`protocol.Protocol`)."""

    daemon: Daemon
    audited: bool

    async def workers(self) -> list[dict[str, Any]]: ...


Handler = Callable[[Context, Request], Awaitable[Reply]]


@dataclass(frozen=True, slots=True)
class OperationSpec:
    """What an operation needs, how it is recorded, and what runs it.

    Attributes:
        need: the scope group (`Need`).
        audit: the audit action, or None (worker calls are never audited).
        target: which path id the operation takes: ``"run"``, ``"lease"``,
            ``"session"`` (a worker session), ``"schedule"`` or None.
        body: ``"none"``, ``"optional"`` (omitted means ``{}``) or ``"required"``.
        run: the handler.
        in_txn: its audit entry is written in the change's own transaction
            (starts, signals, cancels); else after the answer is ready.
        mutation: an audited change (its entry is committed before the answer).
    """

    need: Need
    audit: AuditAction | None
    target: str | None
    body: str
    run: Handler
    in_txn: bool = False
    mutation: bool = False


# --------------------------------------------------------------------------- worker calls


async def _register(p: Context, r: Request) -> Reply:
    return Reply(200, await p.daemon.register_worker(**parse_register(r.body)))


async def _claim(p: Context, r: Request) -> Reply:
    args = parse_claim(r.body)
    leases = await p.daemon.claim(args["worker_id"], max=args["max"], wait_ms=args["wait_ms"],
                                  run_id=args["run_id"])
    return Reply(200, {"leases": leases})


LEASE_CALLS: Final[Mapping[Operation, tuple[Op, Callable[[Any], dict[str, Any]]]]] = {
    Operation.STARTED: (Op.STARTED, parse_started),
    Operation.HEARTBEAT: (Op.HEARTBEAT, parse_heartbeat),
    Operation.COMPLETE: (Op.COMPLETE, parse_complete),
    Operation.FAIL: (Op.FAIL, parse_fail),
}
"""The worker's four calls on a lease: the lease operation each is, and its body's parser.

Their rows of `SPECS` run these; `Protocol.lease_call` runs them in one frame
(every step awaits one of them)."""


def _lease_op(op: Op, parse: Callable[[Any], dict[str, Any]]) -> Handler:
    async def handler(p: Context, r: Request) -> Reply:
        answer = await p.daemon.lease_call(r.target, op, parse(r.body), caller=r.worker_id)
        return Reply(200, dict(answer))

    handler.__name__ = f"_{op.value}"
    return handler


async def _history(p: Context, r: Request) -> Reply:
    parse_started(r.body)  # no body, or {}
    return Reply(200, await p.daemon.history(r.target, caller=r.worker_id))


async def _session_renew(p: Context, r: Request) -> Reply:
    worker_id = parse_session_call(r.body, r.worker_id)
    return Reply(200, await p.daemon.session_renew(r.target, worker_id))


async def _session_close(p: Context, r: Request) -> Reply:
    worker_id = parse_session_call(r.body, r.worker_id)
    return Reply(200, await p.daemon.session_close(r.target, worker_id))


# --------------------------------------------------------------------------- runs


async def _start_run(p: Context, r: Request) -> Reply:
    args = parse_start_run(r.body)
    run_id, created = await p.daemon.start_run(
        args["workflow"], args["input"], version=args["version"],
        correlation=args["correlation"], idempotency_key=args["idempotency_key"],
        deadline_ms=args["deadline_ms"], audit=r.audit,
    )
    return Reply(201 if created else 200, {"run_id": run_id, "created": created})


async def _get_run(p: Context, r: Request) -> Reply:
    return Reply(200, p.daemon.status(r.target))


async def _list_runs(p: Context, r: Request) -> Reply:
    query = r.query
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
        raise Invalid("must be a non-empty string of at most 256 bytes", field="idempotency_key")
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
    runs, next_cursor = p.daemon.list_runs(q)
    for run in runs:
        for k in ("created_at", "updated_at"):
            if isinstance(run.get(k), int):
                run[k] = iso_ms(run[k])
    return Reply(200, {"runs": runs, "next_cursor": next_cursor})


async def _journal(p: Context, r: Request) -> Reply:
    after = query_int(r.query, "after_seq", 0, minimum=0)
    limit = query_int(r.query, "limit", 1000, minimum=1, maximum=10_000)
    events = p.daemon.journal(r.target, after_seq=after, limit=limit)
    return Reply(200, {"run_id": r.target, "events": events})


async def _export(p: Context, r: Request) -> Reply:
    return Reply(200, p.daemon.export(r.target))


async def _result(p: Context, r: Request) -> Reply:
    d = p.daemon
    wait_ms = query_int(r.query, "wait_ms", 0, minimum=0)
    return Reply(200, await d.outcome(r.target, wait_ms=min(wait_ms, d.config.claim_hold_ms)))


async def _signal(p: Context, r: Request) -> Reply:
    args = parse_signal(r.body)
    await p.daemon.signal(r.target, args["name"], args["payload"], audit=r.audit)
    return Reply(200, {})


async def _cancel(p: Context, r: Request) -> Reply:
    args = parse_cancel(r.body)
    await p.daemon.cancel(r.target, args["reason"], audit=r.audit)
    return Reply(200, {})


async def _retry(p: Context, r: Request) -> Reply:
    parse_retry(r.body)
    return Reply(200, await p.daemon.retry(r.target, audit=r.audit))


async def _fork(p: Context, r: Request) -> Reply:
    args = parse_fork(r.body)
    run_id, created = await p.daemon.fork(r.target, args["from_step"],
                                          idempotency_key=args["idempotency_key"], audit=r.audit)
    return Reply(201 if created else 200, {
        "run_id": run_id, "created": created,
        "forked_from": {"run_id": r.target, "step_id": args["from_step"]}})


# --------------------------------------------------------------------------- the rest


async def _workers(p: Context, r: Request) -> Reply:
    return Reply(200, {"workers": await p.workers()})


async def _audit(p: Context, r: Request) -> Reply:
    if not p.audited:
        return Reply(200, {"entries": [], "next_cursor": None})
    limit = query_int(r.query, "limit", 100, minimum=1, maximum=1000)
    entries, cursor = p.daemon.audit.page(limit, query_str(r.query, "cursor"))
    return Reply(200, {"entries": [x.to_dict() for x in entries], "next_cursor": cursor})


async def _actors(p: Context, r: Request) -> Reply:
    return Reply(200, {"tree": p.daemon.actors()})


async def _kill(p: Context, r: Request) -> Reply:
    path = parse_kill(r.body)
    restarted = await p.daemon.kill(path)
    return Reply(200, {"path": path, "restarted": restarted})


async def _definitions(p: Context, r: Request) -> Reply:
    return Reply(200, {"definitions": [dict(d, registered_at=iso_ms(d["registered_at"]))
                                       for d in p.daemon.definitions()]})


async def _stats(p: Context, r: Request) -> Reply:
    # Runs by status from the daemon's counters (kept by every transition, as
    # /metrics reads them); workers as GET /v1/api/workers lists them.
    workers = await p.workers()
    counts = p.daemon.stats.status_counts
    return Reply(200, {
        "runs_by_status": {s: max(0, counts.get(s, 0)) for s in sorted(RUN_STATUSES)},
        "workers": {"registered": len(workers),
                    "connected": sum(1 for w in workers if w["connected"])},
        "live_leases": sum(len(w["leases"]) for w in workers),
    })


@functools.cache
def _version() -> str:
    # From the installed distribution: transport/ may not import the public API (stepd/).
    try:
        return importlib.metadata.version("stepd")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


async def _daemon(p: Context, r: Request) -> Reply:
    # What /metrics shows of the daemon's own housekeeping, for a read key (the
    # console's Daemon page): /metrics itself is unauthenticated text for
    # Prometheus, and a console key must not need it.
    d = p.daemon
    trace = d.services.trace
    otel: dict[str, Any] = {"enabled": trace is not None}
    if trace is not None:
        otel.update(dataclasses.asdict(trace.statistics()))
    config = d.config
    return Reply(200, {
        "version": _version(),
        "otel": otel,
        "retention": {"retention_ms": config.retention_ms or None,
                      "idempotency_retention_ms":
                          (config.idempotency_retention_ms or config.retention_ms) or None},
        "data_dir_bytes": d.data_dir_bytes(),
        "runs_pruned": d.stats.runs_pruned,
        "audited": p.audited,
    })


# --------------------------------------------------------------------------- schedules, retention


async def _create_schedule(p: Context, r: Request) -> Reply:
    return Reply(201, await p.daemon.create_schedule(r.body, audit=r.audit))


async def _list_schedules(p: Context, r: Request) -> Reply:
    limit = query_int(r.query, "limit", 100, minimum=1, maximum=1000)
    cursor = query_str(r.query, "cursor")
    if cursor is not None and not 0 < len(cursor) <= 64:
        raise Invalid("must be the next_cursor of an earlier page", field="cursor")
    page, next_cursor = p.daemon.list_schedules(limit=limit, after=cursor)
    return Reply(200, {"schedules": page, "next_cursor": next_cursor})


async def _get_schedule(p: Context, r: Request) -> Reply:
    return Reply(200, p.daemon.schedule(r.target))


async def _pause_schedule(p: Context, r: Request) -> Reply:
    parse_schedule_action(r.body)
    return Reply(200, await p.daemon.pause_schedule(r.target, audit=r.audit))


async def _resume_schedule(p: Context, r: Request) -> Reply:
    parse_schedule_action(r.body)
    return Reply(200, await p.daemon.resume_schedule(r.target, audit=r.audit))


async def _delete_schedule(p: Context, r: Request) -> Reply:
    await p.daemon.delete_schedule(r.target, audit=r.audit)
    return Reply(200, {})


async def _prune_runs(p: Context, r: Request) -> Reply:
    args = parse_prune(r.body)
    return Reply(200, await p.daemon.prune_runs(
        args["before"], key_before_ms=args["idempotency_keys_before"], limit=args["limit"]))


# --------------------------------------------------------------------------- the table

_W, _E, _R, _A = Need.WORKER, Need.EXECUTE, Need.READ, Need.ADMIN
_act = AuditAction

SPECS: Final[Mapping[Operation, OperationSpec]] = {
    Operation.REGISTER: OperationSpec(_W, None, None, "required", _register),
    Operation.CLAIM: OperationSpec(_W, None, None, "required", _claim),
    Operation.STARTED: OperationSpec(_W, None, "lease", "optional",
                                     _lease_op(*LEASE_CALLS[Operation.STARTED])),
    Operation.HEARTBEAT: OperationSpec(_W, None, "lease", "optional",
                                       _lease_op(*LEASE_CALLS[Operation.HEARTBEAT])),
    Operation.COMPLETE: OperationSpec(_W, None, "lease", "required",
                                      _lease_op(*LEASE_CALLS[Operation.COMPLETE])),
    Operation.FAIL: OperationSpec(_W, None, "lease", "required",
                                  _lease_op(*LEASE_CALLS[Operation.FAIL])),
    Operation.HISTORY: OperationSpec(_W, None, "lease", "optional", _history),
    Operation.SESSION_RENEW: OperationSpec(_W, None, "session", "optional", _session_renew),
    Operation.SESSION_CLOSE: OperationSpec(_W, None, "session", "optional", _session_close),
    Operation.START_RUN: OperationSpec(_E, _act.RUNS_START, None, "required", _start_run,
                                       in_txn=True, mutation=True),
    Operation.LIST_RUNS: OperationSpec(_R, _act.RUNS_LIST, None, "none", _list_runs),
    Operation.GET_RUN: OperationSpec(_R, _act.RUNS_READ, "run", "none", _get_run),
    Operation.JOURNAL: OperationSpec(_R, _act.RUNS_JOURNAL, "run", "none", _journal),
    Operation.EXPORT: OperationSpec(_R, _act.RUNS_EXPORT, "run", "none", _export),
    Operation.RESULT: OperationSpec(_R, _act.RUNS_RESULT, "run", "none", _result),
    Operation.SIGNAL: OperationSpec(_E, _act.RUNS_SIGNAL, "run", "required", _signal,
                                    in_txn=True, mutation=True),
    Operation.CANCEL: OperationSpec(_E, _act.RUNS_CANCEL, "run", "optional", _cancel,
                                    in_txn=True, mutation=True),
    Operation.RETRY: OperationSpec(_E, _act.RUNS_RETRY, "run", "optional", _retry,
                                   in_txn=True, mutation=True),
    Operation.FORK: OperationSpec(_E, _act.RUNS_FORK, "run", "required", _fork,
                                  in_txn=True, mutation=True),
    Operation.LIST_WORKERS: OperationSpec(_R, _act.WORKERS_READ, None, "none", _workers),
    Operation.AUDIT: OperationSpec(_A, _act.AUDIT_READ, None, "none", _audit),
    Operation.ACTORS: OperationSpec(_A, _act.ACTORS_READ, None, "none", _actors),
    Operation.KILL: OperationSpec(_A, _act.ACTORS_KILL, None, "required", _kill, mutation=True),
    Operation.DEFINITIONS: OperationSpec(_R, _act.DEFINITIONS_READ, None, "none", _definitions),
    Operation.STATS: OperationSpec(_R, _act.STATS_READ, None, "none", _stats),
    Operation.DAEMON: OperationSpec(_R, _act.DAEMON_READ, None, "none", _daemon),
    # A schedule starts runs: creating, pausing, resuming or deleting one needs
    # what starting a run needs (execute; write or admin as fallbacks).
    Operation.CREATE_SCHEDULE: OperationSpec(_E, _act.SCHEDULES_CREATE, None, "required",
                                             _create_schedule, in_txn=True, mutation=True),
    Operation.LIST_SCHEDULES: OperationSpec(_R, _act.SCHEDULES_LIST, None, "none",
                                            _list_schedules),
    Operation.GET_SCHEDULE: OperationSpec(_R, _act.SCHEDULES_READ, "schedule", "none",
                                          _get_schedule),
    Operation.PAUSE_SCHEDULE: OperationSpec(_E, _act.SCHEDULES_PAUSE, "schedule", "optional",
                                            _pause_schedule, in_txn=True, mutation=True),
    Operation.RESUME_SCHEDULE: OperationSpec(_E, _act.SCHEDULES_RESUME, "schedule", "optional",
                                             _resume_schedule, in_txn=True, mutation=True),
    Operation.DELETE_SCHEDULE: OperationSpec(_E, _act.SCHEDULES_DELETE, "schedule", "none",
                                             _delete_schedule, in_txn=True, mutation=True),
    Operation.PRUNE_RUNS: OperationSpec(_A, _act.RUNS_PRUNE, None, "required", _prune_runs,
                                        mutation=True),
}

LONG_POLLS: Final = frozenset({Operation.CLAIM, Operation.RESULT})
"""Operations that may hold the request open: they end at once when the daemon drains."""

WORKER_OPERATIONS: Final = frozenset(op for op, spec in SPECS.items() if spec.need is Need.WORKER)
