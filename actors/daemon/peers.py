"""How the daemon's actors reach each other: by path, through the actor system, by message.

Every function takes the `Services` the caller stands on. Nothing here holds
state or calls up into the API: a run tells the registry its runnable slots,
a lease asks its run to apply a call, a session asks a run for an offer.
Asks only go run-ward (leases, sessions, recovery and the API ask runs; runs
wait on nobody: their `ask_now` of the registry and of a session never
waits), so no cycle of asks can deadlock.

The run and lease actors' child specs come from `Services.run_spec` and
`Services.lease_spec`, set where the tree is built (`tree`), so this module
imports no actor class and no actor module imports another.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio

from stepd.actors import (
    Actor,
    ActorDead,
    ActorNotFound,
    ActorRef,
    ChildExists,
    ChildSpec,
    StartFailed,
    SupervisorRef,
)
from stepd.sansio.errors import Fenced, NotFound, Unavailable

from .messages import (
    Announce,
    Due,
    EndLease,
    LeasesDueBy,
    ReturnSpecs,
    Route,
    TimerIndexChanged,
    WithdrawSlots,
)
from .services import Services

__all__ = [
    "RETRIES",
    "DueTimer",
    "activate_run",
    "active_runs",
    "announce",
    "arm_at",
    "ask_run",
    "defer_expiry",
    "end_lease",
    "ensure_schedule",
    "ensure_session",
    "ensure_work_session",
    "fixed",
    "lease_alive",
    "registry",
    "route_now",
    "start_lease",
    "supervisors_alive",
    "sweep_leases",
    "tell",
    "tell_fixed",
    "tell_now",
    "tell_ref",
    "tell_ref_now",
    "timers_changed",
    "wake_run",
    "withdraw",
]

#: How many times a call retries a run actor that died under it (it is being
#: restarted by its supervisor, or a passivating run stopped at that moment).
RETRIES = 50

_GONE = (ActorDead, ActorNotFound, anyio.WouldBlock)


def fixed(s: Services, path: str) -> ActorRef:
    """The ref of one of the tree's fixed actors (`/registry`, `/leases`, `/timers`,
    `/recovery`), resolved once: a ref reaches whichever incarnation is current.

    Raises:
        ActorNotFound: not in the tree (yet).
    """
    ref: ActorRef | None = s.fixed_refs.get(path)
    if ref is None:
        ref = s.system.resolve(path)
        if ref.alive:  # a plain ActorRef stands in for a supervisor between incarnations
            s.fixed_refs[path] = ref
    return ref


def tell(s: Services, path: str, message: Any) -> bool:
    """Tell the actor at `path` without waiting; False when it is not there or busy.

    For messages whose loss its receiver recovers from by itself (a
    restarting registry reloads, a restarted lease actor reads its record).
    """
    try:
        s.system.resolve(path).tell_nowait(message)
        return True
    except _GONE:
        return False


def tell_fixed(s: Services, path: str, message: Any) -> bool:
    """`tell` to one of the fixed actors (`fixed`)."""
    try:
        fixed(s, path).tell_nowait(message)
        return True
    except _GONE:
        return False


def tell_now(s: Services, path: str, message: Any) -> bool:
    """`tell`, handled right here when the actor is idle (`ask_now`; its handler for
    `message` must not wait), else queued; False when it is not there or full."""
    try:
        return tell_ref_now(s.system.resolve(path), message)
    except _GONE:
        return False


def tell_ref_now(ref: ActorRef, message: Any) -> bool:
    """`tell_now` through a ref already resolved."""
    try:
        try:
            ref.ask_now(message)
        except anyio.WouldBlock:
            ref.tell_nowait(message)
        return True
    except _GONE:
        return False


def route_now(s: Services, spec: Any, answer_to: str | None = None
              ) -> tuple[str, int | None] | None:
    """Which session takes `spec` now, counted as handed to it by the registry
    (`Route`, in the caller's turn); None: nobody now, or the registry is busy.
    `answer_to`: `Route.answer_to`."""
    try:
        # `fixed`'s cache read here: its call only when the ref is not cached yet.
        ref = s.fixed_refs.get("/registry") or fixed(s, "/registry")
        routed: tuple[str, int | None] | None = ref.ask_now(Route(spec, answer_to))
        return routed
    except _GONE:
        return None


def tell_ref(ref: ActorRef, message: Any) -> bool:
    """`tell` through a ref already resolved."""
    try:
        ref.tell_nowait(message)
        return True
    except _GONE:
        return False


async def _running(s: Services, parent: str, name: str, spec: Callable[[], ChildSpec],
                   missing: str) -> ActorRef:
    """The actor at ``parent/name``, started from ``spec()`` if it is not running.

    Its `on_start` raising LookupError means there is nothing on record to run:
    NotFound(`missing`). Any other failed start is a start cut short (a kill, a
    sibling restarting): ActorDead, which the callers retry a bounded number of
    times (a run failing for its own reasons is bounded by its crash count).
    """
    path = f"{parent}/{name}"
    ref = s.system.find(path)
    if ref is not None and ref.alive:
        return ref
    try:
        return await s.system.supervisor(parent).start_child(spec())
    except ChildExists:
        return s.system.resolve(path)
    except StartFailed as exc:
        if isinstance(exc.__cause__, LookupError):
            raise NotFound(missing) from exc
        raise ActorDead(path, exc.__cause__) from exc


async def ensure_session(s: Services, worker_id: str) -> ActorRef:
    """The worker's session actor, started if it has none.

    Raises:
        NotFound: the worker is not registered.
        ActorDead: the sessions supervisor is restarting.
    """
    return await _running(s, "/sessions", worker_id, lambda: s.session_spec(worker_id),
                          f"worker {worker_id!r} is not registered")


async def ensure_work_session(s: Services, session_id: str) -> ActorRef:
    """The actor of a worker session (``ws_<run id>.<name>``), started if it has none
    (created on its first start, from its run's definition).

    Raises:
        NotFound: no such run, or its definition has no such session.
        ActorDead: the sessions supervisor is restarting.
    """
    return await _running(s, "/sessions", session_id, lambda: s.work_session_spec(session_id),
                          f"worker session {session_id!r} not found")
async def ensure_schedule(s: Services, schedule_id: str) -> ActorRef:
    """The schedule's actor, started from its record if it is not running.

    Raises:
        NotFound: no such schedule.
        ActorDead: the schedules supervisor is restarting.
    """
    return await _running(s, "/schedules", schedule_id, lambda: s.schedule_spec(schedule_id),
                          f"schedule {schedule_id!r} not found")


def registry(s: Services) -> ActorRef:
    return s.system.resolve("/registry")


def announce(s: Services, specs: tuple[Any, ...], *, front: bool = False) -> None:
    """Queue runnable slots at the registry (`front`: ahead, they were taken back)."""
    if specs:
        # A restarting registry loses nothing: recovery re-announces every queued slot.
        tell_fixed(s, "/registry", ReturnSpecs(specs) if front else Announce(specs))


def withdraw(s: Services, run_id: str, slots: tuple[tuple[str, int | None], ...] | None) -> None:
    tell_fixed(s, "/registry", WithdrawSlots(run_id, slots))  # an offer of a withdrawn slot fails


def end_lease(s: Services, lease_id: str, reason: str) -> None:
    tell(s, f"/leases/{lease_id}", EndLease(reason))  # its record says so; a restart reads it


def lease_alive(s: Services, lease_id: str) -> bool:
    ref = s.system.find(f"/leases/{lease_id}")
    return ref is not None and bool(ref.alive)


def start_lease(s: Services, record: Any, *, fresh: bool = True) -> None:
    """Start the actor of a lease: `fresh` for a new offer, else rebuilt from storage."""
    try:
        # A new lease's actor is handed its record: its on_start loads nothing,
        # so nobody waits for the startup handshake.
        leases = s.fixed_refs.get("/leases") or fixed(s, "/leases")  # `fixed`, cached
        if type(leases) is not SupervisorRef and not isinstance(leases, SupervisorRef):
            leases = s.system.supervisor("/leases")
        leases.start_child_nowait(s.lease_spec(record, fresh))
    except ChildExists:
        pass
    except (ActorDead, ActorNotFound):
        # /leases is restarting (a /leases or /registry kill): recovery runs after
        # it comes back and resyncs every active run, which starts the actors of
        # their live leases. Crashing the run here instead made it fail its
        # restarts in a tight loop until /runs escalated.
        pass


def defer_expiry(s: Services, due_ms: int) -> bool:
    """Leave a fresh lease's expiry timer unarmed: True when the timer actor will sweep
    the live leases by `due_ms` (lease.py "lazy expiry"), False when the lease must
    arm its own (the timer actor is not there to ask).

    Only a lease due no sooner than the sweep already asked for costs nothing;
    the one before it (or one due sooner) asks for the sweep.
    """
    at = s.lease_sweep_at
    if at is not None and due_ms >= at:
        return True
    try:
        ref = s.fixed_refs.get("/timers") or fixed(s, "/timers")
        ref.tell_nowait(LeasesDueBy(due_ms))
    except _GONE:
        return False
    s.lease_sweep_at = due_ms
    return True


async def sweep_leases(s: Services) -> None:
    """Tell every live lease of this process `Due`: each checks its expiry and arms
    its own timer for the next deadline (the timer actor's lease sweep).

    The sweep asked for is cleared first, so a lease starting meanwhile asks
    for the next one. A lease with no actor now is skipped: a restarted one
    arms its own timer on start.
    """
    s.lease_sweep_at = None
    find = s.system.find
    for lease_id in list(s.lease_touched):
        ref = find(f"/leases/{lease_id}")
        if ref is None:
            continue
        try:
            try:
                ref.tell_nowait(Due())
            except anyio.WouldBlock:  # its mailbox is full: wait for room, never drop it
                await ref.tell(Due())
        except (ActorDead, ActorNotFound):
            pass


async def timers_changed(s: Services, due_ms: int) -> None:
    """A passivated run's deadline is on record: the timer actor may need to wake sooner.

    Only once it is committed: a sweep between the tell and the commit would
    not see the entry and would sleep past it. A restarting timer actor rescans
    the table when it starts, so a tell lost to it costs nothing.
    """
    try:
        ref = s.system.resolve("/timers")
        try:
            ref.tell_nowait(TimerIndexChanged(due_ms))
        except anyio.WouldBlock:
            await ref.tell(TimerIndexChanged(due_ms))
    except (ActorDead, ActorNotFound):
        pass


async def activate_run(s: Services, run_id: str, initial: Any = None, *,
                       expect_message: bool = False) -> ActorRef:
    """The run's actor, started if it is not running (from its record, or `initial`).

    Raises:
        NotFound: no such run.
        ActorDead: a supervisor it needs is restarting (callers retry).
    """
    return await _running(s, "/runs", run_id,
                          lambda: s.run_spec(run_id, initial, expect_message),
                          f"run {run_id!r} not found")


async def wake_run(s: Services, run_id: str, message: Any = None, *,
                   retries: int = RETRIES) -> None:
    """Make sure the run has an actor; then tell it `message` (if any).

    Raises:
        Unavailable: its actor did not come up within the retries.
    """
    for attempt in range(retries):
        try:
            ref = await activate_run(s, run_id, expect_message=message is not None)
            if message is None:
                return
            try:
                ref.tell_nowait(message)
            except anyio.WouldBlock:
                await ref.tell(message)
            return
        except ActorDead:  # the run actor, or the runs supervisor, is restarting
            await anyio.sleep(0.001 * attempt)
    raise Unavailable(f"run {run_id} did not come up to take {type(message).__name__}")


async def ask_run(s: Services, run_id: str, message: Any, *, quiet: bool = False) -> Any:
    """Ask the run's actor (activating a passivated run), retrying across restarts.

    Raises:
        Unavailable: its actor did not come up within the retries.
        Fenced: unless `quiet` (then None).
        StepdError: the run's refusal.
    """
    path = f"/runs/{run_id}"
    for attempt in range(RETRIES):
        try:
            ref = s.system.find(path)  # an active run: no activation calls in between
            if ref is None or not ref.alive:
                ref = await activate_run(s, run_id, expect_message=True)
            return await ref.ask(message)
        except ActorDead:  # the run actor, or the runs supervisor, is restarting
            await anyio.sleep(0.001 * attempt)
        except Fenced:
            if quiet:
                return None
            raise
    raise Unavailable(f"run {run_id} did not come up to take {type(message).__name__}")


def active_runs(s: Services) -> int:
    """How many run actors are alive (passivated runs have none)."""
    try:
        return s.system.supervisor("/runs").count_children()
    except (ActorNotFound, ActorDead):
        return 0


def supervisors_alive(s: Services) -> bool:
    try:
        return bool(s.system.resolve("/runs").alive and s.system.resolve("/leases").alive)
    except ActorNotFound:
        return False


class DueTimer:
    """An actor's ``"due"`` timer as last armed, so that arming it for the deadline it is
    armed for already costs nothing (a session re-arms after every message, a run
    after every commit, and the deadline rarely moves). `fired()` when it fires."""

    __slots__ = ("_armed",)

    def __init__(self) -> None:
        self._armed: int | None | object = _NEVER

    def arm(self, s: Services, actor: Actor, due_ms: int | None) -> None:
        if due_ms != self._armed:
            self._armed = due_ms
            arm_due(s, actor, due_ms)

    def fired(self) -> None:
        self._armed = _NEVER


_NEVER = object()


def arm_at(s: Services, actor: Actor, name: str, due_ms: int, message: Any) -> None:
    """Arm `actor`'s timer `name` to deliver `message` at the wall-clock deadline
    `due_ms` (`arm_due` for any timer)."""
    clock = s.clock
    at = clock.now()
    delay = due_ms - clock.time_ms()
    actor.arm_timer(name, at + delay / 1000.0 if delay > 0 else at, message)


def arm_due(s: Services, actor: Actor, due_ms: int | None) -> None:
    """Arm `actor`'s ``"due"`` timer for the wall-clock deadline `due_ms` (the
    machines speak milliseconds; actor timers the loop's clock), or cancel it
    when there is none. A deadline already past fires at once."""
    if due_ms is None:
        actor.cancel_timer("due")
        return
    clock = s.clock
    at = clock.now()
    delay = due_ms - clock.time_ms()
    actor.arm_timer("due", at + delay / 1000.0 if delay > 0 else at, Due())
