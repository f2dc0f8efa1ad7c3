"""The registry actor: routes runnable slots to the worker sessions that can serve them.

It knows which workers registered which (workflow, version, body), holds the
queue of runnable slots per key, and what each worker's session takes now:
its push connection's credit, and its HTTP claims waiting for work (each a
count and maybe a run filter). Each slot is handed to exactly one session
(`SlotFor`); the session asks the slot's run for a lease (`Offer`), and a slot
the run no longer wants (withdrawn, or already offered) simply fails that
offer, which gives the session its credit back. A run offering its next slot
in its own turn asks the registry which session takes it (`Route`, answered
in the run's call: the pick is counted here exactly as a `SlotFor` is) and
delivers it itself (`RunActor._offer_now`).

Nothing here is durable: workers are reloaded from the `workers` table, runs
re-announce their queued slots when they (re)start (`Resync`), and sessions
subscribe again (`Resubscribe`), so killing the registry loses nothing
acknowledged. Every handler is synchronous and asks nobody: the registry
cannot take part in a deadlock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from stepd.actors import Actor
from stepd.sansio.events import AttemptSpec
from stepd.sansio.session import ANSWER

from . import peers
from .messages import (
    Announce,
    Due,
    ForgetWorkers,
    RegisterWorker,
    RegistryStats,
    ReturnSpecs,
    Route,
    SlotFor,
    Subscribe,
    Unsubscribe,
    WithdrawSlots,
)
from .services import Services

__all__ = ["RegistryActor", "Stats", "WorkerInfo", "spec_key"]

Key = tuple[str, "str | None", str]  # (workflow, version, body)
SlotId = tuple[str, str, "int | None"]  # (run_id, step_id, item_index)


def spec_key(spec: AttemptSpec) -> Key:
    return (spec.workflow, spec.version, spec.body)


def spec_slot(spec: AttemptSpec) -> SlotId:
    return (spec.run_id, spec.step_id, spec.item_index)


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


@dataclass(eq=False, slots=True)
class _Sub:
    """What one session takes now: its push credit (claim None) or one claim."""

    worker_id: str
    claim: int | None
    run_id: str | None
    n: int


class RegistryActor(Actor):
    kind = "registry"
    mailbox_size = 1 << 16
    #: Every handler is synchronous (module docstring): a tell finding it idle is
    #: routed in the teller's call (a run's announce, in the run's own turn).
    sync_handlers = True

    def __init__(self, services: Services, load_workers: Callable[[], list[WorkerInfo]]) -> None:
        self.s = services
        self._load_workers = load_workers
        self.workers: dict[str, WorkerInfo] = {}
        self.queues: dict[Key, deque[AttemptSpec]] = {}
        self.queued: dict[SlotId, AttemptSpec] = {}
        #: Subscriptions in arrival order (the first that serves a slot gets it).
        self.waiting: list[_Sub] = []
        self._subs: dict[tuple[str, int | None], _Sub] = {}
        #: The earliest time a sticky preference held back a slot (its timer is armed).
        self._lapse: int | None = None

    async def on_start(self) -> None:
        for info in self._load_workers():
            self.workers[info.worker_id] = info

    async def receive(self, message: Any) -> Any:
        if type(message) is Route:  # a run's, in its own turn (a step each): first, no call
            if message.answer_to is not None:
                return self._route_answer(message.spec, message.answer_to)
            return self._route(message.spec)
        if isinstance(message, Announce):
            for spec in message.specs:
                self._add(spec, front=False)
            return None
        if isinstance(message, Subscribe):
            self._subscribe(message)
            return None
        if isinstance(message, Unsubscribe):
            self._unsubscribe(message)
            return None
        if isinstance(message, ReturnSpecs):
            for spec in reversed(message.specs):
                self._add(spec, front=True)
            return None
        if isinstance(message, WithdrawSlots):
            self._withdraw(message)
            return None
        if isinstance(message, RegisterWorker):
            self.workers[message.worker_id] = WorkerInfo(
                message.worker_id, message.name, message.keys)
            self._rematch()
            return None
        if isinstance(message, ForgetWorkers):
            for wid in message.worker_ids:
                self.workers.pop(wid, None)
                self._unsubscribe(Unsubscribe(wid, all=True))
            return None
        if isinstance(message, Due):
            # A sticky preference lapsed: offer what it held back to whoever waits.
            self._lapse = None
            self._rematch()
            return None
        if isinstance(message, RegistryStats):
            claims = sum(1 for sub in self.waiting if sub.claim is not None)
            return Stats(len(self.workers), len(self.queued), claims)
        raise TypeError(f"registry: unexpected message {message!r}")

    # ------------------------------------------------------------------ routing

    def _serves(self, sub: _Sub, spec: AttemptSpec) -> bool:
        info = self.workers.get(sub.worker_id)
        if info is None or (spec.workflow, spec.version, spec.body) not in info.keys:  # spec_key
            return False
        if sub.run_id is not None and sub.run_id != spec.run_id:
            return False
        if spec.session is not None and spec.pinned != sub.worker_id:
            return False  # a worker session's step: its holder only (none yet: it waits)
        if spec.prefer is not None and spec.prefer != sub.worker_id \
                and spec.prefer in self.workers and spec.prefer_until is not None:
            # Sticky execution (AFFINITY.md): the slot waits for the worker that ran
            # the run's previous step until its preference lapses, then goes to anyone.
            until = spec.prefer_until
            if self.s.clock.time_ms() < until:
                if self._lapse is None or until < self._lapse:
                    self._lapse = until
                    peers.arm_due(self.s, self, until)
                return False
        return sub.worker_id not in spec.excluded_workers

    def _hand(self, sub: _Sub, spec: AttemptSpec) -> bool:
        """Give one slot to a session; False if it could not be told (it is restarting)."""
        if not peers.tell(self.s, f"/sessions/{sub.worker_id}", SlotFor(spec, sub.claim)):
            self._drop(sub)  # its next incarnation subscribes afresh
            return False
        sub.n -= 1
        if sub.n <= 0:
            self._drop(sub)
        return True

    def _route(self, spec: AttemptSpec) -> tuple[str, int | None] | None:
        """`_add`'s hand-over, minus the `SlotFor`: the run that asked delivers it.

        None (the run announces it instead) for a slot queued already (`_add`
        sorts out a re-announcement), for one no session takes now, and for one
        whose first taker is an HTTP claim: a claim answers once its slots are
        offered, and slots queued to its session together go out in one answer
        (`ClaimReady`), where slots offered one by one would each end it.
        """
        if (spec.run_id, spec.step_id, spec.item_index) in self.queued:  # `spec_slot`
            return None
        for sub in self.waiting:
            if self._serves(sub, spec):
                if sub.claim is not None:
                    return None
                taken = (sub.worker_id, sub.claim)
                sub.n -= 1
                if sub.n <= 0:
                    self._drop(sub)
                return taken
        return None

    def _route_answer(self, spec: AttemptSpec, worker_id: str) -> tuple[str, int | None] | None:
        """`_route` for a slot made runnable by `worker_id`'s own ``complete`` with
        ``claim_next``: that worker takes it in the call's answer (`ANSWER`) if it
        serves the slot, in the slot its completed lease frees, so no subscription
        is counted; else the slot is routed as any other."""
        if (spec.run_id, spec.step_id, spec.item_index) not in self.queued \
                and worker_id in self.workers \
                and self._serves(_Sub(worker_id, None, None, 0), spec):
            return (worker_id, ANSWER)
        return self._route(spec)

    def _add(self, spec: AttemptSpec, *, front: bool) -> None:
        slot = spec_slot(spec)
        known = self.queued.get(slot)
        if known is not None:
            if known.attempt >= spec.attempt and known.excluded_workers == spec.excluded_workers \
                    and known.pinned == spec.pinned:
                return  # a re-announcement of what is queued already
            self._remove(known)
        for sub in list(self.waiting):
            if self._serves(sub, spec) and self._hand(sub, spec):
                return
        self.queued[slot] = spec
        q = self.queues.setdefault(spec_key(spec), deque())
        if front:
            q.appendleft(spec)
        else:
            q.append(spec)

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

    def _subscribe(self, msg: Subscribe) -> None:
        info = self.workers.get(msg.worker_id)
        if info is None or msg.n <= 0:
            return
        key = (msg.worker_id, msg.claim)
        sub = self._subs.get(key)
        if sub is None:
            sub = _Sub(msg.worker_id, msg.claim, msg.run_id, 0)
            self._subs[key] = sub
            self.waiting.append(sub)
        sub.n += msg.n
        # Serve what is queued first, in queue order.
        for k in info.keys:
            q = self.queues.get(k)
            if not q:
                continue
            for spec in list(q):
                if sub.n <= 0:
                    return
                if self._serves(sub, spec):
                    self._remove(spec)
                    if not self._hand(sub, spec):
                        self._add(spec, front=True)
                        return

    def _unsubscribe(self, msg: Unsubscribe) -> None:
        if msg.all:
            for key in [k for k in self._subs if k[0] == msg.worker_id]:
                self._drop(self._subs[key])
            return
        sub = self._subs.get((msg.worker_id, msg.claim))
        if sub is not None:
            self._drop(sub)

    def _drop(self, sub: _Sub) -> None:
        if self._subs.get((sub.worker_id, sub.claim)) is sub:
            del self._subs[(sub.worker_id, sub.claim)]
            try:
                self.waiting.remove(sub)
            except ValueError:
                pass

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

    def _rematch(self) -> None:
        """A worker registered: hand queued slots to subscriptions that can now take them."""
        for spec in list(self.queued.values()):
            for sub in list(self.waiting):
                if self._serves(sub, spec):
                    self._remove(spec)
                    if not self._hand(sub, spec):
                        self._add(spec, front=True)
                    break
