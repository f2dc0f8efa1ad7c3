"""What a run's transition writes: its `RunWrite`, its child runs, and its timer.

The lowest layer of the run actor (`run.py` holds the class built on it):
the state that mirrors what is on record (the indexed deadline and active
flag, the status as counted), the one place a transition becomes a
`store.RunWrite`, and the write nobody awaits. Split off so the actor's
message handling, its offers (`run_offers.py`) and its persistence each read
as one concept, and no class holds them all.
"""

from __future__ import annotations

from typing import Any

from stepd.actors import Actor
from stepd.sansio.events import (
    CancelChildren,
    EndLeases,
    NotifyParent,
    StartChildren,
    Transition,
)
from stepd.sansio.lease import LeaseStatus
from stepd.sansio.run import RunMachine

from . import peers, store
from .services import Services

__all__ = ["RunWrites", "child_writes", "walk_writes"]

_FENCED = LeaseStatus.FENCED.text
_RUN_TERMINAL = LeaseStatus.RUN_TERMINAL.text


def child_writes(s: Services, effect: StartChildren, now: int) -> list[store.RunWrite]:
    """The records of the child runs a `start_workflows` step creates.

    Created unbegun (`RunRecord.begun`): each child's own actor enters its
    first step, in its own transaction. A child whose first step starts
    children of its own thus adds one level per transaction, never a
    recursion inside this one (a workflow starting itself once recursed until
    Python gave up, and the start answered 500).
    """
    writes = []
    for child in effect.children:
        machine, tr = RunMachine.start(
            run_id=child.run_id, definition=effect.definition, input=child.input, now_ms=now,
            correlation=effect.correlation,
            parent={"run_id": effect.parent_run_id, "step_id": effect.step_id},
            resolve=s.catalog.resolve, depth=effect.depth, begin=False,
            max_depth=s.config.max_child_depth,
        )
        writes.append(store.RunWrite(
            run_id=child.run_id, record=machine.record.to_dict(), journal=tr.journal,
            due_new=machine.next_deadline(), active_new=not machine.idle(), create=True,
        ))
        s.stats.runs_started += 1
    return writes


def walk_writes(writes: list[store.RunWrite]) -> list[store.RunWrite]:
    out = []
    for w in writes:
        out.append(w)
        out.extend(walk_writes(w.children))
    return out


class RunWrites(Actor):
    """A run actor's persistence: its machine, what its indexes hold, and its writes."""

    def __init__(self, services: Services, run_id: str) -> None:
        self.s = services
        self.run_id = run_id
        self.machine: RunMachine
        #: The deadline and active flag as the durable indexes hold them (a write
        #: moves an index entry only when they change).
        self.indexed_due: int | None = None
        self.indexed_active = False
        self._status = ""  # the status as counted in stats.status_counts
        self._created: list[str] = []  # runs the last write created (children, grandchildren)
        self._due = peers.DueTimer()

    def _write(self, tr: Transition, **extra: Any) -> store.RunWrite:
        m = self.machine
        due = m.next_deadline()
        active = not m.idle()
        w = store.RunWrite(
            run_id=self.run_id,
            record=m.record.to_dict(),
            journal=tr.journal,
            due_old=self.indexed_due,
            due_new=due,
            active_old=self.indexed_active,
            active_new=active,
            status_old=self._status,
            **extra,
        )
        for effect in tr.effects:
            # By exact type (effects are final dataclasses): no isinstance chain.
            if type(effect) is EndLeases:
                status = _FENCED if effect.reason == "fenced" else _RUN_TERMINAL
                now = self.s.clock.time_ms()
                w.lease_status.extend((lid, status, now) for lid in effect.lease_ids)
            elif type(effect) is StartChildren:
                children = child_writes(self.s, effect, self.s.clock.time_ms())
                w.children.extend(children)
                for cw in walk_writes(children):
                    self.s.stats.status_moved(None, cw.record["status"])
                    # Grandchildren too (a child whose first step starts its own):
                    # every run created here needs an actor once this commits.
                    self._created.append(cw.run_id)
            elif type(effect) is NotifyParent:
                r = m.record
                w.inbox.append((effect.parent_run_id, self.run_id, {
                    "type": "child_finished", "child_run_id": self.run_id,
                    "status": r.status.text, "result": r.result, "error": r.error,
                }))
            elif type(effect) is CancelChildren:
                for child in effect.run_ids:
                    w.inbox.append((child, self.run_id, {"type": "cancel",
                                                         "message": f"parent run {self.run_id} ended"}))
        self.indexed_due = due
        self.indexed_active = active
        status = m.record.status.text
        if status != self._status:
            self.s.stats.status_moved(self._status, status)
            self._status = status
        return w

    def _write_behind(self, w: store.RunWrite) -> None:
        """Queue a write nobody awaits (an offer the registry's queue made, an
        at_least_once `started`).

        The trace sink hears of it now: it only notes the attempt's start, and
        exports nothing until a later write of this run ends the attempt,
        which is committed after this one (the storage keeps submission order).
        """
        self.s.storage.write_deferred(store.apply_txn, store.deferred(w))
        if self.s.trace is not None:
            self.s.trace.committed(w)

    def _arm(self) -> None:
        self._arm_at(self.machine.next_deadline())

    def _arm_at(self, due: int | None) -> None:
        """Arm (or cancel) the timer of the machine's next deadline, `due`."""
        self._due.arm(self.s, self, due)
