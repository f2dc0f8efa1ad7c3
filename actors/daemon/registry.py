"""The registry actor: routes runnable slots to the workers that can serve them.

It knows which workers registered which (workflow, version, body), holds the
queue of runnable slots per key, and the claims waiting for work (HTTP
long-polls, WebSocket credit). Each slot is handed to exactly one claimant; the
run actor then turns it into a lease (`Offer`), and a slot the run no longer
wants (withdrawn, or already offered) simply fails that offer.

Nothing here is durable: workers are reloaded from the `workers` table and
runs re-announce their queued slots when they (re)start (`Resync`), so killing
the registry loses nothing acknowledged. Every handler is synchronous: the
registry never waits on another actor, so it cannot take part in a deadlock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio

from stepd.actors import Actor
from stepd.sansio.events import AttemptSpec

from .messages import (
    Announce,
    CancelWait,
    Claim,
    ForgetWorkers,
    RegisterWorker,
    RegistryStats,
    ReturnSpecs,
    WithdrawSlots,
)

Key = tuple[str, "str | None", str]  # (workflow, version, body)
SlotId = tuple[str, str, "int | None"]  # (run_id, step_id, item_index)


def spec_key(spec: AttemptSpec) -> Key:
    return (spec.workflow, spec.version, spec.body)


def spec_slot(spec: AttemptSpec) -> SlotId:
    return (spec.run_id, spec.step_id, spec.item_index)


@dataclass(eq=False, slots=True)
class Waiter:
    """A parked claim. The registry fills `specs` and sets `event` at most once.

    The claimant owns `cancelled`: it sets it (on the event loop, so no await
    separates the check from the set) when it stops waiting; the registry never
    fills a cancelled waiter.

    `push` waiters (WebSocket sessions) are not one-shot: `deliver` is called
    for each slot while `credit` lasts.
    """

    worker_id: str
    max: int
    run_id: str | None
    event: anyio.Event = field(default_factory=anyio.Event)
    specs: list[AttemptSpec] = field(default_factory=list)
    cancelled: bool = False
    deliver: Callable[[AttemptSpec], None] | None = None
    credit: int = 0


@dataclass(slots=True)
class WorkerInfo:
    worker_id: str
    name: str
    keys: frozenset[Key]


@dataclass(frozen=True, slots=True)
class Stats:
    workers: int
    queued: int
    waiting_claims: int


class RegistryActor(Actor):
    kind = "registry"
    mailbox_size = 1 << 16

    def __init__(self, load_workers: Callable[[], list[WorkerInfo]]) -> None:
        self._load_workers = load_workers
        self.workers: dict[str, WorkerInfo] = {}
        self.queues: dict[Key, deque[AttemptSpec]] = {}
        self.queued: dict[SlotId, AttemptSpec] = {}
        self.waiting: list[Waiter] = []

    async def on_start(self) -> None:
        for info in self._load_workers():
            self.workers[info.worker_id] = info

    async def receive(self, message: Any) -> Any:
        if isinstance(message, Announce):
            for spec in message.specs:
                self._add(spec, front=False)
            return None
        if isinstance(message, Claim):
            return self._claim(message)
        if isinstance(message, WithdrawSlots):
            self._withdraw(message)
            return None
        if isinstance(message, ReturnSpecs):
            for spec in reversed(message.specs):
                self._add(spec, front=True)
            return None
        if isinstance(message, CancelWait):
            self._drop_waiter(message.waiter)
            return None
        if isinstance(message, RegisterWorker):
            self.workers[message.worker_id] = WorkerInfo(
                message.worker_id, message.name, message.keys
            )
            self._rematch()
            return None
        if isinstance(message, ForgetWorkers):
            for wid in message.worker_ids:
                self.workers.pop(wid, None)
            return None
        if isinstance(message, RegistryStats):
            return Stats(len(self.workers), len(self.queued), len(self.waiting))
        raise TypeError(f"registry: unexpected message {message!r}")

    # ------------------------------------------------------------------ routing

    def _serves(self, waiter: Waiter, spec: AttemptSpec) -> bool:
        info = self.workers.get(waiter.worker_id)
        if info is None or spec_key(spec) not in info.keys:
            return False
        if waiter.run_id is not None and waiter.run_id != spec.run_id:
            return False
        return waiter.worker_id not in spec.excluded_workers

    def _add(self, spec: AttemptSpec, *, front: bool) -> None:
        slot = spec_slot(spec)
        known = self.queued.get(slot)
        if known is not None:
            if known.attempt >= spec.attempt and known.excluded_workers == spec.excluded_workers:
                return  # a re-announcement of what is queued already
            self._remove(known)
        for waiter in self.waiting:
            if not waiter.cancelled and self._serves(waiter, spec):
                if self._hand(waiter, spec):
                    return
        self.queued[slot] = spec
        q = self.queues.setdefault(spec_key(spec), deque())
        if front:
            q.appendleft(spec)
        else:
            q.append(spec)

    def _hand(self, waiter: Waiter, spec: AttemptSpec) -> bool:
        """Give one slot to a waiter; False if the waiter could not take it."""
        if waiter.deliver is not None:
            if waiter.credit <= 0:
                return False
            waiter.credit -= 1
            waiter.deliver(spec)
            if waiter.credit <= 0:
                self.waiting.remove(waiter)
            return True
        waiter.specs.append(spec)
        waiter.event.set()
        self.waiting.remove(waiter)
        return True

    def _remove(self, spec: AttemptSpec) -> None:
        self.queued.pop(spec_slot(spec), None)
        q = self.queues.get(spec_key(spec))
        if q is not None:
            try:
                q.remove(spec)
            except ValueError:
                pass
            if not q:
                del self.queues[spec_key(spec)]

    def _take(self, worker_id: str, max_n: int, run_id: str | None) -> list[AttemptSpec]:
        info = self.workers.get(worker_id)
        if info is None:
            return []
        taken: list[AttemptSpec] = []
        for key in info.keys:
            q = self.queues.get(key)
            if not q:
                continue
            for spec in list(q):
                if len(taken) >= max_n:
                    break
                if run_id is not None and spec.run_id != run_id:
                    continue
                if worker_id in spec.excluded_workers:
                    continue
                taken.append(spec)
            if len(taken) >= max_n:
                break
        for spec in taken:
            self._remove(spec)
        return taken

    def _claim(self, claim: Claim) -> list[AttemptSpec] | Waiter:
        if claim.worker_id not in self.workers:
            return []
        waiter = claim.waiter
        if isinstance(waiter, Waiter) and waiter.deliver is not None:
            # A push session adding credit: serve what is queued, park the rest.
            self._drop_waiter(waiter)
            if waiter.cancelled:
                return []
            taken = self._take(claim.worker_id, waiter.credit, claim.run_id)
            for spec in taken:
                waiter.credit -= 1
                waiter.deliver(spec)
            if waiter.credit > 0 and not waiter.cancelled:
                self.waiting.append(waiter)
            return taken
        taken = self._take(claim.worker_id, claim.max, claim.run_id)
        if taken or not isinstance(waiter, Waiter) or waiter.cancelled:
            return taken
        self.waiting.append(waiter)
        return waiter

    def _withdraw(self, message: WithdrawSlots) -> None:
        if message.slots is None:
            doomed = [s for slot, s in self.queued.items() if slot[0] == message.run_id]
        else:
            doomed = [
                s for step, item in message.slots
                if (s := self.queued.get((message.run_id, step, item))) is not None
            ]
        for spec in doomed:
            self._remove(spec)

    def _drop_waiter(self, waiter: Any) -> None:
        try:
            self.waiting.remove(waiter)
        except ValueError:
            pass

    def _rematch(self) -> None:
        """A worker registered: hand queued slots to waiters that can now take them."""
        for spec in list(self.queued.values()):
            for waiter in list(self.waiting):
                if not waiter.cancelled and self._serves(waiter, spec) and self._hand(waiter, spec):
                    self._remove(spec)
                    break
