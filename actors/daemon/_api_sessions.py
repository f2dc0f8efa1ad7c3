"""The daemon API, worker sessions' side: renew and close (AFFINITY.md "Worker sessions";
docs/affinity.md "Worker sessions" fixes the wire operations).

Create and use travel with the leases: the daemon creates a session when a run
first reaches one of its steps, and a lease of such a step carries
``"session": {"session_id", "name", "generation", "lease_ms"}``. The holder
renews (`session_renew`) and, stopping gracefully, closes (`session_close`).
"""

from __future__ import annotations

from typing import Any

import anyio

from stepd.actors import ActorDead, ActorNotFound
from stepd.sansio.capabilities import WorkerCapabilities, check_completion
from stepd.sansio.errors import Fenced, NotFound, Unavailable

from . import peers, store
from ._api_base import ApiBase
from .messages import ReleaseSession, RenewSession

__all__ = ["SessionOps"]

_OPEN = ("pending", "held")


class SessionOps(ApiBase):
    """`Daemon`'s worker-session operations."""

    async def session_renew(self, session_id: str, worker_id: str) -> dict[str, Any]:
        """Extend the holder's authority by the session's ``lease_ms`` (never its TTL).

        Returns ``{"session_id", "lease_ms", "ttl_remaining_ms", "generation"}``.

        Raises:
            NotFound: no such session, or the worker is unknown.
            Invalid: the worker did not declare the ``sessions`` capability.
            Fenced: the worker does not hold it (lost, moved, closed, expired).
        """
        return await self._session_ask(session_id, worker_id, RenewSession(worker_id))

    async def session_close(self, session_id: str, worker_id: str) -> dict[str, Any]:
        """The holder gives the session up (a graceful stop): its slot is freed at once and
        the session moves on as after a holder loss (its ``reacquire`` policy).

        Raises:
            NotFound, Invalid, Fenced: as `session_renew`.
        """
        return await self._session_ask(session_id, worker_id, ReleaseSession(worker_id))

    async def _session_ask(self, session_id: str, worker_id: str, message: Any) -> dict[str, Any]:
        info = self.storage.get(store.WORKERS, worker_id)
        if not isinstance(info, dict):
            raise NotFound(f"worker {worker_id!r} is not registered")
        # The shared capability gate (version, flat capability, manifest), as for a
        # completion that names a session: a 400 naming `session_id`.
        check_completion(WorkerCapabilities.from_record(info), {"session_id": session_id})
        raw = self.storage.get(store.WORK_SESSIONS, session_id)
        if not isinstance(raw, dict):
            raise NotFound(f"worker session {session_id!r} not found")
        if raw["status"] not in _OPEN:
            raise Fenced(f"worker session {session_id} is {raw['status']}")
        for attempt in range(peers.RETRIES):
            try:
                ref = await peers.ensure_work_session(self.services, session_id)
                return dict(await ref.ask(message))
            except (ActorDead, ActorNotFound):
                await anyio.sleep(0.001 * (attempt + 1))  # being restarted
        raise Unavailable(f"worker session {session_id} is being recovered; retry")
