"""The worker's side of worker sessions ("affinity sessions", AFFINITY.md "Worker sessions").

A worker that holds sessions declares them at register: ``resources`` (what
its machine offers, e.g. ``{"gpu": "a100"}``) and ``max_sessions`` (how many
it holds at once), sent as the ``sessions`` capability and its manifest entry
(protocol 1.20). The daemon then creates sessions on it; a lease of a
session's step carries ``"session": {"session_id", "name", "generation",
"lease_ms"}``. Before the first step of each acquisition (a new session, or
one taken over from a lost holder: a new ``generation``) the worker calls its
``on_session_acquired`` hook, so it restores its local resources first: a
session id never makes process memory durable. While it holds a session it
renews it every third of ``lease_ms`` (renewing never extends the session's
TTL), and a graceful stop closes every session it holds.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

import anyio
import anyio.abc
import anyio.to_thread

from stepd._errors import Conflict, Invalid, NotFound, StepdError, Unavailable
from stepd.channels import Lost

if TYPE_CHECKING:
    from stepd.channels import Channel

__all__ = ["SessionAcquired", "WorkSessions"]

log = logging.getLogger("stepd.worker")

CLOSE_TIMEOUT_S: Final = 5.0


@dataclass(frozen=True, slots=True)
class SessionAcquired:
    """What `on_session_acquired` is called with.

    Attributes:
        session_id: ``ws_<run id>.<name>``.
        name: the definition's session name.
        run_id: the run it belongs to.
        generation: 1 for the first holder; more: taken over from a lost holder.
    """

    session_id: str
    name: str
    run_id: str
    generation: int

    @property
    def reacquired(self) -> bool:
        return self.generation > 1


@dataclass(eq=False, slots=True)
class _Held:
    generation: int
    lease_ms: int
    scope: anyio.CancelScope


class WorkSessions:
    """Mixed into `stepd.Worker`."""

    name: str
    worker_id: str | None
    _channel: Channel | None
    _tg: anyio.abc.TaskGroup | None

    def _init_work_sessions(self, resources: Mapping[str, Any] | None, max_sessions: int,
                            on_session_acquired: Callable[[SessionAcquired], Any] | None) -> None:
        if isinstance(max_sessions, bool) or not isinstance(max_sessions, int) \
                or not 0 <= max_sessions <= 10_000:
            raise Invalid("must be an integer from 0 to 10000", field="max_sessions")
        if resources is not None and not isinstance(resources, Mapping):
            raise Invalid("must be a mapping of resource names to values", field="resources")
        self.resources = dict(resources or {})
        self.max_sessions = max_sessions
        self._session_hook = on_session_acquired
        self._held_sessions: dict[str, _Held] = {}
        self._acquiring: anyio.Lock | None = None  # made on the worker's loop, when needed

    def on_session_acquired(self, fn: Callable[[SessionAcquired], Any]
                            ) -> Callable[[SessionAcquired], Any]:
        """Register the hook called before the first step of each session this worker
        acquires (usable as a decorator). Sync hooks run in a thread; async ones on
        the loop. Raising fails that step (class ``fatal``; `stepd.Retryable`: retried)."""
        self._session_hook = fn
        return fn

    @property
    def sessions_held(self) -> dict[str, int]:
        """Session id -> generation, for the sessions this worker holds now."""
        return {sid: h.generation for sid, h in self._held_sessions.items()}

    def _sessions_manifest(self) -> dict[str, Any] | None:
        """The details of the register manifest's ``sessions`` entry (`stepd._manifest`),
        or None: this worker holds no sessions and declares them rejected."""
        if self.max_sessions <= 0:
            return None
        return {"resources": dict(self.resources), "max_sessions": self.max_sessions}

    async def _enter_session(self, lease: dict[str, Any]) -> tuple[Any, ...] | None:
        """Before a session step's body: run the hook once per acquisition. Returns None
        (go on) or the step's error outcome."""
        info = lease.get("session")
        if not isinstance(info, dict):
            return None
        sid, gen = info["session_id"], int(info["generation"])
        if self._acquiring is None:
            self._acquiring = anyio.Lock()
        async with self._acquiring:  # two items of one session: one hook call
            held = self._held_sessions.get(sid)
            if held is not None and held.generation == gen:
                return None
            if held is not None:
                held.scope.cancel()
            hook = self._session_hook
            if hook is not None:
                event = SessionAcquired(sid, info["name"], lease["run_id"], gen)
                try:
                    if inspect.iscoroutinefunction(hook):
                        await hook(event)
                    else:
                        await anyio.to_thread.run_sync(hook, event)
                except Exception as exc:
                    from stepd._errors import Retryable

                    log.warning("worker %s: on_session_acquired(%s) failed", self.name, sid,
                                exc_info=True)
                    cls = "retryable" if isinstance(exc, Retryable) else "fatal"
                    return ("error", cls, f"on_session_acquired: {type(exc).__name__}: {exc}")
            held = _Held(gen, int(info.get("lease_ms") or 30_000), anyio.CancelScope())
            self._held_sessions[sid] = held
            if self._tg is not None:
                self._tg.start_soon(self._renew_loop, sid, held, name=f"stepd session {sid}")
        return None

    async def _renew_loop(self, sid: str, held: _Held) -> None:
        """Renew every third of ``lease_ms`` while held; a refusal means it is gone."""
        with held.scope:
            interval = max(0.01, held.lease_ms / 3000)
            while True:
                await anyio.sleep(interval)
                channel = self._channel
                if channel is None:
                    continue  # reconnecting: the next renew goes on the new connection
                try:
                    await channel.session_call("session_renew", sid,
                                               {"worker_id": self.worker_id})
                except (Conflict, NotFound, Invalid) as exc:
                    log.info("worker %s: session %s is no longer ours (%s)", self.name, sid, exc)
                    if self._held_sessions.get(sid) is held:
                        del self._held_sessions[sid]
                    return
                except (Lost, Unavailable, StepdError):
                    continue

    async def _close_sessions(self) -> None:
        """A graceful stop closes the sessions this worker holds (AFFINITY.md)."""
        held, self._held_sessions = self._held_sessions, {}
        channel = self._channel
        for sid, h in held.items():
            h.scope.cancel()
            if channel is None:
                continue
            with anyio.move_on_after(CLOSE_TIMEOUT_S):
                try:
                    await channel.session_call("session_close", sid,
                                               {"worker_id": self.worker_id})
                except (StepdError, Lost) as exc:
                    log.info("worker %s: closing session %s: %s", self.name, sid, exc)
