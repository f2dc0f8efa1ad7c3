"""Starting a run: its record, journal, indexes and idempotency key in one transaction,
then its actor.

Shared by the API (`Daemon.start_run`, a client's ``POST /v1/api/runs``) and
the schedule actors (each fire starts a run under its fire's idempotency key),
so both create runs by the same path and a schedule never needs to call up
into the API.
"""

from __future__ import annotations

import logging
from typing import Any

from stepd.actors import ActorDead
from stepd.sansio.errors import StepdError, Unavailable, Unprocessable
from stepd.sansio.events import StartChildren
from stepd.sansio.run import RunMachine

from . import audit as _audit
from . import ids, peers, store
from .run import child_writes, walk_writes
from .services import Services

__all__ = ["create", "known_run", "start_run"]

log = logging.getLogger("stepd.daemon")


async def start_run(
    s: Services,
    workflow: str,
    input: Any = None,
    *,
    version: str | None = None,
    correlation: Any = None,
    idempotency_key: str | None = None,
    deadline_ms: int | None = None,
    entry: tuple[_audit.AuditEntry, int] | None = None,
) -> tuple[str, bool]:
    """Start a run (arguments already validated), or return the run its key started.

    Returns:
        (run id, created): created is False when `idempotency_key` was used before.

    Raises:
        Unprocessable: no registered workflow of that name (and version).
        Unavailable: the daemon is shutting down.
    """
    if not s.serving:
        raise Unavailable("the daemon is shutting down")
    # The key is not looked up first: `store.apply_txn` claims it in the start's own
    # transaction and, when it is taken, writes nothing but the audit entry (200)
    # and names the run that holds it, as `known_run` would have. A fresh key (every
    # start but a retry) so costs no read. A start refused here (no such workflow, a
    # bad deadline) still looks the key up first: a key used before answers its run,
    # whatever the repeat asks.
    try:
        definition = s.catalog.resolve(workflow, version)
        if definition is None:
            what = f"workflow {workflow!r}" + (f" version {version!r}" if version else "")
            raise Unprocessable(f"{what} is not registered")
        now = s.clock.time_ms()
        machine, tr = RunMachine.start(
            run_id=ids.run_id(now), definition=definition, input=input, now_ms=now,
            correlation=correlation, idempotency_key=idempotency_key, deadline_ms=deadline_ms,
            resolve=s.catalog.resolve, max_depth=s.config.max_child_depth,
        )
    except StepdError:
        known = await known_run(s, idempotency_key, entry)
        if known is not None:
            return known, False
        raise
    return await create(s, machine, tr, now, idempotency_key, entry)


async def known_run(s: Services, idempotency_key: str | None,
                    entry: tuple[_audit.AuditEntry, int] | None) -> str | None:
    """The run `idempotency_key` already started (its audit entry then written, 200), or None.

    Raises:
        Unavailable: the daemon is shutting down.
    """
    if not s.serving:
        raise Unavailable("the daemon is shutting down")
    if idempotency_key is not None:
        taken = s.storage.get(store.DISPATCH_KEYS, idempotency_key)
        if isinstance(taken, dict):
            known = str(taken["run_id"])
            if entry is not None:
                await s.storage.write(store.audit_only_txn, entry, known, 200)
            return known
    return None


async def create(s: Services, machine: RunMachine, tr: Any, now: int,
                 idempotency_key: str | None,
                 entry: tuple[_audit.AuditEntry, int] | None) -> tuple[str, bool]:
    """Write a new run (a start's, a fire's or a fork's) in one transaction, then start its actor.

    Returns:
        (run id, created): the run an idempotency key already named, and
        False, when the key was taken meanwhile.
    """
    run_id = machine.record.run_id
    w = store.RunWrite(
        run_id=run_id, record=machine.record.to_dict(), journal=tr.journal,
        due_new=machine.next_deadline(), active_new=not machine.idle(), create=True,
        dispatch_key=idempotency_key,
        children=[cw for e in tr.effects if isinstance(e, StartChildren)
                  for cw in child_writes(s, e, now)],
        audit=entry,
    )
    s.creating[run_id] = 0
    try:
        existing = await s.storage.write(store.apply_txn, w)
        assert not isinstance(existing, store.Refused)  # a create has no guard to refuse
        if existing is not None:
            # The key was taken: nothing of `w` was written, its children neither
            # (`child_writes` counted them started when it made them).
            s.stats.runs_started -= len(w.children)
            return existing, False
        if s.trace is not None:
            s.trace.committed(w)  # a run can end in its first transaction
        await _activate_created(s, run_id, w, machine, tr)
    finally:
        s.creating.pop(run_id, None)
    return run_id, True


async def _activate_created(s: Services, run_id: str, w: store.RunWrite, machine: RunMachine,
                            tr: Any) -> None:
    """Count a committed run in, start its actor, wake the children it created."""
    s.stats.runs_started += 1
    children = walk_writes(w.children) if w.children else ()  # most runs start none
    s.stats.status_moved(None, w.record["status"])
    for created in children:
        s.stats.status_moved(None, created.record["status"])
    if w.due_new is not None:
        await peers.timers_changed(s, w.due_new)
    # The machine we hold is the run's only if no incarnation loaded it from
    # storage since the write (`Services.creating`); else the record decides.
    initial = (machine, tr) if s.creating.get(run_id) == 0 else None
    try:
        try:
            await peers.activate_run(s, run_id, initial)
        except ActorDead:
            # Committed, but a supervisor it needs is restarting: start it from
            # the record instead once that is back.
            await peers.wake_run(s, run_id, None)
        for child in children:
            await peers.wake_run(s, child.run_id, None)
    except Unavailable:
        # The run is committed: answering 503 now would tell the client it may
        # not exist. Its actor comes up with recovery, which runs after every
        # restart of /runs (rest_for_one) and activates every active run.
        log.info("run %s is committed; its actor starts with recovery (/runs is "
                 "restarting)", run_id)
