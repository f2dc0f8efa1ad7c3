"""The daemon API, run side: start, fork, status, journal, export, list, result, signal,
cancel, retry (see `api`)."""

from __future__ import annotations

from typing import Any

from stepd.sansio.errors import Invalid, NotFound, Unavailable
from stepd.sansio.record import RunRecord
from stepd.sansio.run import RunMachine

from . import audit as _audit
from . import ids, listing, peers, starting, store
from ._api_base import ApiBase
from .messages import (
    CancelRun,
    RetryRun,
    Signal,
)

__all__ = ["RunOps"]

_TERMINAL = frozenset({"completed", "failed", "cancelled", "timed_out"})


def _check_key(idempotency_key: str | None) -> None:
    if idempotency_key is not None and (
        not isinstance(idempotency_key, str) or not idempotency_key
        or len(idempotency_key.encode()) > 400
    ):
        raise Invalid("must be a non-empty string of at most 400 bytes", field="idempotency_key")


class RunOps(ApiBase):
    """`Daemon`'s run operations."""

    # ------------------------------------------------------------------ runs

    async def start_run(
        self,
        workflow: str,
        input: Any = None,
        *,
        version: str | None = None,
        correlation: Any = None,
        idempotency_key: str | None = None,
        deadline_ms: int | None = None,
        audit: _audit.AuditEntry | None = None,
    ) -> tuple[str, bool]:
        """Start a run, or return the run an idempotency key already started.

        `audit`, when given, is written in the start's own transaction with the
        run as its target (201, or 200 for a key used before): it exists if and
        only if the start does. A refusal writes nothing.

        Returns:
            (run id, created): created is False when `idempotency_key` was used before.

        Raises:
            Invalid: a field is malformed (naming it).
            Unprocessable: no registered workflow of that name (and version).
            Unavailable: the daemon is shutting down.
        """
        if not isinstance(workflow, str) or not workflow:
            raise Invalid("must be a non-empty string", field="workflow")
        if version is not None and not isinstance(version, str):
            raise Invalid("must be a string", field="version")
        _check_key(idempotency_key)
        entry = None if audit is None else (audit, self.audit.next_seq())
        return await starting.start_run(
            self.services, workflow, input, version=version, correlation=correlation,
            idempotency_key=idempotency_key, deadline_ms=deadline_ms, entry=entry)

    async def fork(self, run_id: str, from_step: str, *, idempotency_key: str | None = None,
                   audit: _audit.AuditEntry | None = None) -> tuple[str, bool]:
        """Start a new run from the last completion of `from_step` in `run_id` (DBOS's fork):
        the journal up to there copied, state and usage as they were then
        (`RunMachine.fork`). The link is written with it: the fork's
        ``forked_from``, the source's ``forks`` (one transaction, with `audit`).

        Returns:
            (the fork's run id, created): created is False when `idempotency_key`
            was used before (that run is returned).

        Raises:
            Invalid: (``from_step``) not a step of the run, or it has not completed.
            NotFound: no such run. Unprocessable: its journal cannot be forked.
            Unavailable: the daemon is shutting down.
        """
        if not isinstance(from_step, str) or not from_step:
            raise Invalid("must be a non-empty string", field="from_step")
        found = self.storage.read(store.fork_source_txn, run_id)
        if found is None:
            raise NotFound(f"run {run_id!r} not found")
        raw, journal = found
        source = self._machine(raw)
        _check_key(idempotency_key)
        entry = None if audit is None else (audit, self.audit.next_seq())
        known = await starting.known_run(self.services, idempotency_key, entry)
        if known is not None:
            return known, False
        now = self.clock.time_ms()
        machine, tr = RunMachine.fork(
            source=source.record, journal=journal, definition=source.definition,
            from_step=from_step, run_id=ids.run_id(now), now_ms=now,
            idempotency_key=idempotency_key, resolve=self.catalog.resolve,
            max_depth=self.config.max_child_depth,
        )
        return await starting.create(self.services, machine, tr, now, idempotency_key, entry)

    async def retry(self, run_id: str, *, audit: _audit.AuditEntry | None = None) -> dict[str, Any]:
        """Resume a failed run at its failed step with a fresh retry budget (`Retry`).

        Persisted (with `audit`) before it answers, through the run's actor.

        Returns:
            ``{"run_id", "status", "step_id"}``: the status after the retry (it may
            have failed again at once, e.g. on the same template) and the step
            entered again.

        Raises:
            NotRetryable: not failed, failed on a budget, or past its deadline.
            NotFound: no such run. Unavailable: shutting down.
        """
        self._record(run_id)
        if not self.services.serving:
            raise Unavailable("the daemon is shutting down")
        entry = None if audit is None else (audit, self.audit.next_seq())
        answer = await peers.ask_run(self.services, run_id, RetryRun(entry))
        return {"run_id": run_id, **answer}


    def _record(self, run_id: str) -> dict[str, Any]:
        raw = self.storage.read(store.load_run_txn, run_id)
        if raw is None:
            raise NotFound(f"run {run_id!r} not found")
        return raw

    def _machine(self, raw: dict[str, Any]) -> RunMachine:
        record = RunRecord.from_dict(raw)
        definition = self.catalog.by_hash(record.definition_hash)
        if definition is None:
            raise NotFound(f"definition {record.definition_hash} of run {record.run_id} not found")
        return RunMachine(record, definition, self.catalog.resolve,
                          max_depth=self.config.max_child_depth)

    def status(self, run_id: str) -> dict[str, Any]:
        """The run status (WORKFLOWS.md "Run status"), as last committed.

        Raises:
            NotFound: no such run.
        """
        return self._view(self._machine(self._record(run_id)))

    def _view(self, m: RunMachine, *, forks: int | None = store.MAX_FORKS_SHOWN) -> dict[str, Any]:
        """The machine's status view, with the runs forked from it (`forks`, from storage)."""
        view = m.status_view()
        view["forks"] = self.storage.read(store.forks_txn, m.record.run_id, forks)
        return view

    def journal(self, run_id: str, *, after_seq: int = 0,
                limit: int | None = None) -> list[dict[str, Any]]:
        self._record(run_id)
        return [dict(v) for _, v in self.storage.journal(  # type: ignore[call-overload]
            run_id, after_seq=after_seq, limit=limit)]

    def export(self, run_id: str) -> dict[str, Any]:
        """Definition, version, hash, idempotency key, budget, input, state, result (or
        error), the fork links (every fork), journal and spans."""
        m = self._machine(self._record(run_id))
        journal = self.journal(run_id)
        view = self._view(m, forks=None)
        spans = [
            {"step_id": e.get("step_id"), "item_index": e.get("item_index"),
             "lease_id": e.get("lease_id"), **span}
            for e in journal if e["type"] == "step_completed" for span in e.get("spans") or ()
        ]
        return {
            "run_id": run_id, "workflow": view["workflow"], "definition": m.definition.to_json(),
            "definition_version": view["definition_version"],
            "definition_hash": view["definition_hash"],
            "idempotency_key": view["idempotency_key"], "budget": view["budget"],
            "usage": view["usage"], "status": view, "input": view["input"],
            "correlation": view["correlation"], "state": view["state"],
            "result": view["result"], "error": view["error"],
            "forked_from": view["forked_from"], "forks": view["forks"],
            "journal": journal, "spans": spans,
        }

    def list_runs(self, query: listing.Query | None = None, /,
                  **filters: Any) -> tuple[list[dict[str, Any]], str | None]:
        """A page of run summaries (newest first by default) and the next page's cursor.

        Costs O(limit): an index leads to the runs, and only their small
        summaries are decoded (`listing`). Pass a `listing.Query`, or its fields
        as keywords (``workflow=``, ``status=``, ``limit=``...).

        Raises:
            Invalid: the limit is out of range, or the cursor is not one of this query's.
        """
        if query is None:
            query = listing.Query(**filters)
        limit = query.limit
        if not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= 1000:
            raise Invalid("must be an integer from 1 to 1000", field="limit")
        page, cursor = self.storage.read(listing.list_txn, query)
        return [{
            "run_id": s["run_id"], "workflow": s["workflow"], "status": s["status"],
            "definition_version": s["version"], "definition_hash": s["hash"],
            "idempotency_key": s["idempotency_key"], "created_at": s["created_at"],
            "updated_at": s["updated_at"], "parent_run_id": s["parent_run_id"],
        } for s in page], cursor

    async def result(self, run_id: str, *, wait_ms: int = 0) -> dict[str, Any]:
        """Wait until the run is terminal (at most `wait_ms`), then return its status.

        One status view, built at the end: while waiting, only the stored record's
        status is read (a view costs two reads, a record decode and a machine).
        """
        return self._view(self._machine(await self._awaited(run_id, wait_ms)))

    async def outcome(self, run_id: str, *, wait_ms: int = 0) -> dict[str, Any]:
        """`result`, but only what ``GET /runs/{run}/result`` answers: ``run_id``,
        ``status``, ``result``, ``error``, read off the stored record as they are.

        No status view: a run's result call built one (a record decode into a
        machine, its timestamps formatted, the forks read) to keep four fields.

        Raises:
            NotFound: no such run.
        """
        raw = await self._awaited(run_id, wait_ms)
        return {"run_id": raw["run_id"], "status": raw["status"], "result": raw["result"],
                "error": raw["error"]}

    async def _awaited(self, run_id: str, wait_ms: int) -> dict[str, Any]:
        """The stored record once the run is terminal, or `wait_ms` passed (at once: 0).

        The waiter is registered before the first read, so an end committed between
        the read and the wait still wakes it.
        """
        if wait_ms <= 0:
            return self._record(run_id)
        watch = self.services.watch
        waiter = watch.waiter(run_id)
        try:
            raw = self._record(run_id)
            if raw["status"] not in _TERMINAL:
                await waiter.wait_at_most(min(wait_ms, self.config.max_request_ms) / 1000)
                raw = self._record(run_id)
        finally:
            watch.forget(run_id, waiter)
        return raw

    async def signal(self, run_id: str, name: str, payload: Any = None, *,
                     audit: _audit.AuditEntry | None = None) -> None:
        """Send a signal; `audit` is written in its transaction (none for a refusal).

        Raises:
            SignalRefused: 409 budget_exceeded. RunTerminal, NotFound, Invalid.
        """
        if not isinstance(name, str) or not name:
            raise Invalid("must be a non-empty string", field="name")
        self._record(run_id)
        entry = None if audit is None else (audit, self.audit.next_seq())
        await peers.ask_run(self.services, run_id, Signal(name, payload, entry))

    async def cancel(self, run_id: str, message: str | None = None, *,
                     audit: _audit.AuditEntry | None = None) -> None:
        """Cancel a run; `audit` is written in its transaction.

        Args:
            message: the canceller's reason: the run's ``error.message`` and its
                ``run_cancelled`` journal entry (default ``cancelled``).

        Raises:
            RunTerminal: already over. NotFound.
        """
        message = message or "cancelled"
        self._record(run_id)
        entry = None if audit is None else (audit, self.audit.next_seq())
        await peers.ask_run(self.services, run_id, CancelRun(message, entry))
