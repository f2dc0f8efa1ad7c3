"""The run machine's attempt layer: what a worker's attempt at a slot does to the run.

One handler per attempt event of the table (`run.TRANSITIONS`): the offer
that makes a lease (its fence, what the worker gets, the sticky part), the
worker's calls on it (started, completed, failed) and what the lease actor
reports of it (orphaned, revived, lost, released, unservable). Each names
its attempt by (step, item, fence) and is refused `Fenced` when that attempt
is no longer the live one. The run-level events (signals, timers, children,
cancel, retry) are `_run_events`'. See `_run_base` for the layers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._run_base import (
    END,
    _jump_of,
    _retry_of,
    span_id_for,
)
from ._run_local import _RunLocal
from .definition import (
    Delivery,
    ForEachStep,
    TaskStep,
)
from .errors import Fenced, Invalid
from .events import (
    AttemptCompleted,
    AttemptFailed,
    AttemptLost,
    AttemptOffered,
    AttemptOrphaned,
    AttemptReleased,
    AttemptRevived,
    AttemptStarted,
    AttemptUnservable,
    Transition,
)
from .record import slot_key
from .status import ErrorReason, SlotPhase
from .sticky import MISSING as STICKY_MISSING
from .sticky import (
    StickyWorker,
    claim_holder,
    cold_reason,
    cursor_of,
    delta_since,
    start_tracking,
)

# Slot phases as module names: a lookup on an Enum class costs ~1,400
# instructions on 3.11 (stepd/sansio/lease.py says why); ~5 a step here.
_QUEUED = SlotPhase.QUEUED
_OFFERED = SlotPhase.OFFERED
_STARTED = SlotPhase.STARTED
_DONE = SlotPhase.DONE

__all__ = ["_RunAttempts"]


class _RunAttempts(_RunLocal):
    __slots__ = ()

    # ------------------------------------------------------------------ offers and calls

    def _on_offered(self, ev: AttemptOffered, now: int) -> Transition:
        f, slot = self._slot(ev.step_id, ev.item_index)
        if slot.phase is not _QUEUED:
            raise Fenced(f"slot {slot_key(ev.step_id, ev.item_index)} is {slot.phase.value}, not queued")
        if ev.worker_id in slot.excluded:
            # PROTOCOL.md "Unservable": never offered again to a worker that said it
            # lacks the body, whatever stale copy of the slot its session still held.
            raise Fenced(f"worker {ev.worker_id} answered unservable for slot "
                         f"{slot_key(ev.step_id, ev.item_index)}")
        step = self.definition.step(f.step_id)
        if TYPE_CHECKING:  # a slot's step: only these are offered (no isinstance per offer)
            assert isinstance(step, (TaskStep, ForEachStep))
        name = step.session
        session = None if name is None else self._check_holder(name, ev.worker_id)
        tr = Transition()
        key = slot_key(ev.step_id, ev.item_index)
        fence = self.record.fences.get(key, 0) + 1
        self.record.fences[key] = fence
        slot.fence = fence
        slot.phase = _OFFERED
        slot.lease_id = ev.lease_id
        slot.worker_id = ev.worker_id
        self._journal(
            tr, now, "step_offered", step_id=ev.step_id, item_index=ev.item_index,
            attempt=slot.attempt, fence=fence, lease_id=ev.lease_id,
            worker_id=ev.worker_id, worker_name=ev.worker_name,
        )
        spec = self._spec(step, f, slot)
        sticky_part: dict[str, Any] | None = None
        if ev.sticky is not None and isinstance(step, TaskStep):
            sticky_part = self._sticky_lease(ev.sticky, session=step.session is not None)
        tr.lease = {
            "lease_id": ev.lease_id,
            "fence": fence,
            "run_id": self.record.run_id,
            "workflow": self.record.workflow,
            "version": self.record.version,
            "definition_hash": self.record.definition_hash,
            "step_id": ev.step_id,
            "body": spec.body,
            "attempt": slot.attempt,
            "item_index": ev.item_index,
            "delivery": spec.delivery,
            "input": slot.input,
            "steps": dict(self.record.steps),
            "state": dict(self.record.state),
            "correlation": self.record.correlation,
            "idempotency_key": spec.idempotency_key,
            "trace_id": self.trace_id,
            "span_id": span_id_for(ev.lease_id),
            "timeout_ms": spec.timeout_ms,
        }
        if session is not None:
            tr.lease["session"] = session
        if ev.local_steps and ev.item_index is None:
            plan = self.plan_for(ev.step_id, ev.lease_id)
            if plan:
                tr.lease["local_steps"] = plan
                tr.lease["run_input"] = self.record.input
        if sticky_part is not None:
            lease = tr.lease
            lease["sticky"] = sticky_part
            if sticky_part["mode"] != "full":
                # The worker rebuilds these from its cache plus the delta, or fetches
                # them (cold).
                del lease["steps"], lease["state"]
        return tr

    def _sticky_lease(self, worker: StickyWorker, *, session: bool) -> dict[str, Any]:
        """The ``sticky`` part of a task lease for a worker that declared sticky execution
        (docs/affinity.md "Sticky execution", "The lease").

        To the holder (the worker that ran the previous step and cached the
        history at a cursor): a delta, the entries written after its cursor, with
        the base cursor and the resulting one, each naming the cache identity
        (workflow, run, build id) it belongs to. To another worker while the run
        has a holder that was lost (`cold_reason`): no history at all, the
        worker fetches it and counts a forced cold replay, as AFFINITY.md asks of
        a holder loss. To anyone else (no holder yet, or the holder cached
        nothing; a worker session's step pinned to a worker that is not the
        sticky holder): the full history as always, with its cursor, so the
        worker can start caching (a miss).
        """
        r = self.record
        if r.sticky is None:
            r.sticky = start_tracking(r.steps, r.state, r.seq)
        sticky = r.sticky
        hold = sticky["hold"]
        identity = {"workflow": r.workflow, "run_id": r.run_id}
        cursor = {**cursor_of(sticky), **identity, "build_id": worker.build_id}
        if hold is not None and hold["w"] != worker.worker_id:
            reason = cold_reason(hold, session=session)
            if reason is not None:
                return {"mode": "cold", "reason": reason, "cursor": cursor}
        if hold is None or hold["w"] != worker.worker_id or hold["c"] > sticky["s"]:
            return {"mode": "full", "cursor": cursor}
        # The base names the build the holder cached under: a worker now running
        # another build finds no such entry and fetches the history (AFFINITY.md).
        base = {"seq": hold["c"], "hash": hold["ch"], **identity, "build_id": hold["b"]}
        delta = delta_since(sticky, r.steps, r.state, hold["c"])
        return {"mode": "delta", "base": base, "cursor": cursor, **delta}

    def _on_started(self, ev: AttemptStarted, now: int) -> Transition:
        f, slot = self._live_slot(ev.step_id, ev.item_index, ev.fence)
        tr = Transition()
        if slot.phase is _STARTED:
            return tr  # a repeated `started` changes nothing
        step = self.definition.step(f.step_id)
        slot.phase = _STARTED
        if TYPE_CHECKING:  # a slot's step (no isinstance per attempt)
            assert isinstance(step, (TaskStep, ForEachStep))
        timeout = step.timeout_ms
        slot.timeout_at = None if timeout is None else now + timeout
        self._journal(
            tr, now, "step_started", step_id=ev.step_id, item_index=ev.item_index,
            attempt=slot.attempt, fence=ev.fence, lease_id=slot.lease_id,
            worker_id=slot.worker_id,
        )
        return tr

    def _on_completed(self, ev: AttemptCompleted, now: int) -> Transition:
        if not ev.local_steps:
            return self._completed(ev, now)
        self._live_slot(ev.step_id, ev.item_index, ev.fence)  # Fenced before anything
        if ev.item_index is not None:
            raise Invalid("a for_each item carries no local steps", field="local_steps")
        snapshot = self._snapshot()
        try:
            return self._completed(ev, now)
        except Invalid:
            self._restore(snapshot)  # nothing of the completion is applied
            raise

    def _completed(self, ev: AttemptCompleted, now: int) -> Transition:
        f, slot = self._live_slot(ev.step_id, ev.item_index, ev.fence)
        patch = ev.state_patch
        if patch is not None and not isinstance(patch, dict):
            raise Invalid("must be an object", field="state_patch")
        step = self.definition.step(f.step_id)
        is_task = type(step) is TaskStep  # steps are final classes: no isinstance per step
        jump = _jump_of(ev.output) if is_task else None
        if jump is not None and jump != END:
            try:
                self.definition.index_of(jump)
            except KeyError:
                raise Invalid(f"{jump!r} is not a step of {self.definition.name!r}",
                              field="output._next_step") from None
        r = self.record
        sticky = r.sticky
        if ev.sticky is not None and (
                sticky is None or not isinstance(step, TaskStep)
                or (ev.sticky.workflow, ev.sticky.seq, ev.sticky.hash)
                != (r.workflow, sticky["s"], sticky["h"])):
            # A worker claims only a cursor it verified against this lease (or fetched
            # for it): anything else is refused whole, nothing applied.
            raise Invalid("is not the history cursor of this lease", field="sticky_cursor")
        if sticky is not None and is_task:
            claim_holder(sticky, slot.worker_id or "", ev.sticky)
        tr = Transition()
        self._add_usage(ev.usage)
        self._journal(
            tr, now, "step_completed", step_id=ev.step_id, item_index=ev.item_index,
            attempt=slot.attempt, fence=ev.fence, lease_id=slot.lease_id,
            worker_id=slot.worker_id, usage=ev.usage or None,
            spans=list(ev.spans) if ev.spans else None,
        )
        slot.phase = _DONE
        if is_task:
            if TYPE_CHECKING:  # narrowed for the type checker (no isinstance per step)
                assert isinstance(step, TaskStep)
            tr.journal[-1]["output"] = ev.output  # even null: see `_finish_step`
            f.slots.remove(slot)
            nxt = self._finish_step(
                step, ev.output, tr, now, patch=patch, cost_delta=slot.cost_units, jump=jump,
            )
            if ev.local_steps:
                nxt = self._apply_local(nxt, ev.local_steps, {
                    "parent_step_id": step.id, "lease_id": slot.lease_id,
                    "worker_id": slot.worker_id}, tr, now)
            if nxt is not None:
                self._run_steps_from(nxt, tr, now)
            return tr
        assert isinstance(step, ForEachStep)
        # One item of a for_each: its cost and patch count now ("on each completion").
        breach = self._check(
            max_cost_units=r.cost_units + slot.cost_units,
            max_state_bytes=None if not patch else self._size({**r.state, **patch}),
        ) if self.definition.budgeted else None
        if breach is not None:
            self._breach(breach, step.id, tr, now)
            return tr
        r.cost_units += slot.cost_units
        if patch:
            old_state = r.state
            r.state = {**r.state, **patch}
            r.state_bytes = self._size(r.state)
            if r.sticky is not None:
                for k in patch:
                    self._history_set("state", k, old_state.get(k, STICKY_MISSING), patch[k])
            self._journal(tr, now, "state_patched", step_id=step.id, item_index=ev.item_index,
                          keys=sorted(patch), values=dict(patch))
        assert ev.item_index is not None
        f.slots.remove(slot)
        f.outputs[ev.item_index] = ev.output
        f.done += 1
        if f.done == f.total:
            nxt = self._finish_step(step, list(f.outputs), tr, now, into_value=list(f.outputs))
            if nxt is not None:
                self._run_steps_from(nxt, tr, now)
            return tr
        self._fill_for_each(step, f, tr, now)
        return tr

    def _on_failed(self, ev: AttemptFailed, now: int) -> Transition:
        f, slot = self._live_slot(ev.step_id, ev.item_index, ev.fence)
        if ev.error_class == "unservable":
            return self._on_unservable(AttemptUnservable(
                ev.step_id, ev.item_index, ev.fence, slot.worker_id or "", ev.message), now)
        tr = Transition()
        self._journal(
            tr, now, "step_failed", step_id=ev.step_id, item_index=ev.item_index,
            attempt=slot.attempt, fence=ev.fence, lease_id=slot.lease_id,
            worker_id=slot.worker_id, error_class=ev.error_class, message=ev.message,
        )
        self._attempt_failed(f, slot, ev.error_class, ev.message, tr, now)
        return tr

    def _on_lost(self, ev: AttemptLost, now: int) -> Transition:
        f, slot = self._live_slot(ev.step_id, ev.item_index, ev.fence)
        step = self.definition.step(f.step_id)
        tr = Transition()
        self._journal(
            tr, now, "step_recovered", step_id=ev.step_id, item_index=ev.item_index,
            attempt=slot.attempt, fence=ev.fence, lease_id=slot.lease_id,
            started=ev.started,
        )
        delivery = getattr(step, "delivery", Delivery.AT_LEAST_ONCE)
        if delivery is Delivery.AT_MOST_ONCE:
            if ev.started:
                # PROTOCOL.md "Expiry and recovery": never re-run; the step fails `lost`.
                self._journal(tr, now, "step_failed", step_id=ev.step_id,
                              item_index=ev.item_index, attempt=slot.attempt, fence=ev.fence,
                              error_class="lost",
                              message="at_most_once attempt lost after it started")
                self._fail_run(ErrorReason.LEASE_LOST,
                               "at_most_once attempt lost after it started", step.id, tr, now)
                return tr
            self._requeue(step, f, slot, tr, attempt=slot.attempt, now=now)
            return tr
        retry = _retry_of(step)
        if slot.attempt >= retry.max_attempts:
            self._fail_run(
                ErrorReason.LEASE_LOST,
                f"lease lost on attempt {slot.attempt} of {retry.max_attempts}", step.id, tr, now,
            )
            return tr
        self._requeue(step, f, slot, tr, attempt=slot.attempt + 1, now=now)
        return tr

    def _on_orphaned(self, ev: AttemptOrphaned, now: int) -> Transition:
        return self._journal_only("step_orphaned", ev, now)

    def _on_revived(self, ev: AttemptRevived, now: int) -> Transition:
        return self._journal_only("step_revived", ev, now)

    def _journal_only(self, type_: str, ev: AttemptOrphaned | AttemptRevived, now: int) -> Transition:
        """Lease timing news: journaled against the live attempt, nothing else changes."""
        _, slot = self._live_slot(ev.step_id, ev.item_index, ev.fence)
        tr = Transition()
        self._journal(tr, now, type_, step_id=ev.step_id, item_index=ev.item_index,
                      attempt=slot.attempt, fence=ev.fence, lease_id=slot.lease_id,
                      worker_id=slot.worker_id)
        return tr

    def _on_released(self, ev: AttemptReleased, now: int) -> Transition:
        f, slot = self._live_slot(ev.step_id, ev.item_index, ev.fence)
        if slot.phase is not _OFFERED:
            raise Fenced(f"lease {slot.lease_id} has started: it cannot be released")
        step = self.definition.step(f.step_id)
        tr = Transition()
        self._journal(tr, now, "step_recovered", step_id=ev.step_id, item_index=ev.item_index,
                      attempt=slot.attempt, fence=ev.fence, lease_id=slot.lease_id,
                      started=False, released=True)
        self._requeue(step, f, slot, tr, attempt=slot.attempt, now=now)  # never ran: no budget spent
        return tr

    def _on_unservable(self, ev: AttemptUnservable, now: int) -> Transition:
        f, slot = self._live_slot(ev.step_id, ev.item_index, ev.fence)
        step = self.definition.step(f.step_id)
        tr = Transition()
        self._journal(
            tr, now, "step_unservable", step_id=ev.step_id, item_index=ev.item_index,
            attempt=slot.attempt, fence=ev.fence, lease_id=slot.lease_id,
            worker_id=ev.worker_id, message=ev.message,
        )
        if ev.worker_id not in slot.excluded:
            slot.excluded.append(ev.worker_id)
        self._requeue(step, f, slot, tr, attempt=slot.attempt, now=now)  # no retry budget spent
        return tr
