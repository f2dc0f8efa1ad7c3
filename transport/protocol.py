"""The one protocol handler every transport shares (STYLE.md rule 20).

HTTP (`stepd.transport.http`), the worker WebSocket
(`stepd.transport.websocket`) and the in-process adapter
(`stepd.transport.inprocess`) all call `Protocol`: the same request validation,
the same calls into the daemon, the same rejections, the same audit entries.
The transports only frame bytes; they never validate a body or map an error
themselves, so a rejection cannot drift between them.

What `Protocol.call` does, per call:

1. refuse with 503 while the daemon drains (`Protocol.drain`);
2. check the path id (an id that does not match its pattern names nothing: 404);
3. run the operation's row of the table (`operations.SPECS`): its handler
   validates the query and the body exactly as ``transport/openapi.json`` says
   (unknown keys are refused at every level except free JSON, types and ranges
   are checked, and the `Invalid` names the offending field) and calls one
   method of the daemon's API (`stepd.actors.daemon.Daemon`);
4. record the audit entry of the audited operations (reads of runs, starts,
   signals, cancels, kills, the workers list, the actor tree and the audit log
   itself; never worker calls). A start, signal or cancel hands its entry down
   with the change, which writes it in its own transaction; a kill awaits its
   entry's commit before answering; reads queue theirs (docs/http-api.md
   "Audit log").

`Protocol.handle` is `call` with every `StepdError` mapped to an HTTP status
and body (`replies.error_reply`); the in-process adapter uses `call` and gets
the exceptions. A worker's calls on a lease (`operations.LEASE_CALLS`: one a
step) have their own one-frame `lease_call` and `handle_lease`, which do
exactly what `call` does for those rows.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from typing import Any

from stepd.actors import ActorDead, ActorNotFound
from stepd.actors.daemon import Daemon
from stepd.actors.daemon.audit import AuditEntry
from stepd.sansio.errors import Invalid, NotFound, StepdError, Unavailable
from stepd.sansio.run import iso_ms
from stepd.storage import StorageClosed

from ._drain import Drain
from ._json import copy_json, decode_json, encode_json
from ._validate import (
    MAX_CLAIM,
    NO_BODY,
    STICKY_COUNTS,
    is_lease_id,
    is_run_id,
    is_schedule_id,
    is_session_id,
    parse_kill,
)
from .auth import Forbidden, KeyRing, Principal, Unauthorized, is_loopback_host
from .metrics import DaemonMetrics, Registry, daemon_metrics, trace_export_metrics
from .operations import (
    LEASE_CALLS,
    LONG_POLLS,
    SPECS,
    WORKER_OPERATIONS,
    Operation,
    OperationSpec,
    Request,
)
from .replies import (
    DEFAULT_MAX_BODY_BYTES,
    CrossSite,
    Reply,
    TooLarge,
    bounded,
    error_reply,
    reason_of,
    status_of,
)

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "LONG_POLLS",
    "MAX_CLAIM",
    "NO_BODY",
    "SPECS",
    "WORKER_OPERATIONS",
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


class Protocol(Drain):
    """The protocol handler: validation, calls into the daemon, error mapping, audit.

    One per daemon; every transport holds the same one. What it has in flight,
    and its drain, are `Drain`'s (`_drain.py`).

    Attributes:
        daemon: the daemon's API it drives.
        keyring: the configured keys (auth disabled when empty).
        audited: whether calls are audited (False only in tests of the transports alone).
        registry: the Prometheus registry ``/metrics`` renders.
        metrics: the daemon's metric set, registered in ``registry``.
        max_body_bytes: the largest request body (HTTP) or message (WebSocket).
        draining: True once `drain` began: every new call answers 503.
    """

    def __init__(
        self,
        daemon: Daemon,
        *,
        keyring: KeyRing | None = None,
        audited: bool = True,
        registry: Registry | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    ) -> None:
        if isinstance(max_body_bytes, bool) or not isinstance(max_body_bytes, int) \
                or max_body_bytes < 1:
            raise Invalid("must be a positive integer", field="max_body_bytes")
        self.daemon = daemon
        self.keyring = keyring if keyring is not None else KeyRing.from_config()
        self.audited = audited
        self.registry = registry if registry is not None else Registry()
        self.metrics: DaemonMetrics = daemon_metrics(self.registry)
        self.max_body_bytes = max_body_bytes
        super().__init__()  # nothing in flight, not draining
        self._batches_seen: tuple[int, ...] = ()  # storage batch-size buckets already observed
        self.metrics.runs_by_status.set_function(lambda: self._runs_by_status)
        trace = daemon.services.trace
        if trace is not None:
            trace_export_metrics(self.registry, trace.statistics)
        self._runs_by_status: dict[str, int] = {}
        # Retention (docs/storage.md "Retention"): what the data directory takes, and
        # the runs deleted so far.
        self._data_dir_bytes = self.registry.gauge(
            "stepd_data_dir_bytes", "Bytes of the data directory's files (LMDB never shrinks "
            "its file: with retention it stops growing).")
        self._runs_pruned = self.registry.counter(
            "stepd_runs_pruned_total", "Finished runs deleted by retention or a prune.")
        self._pruned_seen = 0

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
        held: bool = False,
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
            held: a long-poll (`LONG_POLLS`) the caller ends itself when the daemon
                drains (`Drain.task_tracking` with ``poll``: HTTP under stepd's
                uvicorn protocol), and answers 503 then: no cancel scope of
                `long_poll` is entered around it.

        Returns:
            The success `Reply` (status 200 or 201).

        Raises:
            StepdError: the refusal (`error_reply` maps it); `Unavailable` while
                draining.
        """
        spec = SPECS[op]
        audit_target = target
        entry: AuditEntry | None = None
        try:
            if self.draining:
                raise Unavailable("the daemon is shutting down")
            if error is not None:
                raise error
            if spec.body == "none" and body is not NO_BODY:
                raise Invalid("this call takes no body")
            if spec.target == "run" and not is_run_id(target):
                raise NotFound(f"run {target!r} not found")
            if spec.target == "lease" and not is_lease_id(target):
                raise NotFound(f"lease {target!r} not found")
            if spec.target == "session" and not is_session_id(target):
                raise NotFound(f"worker session {target!r} not found")
            if spec.target == "schedule" and not is_schedule_id(target):
                raise NotFound(f"schedule {target!r} not found")
            if op is Operation.KILL:
                audit_target = parse_kill(body)
            if spec.in_txn and self.audited:
                entry = self._entry(spec, principal, None, 200, None)
            request = Request(target or "", query or {}, body, worker_id, entry)
            if op in LONG_POLLS and not held:
                with self.long_poll() as scope:
                    reply = await spec.run(self, request)
                if scope.cancelled_caught:
                    raise Unavailable("the daemon is shutting down")
            else:
                reply = await spec.run(self, request)
        except StepdError as exc:
            status = status_of(exc)
            if status != 503:
                await self._audit(op, principal, audit_target, status, reason_of(exc))
            raise
        if entry is not None or spec.audit is None:
            return reply  # its audit entry committed with the change, or none is kept
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
        held: bool = False,
    ) -> Reply:
        """`call`, with every error mapped to its status and body (`error_reply`).

        An unexpected exception (a bug) is logged with its traceback and
        answered 500; it does not take the connection down with it.
        """
        try:
            return await self.call(op, principal, target=target, query=query, body=body,
                                   error=error, worker_id=worker_id, held=held)
        except (StepdError, StorageClosed) as exc:
            return error_reply(exc)
        except Exception as exc:
            log.exception("%s failed (target %r): answered 500", op.value,
                          bounded(target) if isinstance(target, str) else target)
            return error_reply(exc)

    # A step awaits one worker call on a lease (its `complete`): `call` spent a frame
    # of its own, its row's handler another and a `Request` on it, and each frame is
    # resumed once more when the commit the call waits for is done. Those rows take
    # a lease id, keep no audit entry and never hold the call open, so what `call`
    # does for them is the four lines below; the next two methods are that, in one
    # frame. `call` runs the same rows (`LEASE_CALLS`) for HTTP.

    async def lease_call(self, op: Operation, target: str, body: Any,
                         worker_id: str | None) -> Reply:
        """`call` for a worker's call on a lease (an operation of `LEASE_CALLS`), in one frame.

        Raises:
            StepdError: as `call` (404 for a malformed lease id, 503 while draining).
        """
        if self.draining:
            raise Unavailable("the daemon is shutting down")
        if not is_lease_id(target):
            raise NotFound(f"lease {target!r} not found")
        lease_op, parse = LEASE_CALLS[op]
        # `Daemon.lease_call` answers a dict of its own: no copy.
        return Reply(200, await self.daemon.lease_call(target, lease_op, parse(body),
                                                       caller=worker_id))

    async def handle_lease(self, op: Operation, target: str, body: Any,
                           worker_id: str | None) -> Reply:
        """`handle` for a worker's call on a lease: `lease_call` with every error mapped."""
        try:
            if self.draining:
                raise Unavailable("the daemon is shutting down")
            if not is_lease_id(target):
                raise NotFound(f"lease {target!r} not found")
            lease_op, parse = LEASE_CALLS[op]
            return Reply(200, await self.daemon.lease_call(target, lease_op, parse(body),
                                                           caller=worker_id))
        except (StepdError, StorageClosed) as exc:
            return error_reply(exc)
        except Exception as exc:
            log.exception("%s failed (target %r): answered 500", op.value, bounded(target))
            return error_reply(exc)

    async def workers(self) -> list[dict[str, Any]]:
        """GET /v1/api/workers as the API answers it (connected first)."""
        out = await self.daemon.workers()
        for info in out:
            seen = info.get("last_heartbeat_at")
            info["last_heartbeat_at"] = None if seen is None else iso_ms(seen)
        return out

    # ------------------------------------------------------------------ audit

    def _entry(self, spec: OperationSpec, principal: Principal | None, target: str | None,
               status: int, reason: str | None, *, key_id: str | None = None) -> AuditEntry:
        assert spec.audit is not None
        return self.daemon.audit.new_entry(
            key_id=principal.key_id if principal is not None else key_id,
            scope=principal.scope.text if principal is not None else None,
            action=spec.audit,
            # A refused path id may be 64 KiB: the durable entry keeps it bounded.
            target=bounded(target) if isinstance(target, str) else None,
            status=status,
            reason=reason,
        )

    async def _audit(self, op: Operation, principal: Principal | None, target: str | None,
                     status: int, reason: str | None, *, key_id: str | None = None) -> None:
        spec = SPECS[op]
        if spec.audit is None or not self.audited:
            return
        entry = self._entry(spec, principal, target, status, reason, key_id=key_id)
        try:
            if spec.mutation:
                # The entry is durable before the answer: acknowledged implies audited.
                await self.daemon.audit.append(entry)
            else:
                await self.daemon.audit.record(entry)
        except StorageClosed:
            log.warning("audit entry dropped: the storage is closed (%s %s)", entry.action,
                        entry.target)

    # ------------------------------------------------------------------ metrics

    async def render_metrics(self) -> str:
        """The Prometheus exposition text (docs/http-api.md "Metrics")."""
        e = self.daemon
        m = self.metrics
        self._runs_by_status = {k: v for k, v in e.stats.status_counts.items() if v > 0}
        m.live_leases.set(e.live_leases())
        self._data_dir_bytes.set(e.data_dir_bytes())
        pruned = e.stats.runs_pruned
        if pruned > self._pruned_seen:
            self._runs_pruned.inc(pruned - self._pruned_seen)
            self._pruned_seen = pruned
        try:
            stats = await e.registry_stats()
            m.waiting_claims.set(stats.waiting_claims)
        except (ActorDead, ActorNotFound, Unavailable):
            log.debug("/registry is restarting: stepd_waiting_claims keeps its last value")
        workers = await e.workers()
        m.connected_workers.set(sum(1 for w in workers if w["connected"]))
        sticky = {(w["worker_id"], event): w["sticky"][event] for w in workers
                  if w.get("sticky") for event in STICKY_COUNTS}
        m.worker_sticky.set_function(lambda: sticky)
        _drain_into(e.stats.run_to_complete, m.run_to_complete_seconds.observe)
        _drain_into(e.stats.schedule_to_start, m.step_schedule_to_start_seconds.observe)
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
