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
        # The last deferred write (`_write_behind`) and its storage handle, while the
        # next write of this run may still take it in (`_take_behind`).
        self._behind: tuple[Any, store.RunWrite] | None = None

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

    def _write_behind(self, w: store.RunWrite, *, trace: bool = True) -> None:
        """Queue a write nobody awaits (an offer the registry's queue made, an
        at_least_once `started`).

        The trace sink hears of it now (`trace`): it only notes the attempt's
        start, and exports nothing until a later write of this run ends the
        attempt, which is committed after this one (the storage keeps
        submission order, and a write that takes this one in holds it first).
        """
        # Not taken into this one: a deferred write's failure is reported on its own
        # (`on_deferred_error`), which a merged one's `store.Refused` would not be.
        # The earlier one stays queued ahead of this, in order.
        store.deferred(w)
        handle = self.s.storage.write_deferred(store.apply_txn, w)
        self._behind = (handle, w) if store.mergeable(w) else None
        if trace and self.s.trace is not None:
            self.s.trace.committed(w)

    def _take_behind(self, w: store.RunWrite) -> store.RunWrite:
        """`w`, the run's next write, with its last deferred write taken in if no
        batch took that one yet: one write where there were two.

        Under load, a queued slot's offer is written behind and the worker's
        `complete` follows before the writer thread got to it (B: 3,000 of 7,000
        writes were offers). Taking it back and writing it first in `w`'s place
        is safe: nothing of another run depends on it (the worker's calls reach
        this actor, and `_ensure_leases` waits for what is on record), and it
        commits in the same batch it would have. Every write of this run passes
        here, or queues behind it, so no write of this run falls between the two.
        Call it right before `w` is submitted and awaited, with no await between:
        a deferred write taken back is lost if `w` is not written. If `w`'s own
        part fails, the deferred one is written alone (`store.apply_txn`).
        """
        behind = self._behind
        if behind is None:
            return w
        self._behind = None
        handle, old = behind
        if not self.s.storage.withdraw(handle):
            return w
        self.s.stats.writes_merged += 1
        return store.merge(old, w)

    def _arm(self) -> None:
        self._arm_at(self.machine.next_deadline())

    def _arm_at(self, due: int | None) -> None:
        """Arm (or cancel) the timer of the machine's next deadline, `due`."""
        self._due.arm(self.s, self, due)
