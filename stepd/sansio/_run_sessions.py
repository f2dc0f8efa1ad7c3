"""The run machine's worker-session layer (AFFINITY.md "Worker sessions").

See `_run_base` for how `RunMachine` is layered. A run records, per session
name, its id, holder, acquisition generation and status (`RunRecord.sessions`):
that is the routing a holder change keeps. A step of a session is announced
pinned to the holder (`AttemptSpec.pinned`), or unpinned (it waits) while the
session has none; an offer to any other worker is fenced; a for_each of a
session slots at most its ``max_concurrent`` items at once. `SessionChanged`
(told by the session's actor) moves the holder or fails the run.
"""

from __future__ import annotations

from typing import Any

from ._run_base import _RunBase
from .errors import Fenced
from .events import Runnable, SessionChanged, Transition
from .session_spec import work_session_id
from .status import ErrorReason, RunStatus, SlotPhase
from .sticky import mark_holder_lost

__all__ = ["_RunSessions"]

_GONE = {"lost": ErrorReason.SESSION_LOST, "expired": ErrorReason.SESSION_EXPIRED}


class _RunSessions(_RunBase):
    __slots__ = ()

    def _session_entry(self, name: str) -> dict[str, Any]:
        """The run's record of session `name`, made pending on first use."""
        entry = self.record.sessions.get(name)
        if entry is None:
            entry = self.record.sessions[name] = {
                "id": work_session_id(self.record.run_id, name), "holder": None, "gen": 0,
                "status": "pending"}
        return entry

    def _session_unusable(self, name: str, step_id: str, tr: Transition, now: int) -> bool:
        """Entering a step of session `name`: True (and the run failed) if it is gone."""
        status = self._session_entry(name)["status"]
        reason = _GONE.get(status)
        if reason is None:
            return False
        self._fail_run(reason, f"worker session {name!r} is {status}", step_id, tr, now)
        return True

    def _session_cap(self, name: str | None, cap: int) -> int:
        """A for_each of a session slots at most its ``max_concurrent`` items at once."""
        if name is None:
            return cap
        return min(cap, self.definition.sessions[name].max_concurrent)

    def _check_holder(self, name: str | None, worker_id: str) -> dict[str, Any] | None:
        """An offer of a session's step: only to its holder (else Fenced). Returns the
        lease's ``session`` object, or None for a step without a session."""
        if name is None:
            return None
        entry = self._session_entry(name)
        if entry["status"] != "held" or entry["holder"] != worker_id:
            raise Fenced(f"worker session {name!r} is not held by worker {worker_id}")
        spec = self.definition.sessions[name]
        return {"session_id": entry["id"], "name": name, "generation": entry["gen"],
                "lease_ms": spec.lease_ms}

    def _on_session_changed(self, ev: SessionChanged, now: int) -> Transition:
        tr = Transition()
        entry = self._session_entry(ev.name)
        if entry["status"] in _GONE or ev.generation < entry["gen"]:
            return tr  # already over, or a stale note
        if ev.kind == "acquired":
            if ev.generation == entry["gen"] and entry["status"] == "held":
                return tr  # told again (its actor restarted before it knew we had it)
            entry.update(holder=ev.worker_id, gen=ev.generation, status="held")
            self._journal(tr, now, "session_acquired", session=ev.name,
                          session_id=ev.session_id, worker_id=ev.worker_id,
                          generation=ev.generation)
        elif ev.kind == "lost":
            if entry["status"] == "pending" and ev.reacquire:
                return tr  # told again
            self._journal(tr, now, "session_lost", session=ev.name, session_id=ev.session_id,
                          worker_id=ev.worker_id, generation=ev.generation,
                          reacquire=ev.reacquire)
            entry.update(holder=None, status="pending" if ev.reacquire else "lost")
            mark_holder_lost(self.record.sticky, ev.worker_id)
            if not ev.reacquire:
                self._fail_run(ErrorReason.SESSION_LOST,
                               f"worker session {ev.name!r} lost its holder {ev.worker_id} "
                               "and its reacquire policy is \"never\"",
                               self._current_step_id(), tr, now)
                return tr
        else:  # expired
            entry.update(holder=None, status="expired")
            self._journal(tr, now, "session_expired", session=ev.name, session_id=ev.session_id)
            if self._current_session() == ev.name:
                self._fail_run(ErrorReason.SESSION_EXPIRED,
                               f"worker session {ev.name!r} outlived its ttl_ms",
                               self._current_step_id(), tr, now)
            return tr
        # The current step's queued slots go out again, pinned to the new holder (or
        # unpinned: they wait for one).
        f = self.record.frame
        if f is not None and self.record.status is RunStatus.RUNNING \
                and self._current_session() == ev.name:
            step = self.definition.step(f.step_id)
            specs = [self._spec(step, f, s) for s in f.slots if s.phase is SlotPhase.QUEUED]
            if specs:
                tr.effects.append(Runnable(tuple(specs)))
        return tr

    def _current_session(self) -> str | None:
        f = self.record.frame
        if f is None:
            return None
        return getattr(self.definition.step(f.step_id), "session", None)
