"""The work session actor: one worker session ("affinity session") of one run, a shell
around its `WorkSessionMachine` (AFFINITY.md "Worker sessions").

Path ``/sessions/ws_<run id>.<name>``, beside the per-worker connection sessions
(``/sessions/w_...``) under the same one_for_one supervisor; listed by
``stepd actors`` and killable. It holds the session's two timers: ``due`` (the
holder's lease end or the absolute TTL, from `next_deadline()`) and ``retry``
(look for a holder again while none matches). Everything it holds is in its
record: a killed incarnation is rebuilt from storage, tells the run again where
the session stands (the run ignores what it knew) and re-arms its timers.

Order (DESIGN.md): the machine decides, the record (and the holder's slot) is
committed, then the run is told (`SessionNote`, an ask: run-ward) and, on a
holder loss, a new holder is looked for. It asks the worker sessions
(`SessionInfo`) whether a candidate is alive; worker sessions never ask it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from stepd.actors import Actor, ActorDead, ActorNotFound
from stepd.sansio.errors import RunTerminal, StepdError
from stepd.sansio.events import SessionChanged
from stepd.sansio.status import TERMINAL_STATUSES
from stepd.sansio.work_session import (
    Acquired,
    Close,
    Effect,
    FreeSlot,
    NotifyRun,
    Released,
    Renew,
    Tick,
    WorkSessionMachine,
    WorkSessionRecord,
    WorkSessionStatus,
)

from . import peers, store, work_store
from .messages import (
    CloseSession,
    Due,
    EnsureHolder,
    ReleaseSession,
    RenewSession,
    SessionInfo,
    SessionNote,
)
from .services import Services

__all__ = ["RETRY_S", "WorkSessionActor", "split_session_id"]

log = logging.getLogger("stepd.sessions")

#: How often a session without a holder looks for one again (seconds).
RETRY_S = 0.2


@dataclass(frozen=True, slots=True)
class _Retry:
    """The ``retry`` timer fired."""


_RETRY = _Retry()
_TERMINAL_RUN = frozenset(s.value for s in TERMINAL_STATUSES)


def split_session_id(session_id: str) -> tuple[str, str]:
    """(run id, session name) of ``ws_<run id>.<name>``.

    Raises:
        LookupError: not a work session id.
    """
    if not session_id.startswith("ws_") or "." not in session_id:
        raise LookupError(f"{session_id!r} is not a worker session id")
    run_id, name = session_id[3:].rsplit(".", 1)
    return run_id, name


class WorkSessionActor(Actor):
    kind = "work_session"
    #: A refused renew or close (fenced: not the holder, or the session ended) is the
    #: caller's answer, not a crash; the machine changed nothing.
    reply_errors = (StepdError,)

    def __init__(self, services: Services, session_id: str) -> None:
        self.s = services
        self.session_id = session_id
        self.machine: WorkSessionMachine | None = None
        self.spec: Any = None  # the definition's SessionSpec
        self.workflow: tuple[str, str | None] = ("", None)

    async def on_start(self) -> None:
        e = self.s
        run_id, name = split_session_id(self.session_id)
        run = e.storage.read(store.load_run_txn, run_id)
        if run is None:
            raise LookupError(f"run {run_id} is not on record")
        definition = e.catalog.by_hash(run["hash"])
        if definition is None or name not in definition.sessions:
            raise LookupError(f"run {run_id} has no session {name!r}")
        self.spec = definition.sessions[name]
        self.workflow = (run["workflow"], run["version"])
        raw = e.storage.get(store.WORK_SESSIONS, self.session_id)
        if isinstance(raw, dict):
            self.machine = WorkSessionMachine(WorkSessionRecord.from_dict(raw))
            r = self.machine.record
            if self.session_id not in e.work_sessions_seen and r.status is WorkSessionStatus.HELD:
                r.lease_until = min(e.clock.time_ms() + r.lease_ms, r.expires_at)
                await e.storage.write(work_store.save_txn, r.to_dict(), [])
        else:  # created: its absolute TTL starts now
            spec = self.spec
            self.machine = WorkSessionMachine.create(
                self.session_id, run_id, name, lease_ms=spec.lease_ms, ttl_ms=spec.ttl_ms,
                max_concurrent=spec.max_concurrent, reacquire=spec.reacquire,
                now=e.clock.time_ms())
            await e.storage.write(work_store.save_txn, self.machine.record.to_dict(), [])
        e.work_sessions_seen.add(self.session_id)
        self._arm()
        self.ref.tell_nowait(EnsureHolder())

    async def receive(self, message: Any) -> Any:
        m = self.machine
        assert m is not None
        if isinstance(message, EnsureHolder):
            await self._sync_run()
            await self._try_acquire()
        elif isinstance(message, Due):
            await self._apply(m.handle(Tick(), self.s.clock.time_ms()))
            await self._try_acquire()
        elif isinstance(message, _Retry):
            await self._try_acquire()
        elif isinstance(message, RenewSession):
            m.handle(Renew(message.worker_id), self.s.clock.time_ms())
            await self._save([])
            r = m.record
            now = self.s.clock.time_ms()
            return {"session_id": r.session_id, "lease_ms": r.lease_ms,
                    "ttl_remaining_ms": max(0, r.expires_at - now),
                    "generation": r.generation}
        elif isinstance(message, ReleaseSession):
            await self._apply(m.handle(Released(message.worker_id), self.s.clock.time_ms()))
            await self._try_acquire()
            return {}
        elif isinstance(message, CloseSession):
            await self._apply(m.handle(Close(), self.s.clock.time_ms()))
        elif isinstance(message, SessionInfo):
            return m.record.to_dict()
        # Anything else (a worker-session `Resubscribe` sent to every /sessions child) is
        # not for us.
        return None

    # ------------------------------------------------------------------ holder

    async def _try_acquire(self) -> None:
        """Pending: reserve a slot of a live matching worker, or look again soon."""
        m = self.machine
        assert m is not None
        if m.status is not WorkSessionStatus.PENDING:
            return
        e = self.s
        r = m.record
        spec = self.spec
        found = e.storage.read(work_store.candidates_txn, dict(spec.requirements), spec.queue,
                               self.workflow, r.lost_holders)
        for c in found:
            if not await self._alive(c.worker_id):
                continue
            before = r.to_dict()
            effects = m.handle(Acquired(c.worker_id), e.clock.time_ms())
            if m.record.status is WorkSessionStatus.EXPIRED:  # its TTL had passed
                await self._apply(effects)
                return
            if await e.storage.write(work_store.acquire_txn, r.to_dict(), c.worker_id,
                                     c.max_sessions):
                log.info("session %s: held by %s (generation %d)", self.session_id,
                         c.worker_id, r.generation)
                self._arm()
                await self._perform(effects)
                return
            # Its last slot went to another session meanwhile: undo, try the next.
            m.record = WorkSessionRecord.from_dict(before)
        self.arm_timer("retry", e.clock.now() + RETRY_S, _RETRY)

    async def _alive(self, worker_id: str) -> bool:
        """The worker has a push connection, a claim waiting, or called within a lease TTL."""
        ref = self.s.system.find(f"/sessions/{worker_id}")
        if ref is None or not ref.alive:
            return False
        try:
            info = await ref.ask(SessionInfo())
        except (ActorDead, ActorNotFound):
            return False
        if info["connected"]:
            return True
        return bool(self.s.clock.time_ms() - info["last_active"] <= self.s.config.lease_ttl_ms)

    # ------------------------------------------------------------------ effects

    async def _apply(self, effects: list[Effect]) -> None:
        freed = [fx.worker_id for fx in effects if isinstance(fx, FreeSlot)]
        if effects:
            await self._save(freed)
        self._arm()
        await self._perform(effects)

    async def _save(self, freed: list[str]) -> None:
        assert self.machine is not None
        await self.s.storage.write(work_store.save_txn, self.machine.record.to_dict(), freed)

    async def _perform(self, effects: list[Effect]) -> None:
        for fx in effects:
            if isinstance(fx, NotifyRun):
                await self._notify(fx.kind, fx.worker_id, fx.generation, fx.reacquire)
        assert self.machine is not None
        if self.machine.status.terminal:
            self.s.work_sessions_seen.discard(self.session_id)
            self.stop()  # its record stays; a later call finds it there

    async def _notify(self, kind: str, worker_id: str | None, generation: int,
                      reacquire: bool) -> None:
        m = self.machine
        assert m is not None
        r = m.record
        event = SessionChanged(r.name, r.session_id, kind, worker_id, generation, reacquire)
        try:
            await peers.ask_run(self.s, r.run_id, SessionNote(event))
        except RunTerminal:
            if not m.status.terminal:
                await self._apply(m.handle(Close(), self.s.clock.time_ms()))
        except StepdError as exc:
            # Unavailable (its actor keeps dying) or NotFound: the next EnsureHolder
            # (a restart of ours, the run's own resync) tells it again.
            log.warning("session %s: could not tell run %s (%s)", r.session_id, r.run_id, exc)

    async def _sync_run(self) -> None:
        """After a (re)start: tell the run where the session stands (it ignores repeats);
        a session of a run that is over closes."""
        m = self.machine
        assert m is not None
        r = m.record
        run = self.s.storage.read(store.load_run_txn, r.run_id)
        if run is None or run.get("status") in _TERMINAL_RUN:
            if not m.status.terminal:
                await self._apply(m.handle(Close(), self.s.clock.time_ms()))
            return
        if m.status is WorkSessionStatus.HELD:
            await self._notify("acquired", r.holder, r.generation, False)
        elif m.status is WorkSessionStatus.PENDING and r.generation > 0:
            await self._notify("lost", r.lost_holders[-1] if r.lost_holders else None,
                               r.generation, True)
        elif m.status is WorkSessionStatus.LOST:
            await self._notify("lost", r.lost_holders[-1] if r.lost_holders else None,
                               r.generation, False)
        elif m.status is WorkSessionStatus.EXPIRED:
            await self._notify("expired", None, r.generation, False)
        if m.status.terminal:
            self.stop()

    def _arm(self) -> None:
        assert self.machine is not None
        peers.arm_due(self.s, self, self.machine.next_deadline())
