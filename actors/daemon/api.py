"""The daemon's API: the protocol's operations with Python types, over the actors.

`Daemon.open(path)` opens the data directory, loads the definition catalog and
starts the supervision tree (`tree`); the transports (HTTP, WebSocket, in
process) and the protocol handler above them call the methods here, and
nothing below calls back up: the actors talk to each other by messages
(`peers`), stand on `Services`, and hand the API answers.

One method per operation of PROTOCOL.md: `register_worker`, `attach` (a push
connection: WebSocket or in process), `claim` (HTTP long-poll), `lease_call`
(started / heartbeat / complete / fail), `start_run`, `status`, `journal`,
`export`, `list_runs`, `result`, `signal`, `cancel`, `retry`, `fork`, `workers`,
`definitions`, `actors`, `kill`. Mutations take the audit entry of the call
(`audit.AuditEntry`) and write it in their own transaction: a change is on
record if and only if its entry is.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from stepd.actors import (
    ActorDead,
    ActorNotFound,
    ActorSystem,
    Clock,
    Strategy,
    SystemClock,
)
from stepd.sansio.errors import Invalid, NotFound, Unavailable
from stepd.storage import Storage

from . import listing, peers, store
from ._api_retention import RetentionOps
from ._api_runs import RunOps
from ._api_schedules import ScheduleOps
from ._api_sessions import SessionOps
from ._api_workers import Connection, WorkerOps, _load_workers
from .catalog import Catalog
from .messages import (
    RegistryStats,
)
from .registry import Stats
from .services import DaemonConfig, Services, TraceSink
from .tree import build_tree
from .workers import PROTOCOL_VERSION

__all__ = ["PROTOCOL_VERSION", "Connection", "Daemon"]


_TERMINAL = frozenset({"completed", "failed", "cancelled", "timed_out"})
_CALL_TOKENS = itertools.count(1)
_CLAIMS = itertools.count(1)
_CONNECTIONS = itertools.count(1)


class Daemon(WorkerOps, RunOps, SessionOps, ScheduleOps, RetentionOps):
    """The daemon: storage, catalog, the actor tree, and the operations. Open with `Daemon.open`."""

    # ------------------------------------------------------------------ lifecycle

    @classmethod
    @asynccontextmanager
    async def open(cls, path: str, *, config: DaemonConfig | None = None,
                   clock: Clock | None = None,
                   trace: TraceSink | None = None) -> AsyncIterator[Daemon]:
        """Open the data directory and start the actor tree; stop both on exit.

        Args:
            trace: where committed run writes go to be exported as spans
                (`stepd.otel.SpanExport`); None: no export, no work per step.

        Raises:
            Invalid: a config value is out of range.
            storage errors: the directory cannot be opened (in use, newer schema).
        """
        config = config or DaemonConfig()
        config.check()
        clock = clock or SystemClock()
        async with Storage.open(
            path, sync=config.sync, extra_tables=store.EXTRA_TABLES,
            map_size=config.map_size, max_map_size=config.max_map_size,
            commit_on_loop=config.commit_on_loop, write_ahead_log=config.write_ahead_log,
        ) as storage:
            catalog = Catalog()
            storage.read(catalog.load_txn)
            await _index_old_runs(storage)
            services = Services(storage, catalog, config, clock, trace=trace)
            # The tree's children reach `services.system` only once they run.
            system = services.system = ActorSystem(
                clock=clock, root=build_tree(services, lambda: _load_workers(storage)))
            services.stats.status_counts = storage.read(listing.count_by_status_txn)
            daemon = cls(services)
            async with system:
                try:
                    yield daemon
                finally:
                    services.serving = False

    @property
    def closing(self) -> bool:
        return not self.services.serving

    def begin_drain(self) -> None:
        """Shutdown: hand out no more leases (claims answer empty, credit is ignored)."""
        self.services.serving = False

    # ------------------------------------------------------------------ actors

    def actors(self) -> dict[str, Any]:
        return self.system.tree().to_dict()

    async def kill(self, path: str) -> list[str]:
        """Kill one actor (fault injection); its supervisor restarts it from storage.

        Returns:
            The paths its supervisor restarts because of this kill, the killed
            actor first: under the root's `rest_for_one`, killing ``/registry``
            restarts every later sibling with it.

        Raises:
            NotFound: no actor at that path (the message says why when it can:
                a passivated run has no actor until something wakes it).
            Invalid: the path is the root.
        """
        if not isinstance(path, str) or not path.startswith("/"):
            raise Invalid("must be an actor path such as /runs/r_...", field="path")
        restarted = self._restarted_with(path)
        try:
            await self.system.kill(path)
        except ActorNotFound as exc:
            raise NotFound(self._no_actor(path)) from exc
        except ActorDead as exc:
            raise NotFound(f"no actor is running at {path!r} (it is being restarted)") from exc
        except ValueError as exc:
            raise Invalid(str(exc), field="path") from exc
        return restarted

    def _restarted_with(self, path: str) -> list[str]:
        """What the kill of `path` restarts, by its supervisor's strategy (static siblings)."""
        parent, _, name = path.rpartition("/")
        try:
            sup = self.system.supervisor(parent or "/")._supervisor()
        except (ActorNotFound, ActorDead, TypeError):
            return [path]
        child_ids = [cid for cid, _ in sup.which_children()]
        if name not in child_ids or sup.strategy is Strategy.ONE_FOR_ONE:
            return [path]
        group = (child_ids if sup.strategy is Strategy.ONE_FOR_ALL
                 else child_ids[child_ids.index(name):])
        return [path] + [f"{parent}/{cid}" for cid in group if cid != name]

    def _no_actor(self, path: str) -> str:
        """Why nothing answers at `path`, in words an operator can act on."""
        kind, _, ident = path.strip("/").partition("/")
        if kind == "runs" and ident and "/" not in ident:
            raw = self.storage.get(store.RUNS, ident)
            if isinstance(raw, dict):
                status = raw.get("status")
                if status in _TERMINAL:
                    return f"no actor at {path!r}: run {ident} is {status}; it has no actor"
                return (f"no actor at {path!r}: run {ident} is {status} and passivated (asleep, "
                        "no actor in memory); its timer, a signal or a child starts it again, "
                        "and then it can be killed")
            return f"no actor at {path!r}: there is no run {ident!r}"
        if kind == "leases" and ident and "/" not in ident:
            raw = self.storage.get(store.LEASES, ident)
            if isinstance(raw, dict):
                return (f"no actor at {path!r}: lease {ident} is {raw.get('status')}; only a live "
                        "lease has an actor")
            return f"no actor at {path!r}: there is no lease {ident!r}"
        return f"no actor at {path!r}"

    async def registry_stats(self) -> Stats:
        try:
            return await peers.registry(self.services).ask(RegistryStats())  # type: ignore[no-any-return]
        except (ActorDead, ActorNotFound) as exc:
            raise Unavailable("the registry is restarting") from exc

    def live_leases(self) -> int:
        try:
            return self.system.supervisor("/leases").count_children()
        except (ActorDead, ActorNotFound):
            return 0

    def connected_workers(self) -> int:
        """Worker connection sessions (``/sessions/w_...``; not the worker sessions of runs,
        ``/sessions/ws_...``, docs/affinity.md)."""
        try:
            return sum(1 for name, _ in self.system.supervisor("/sessions").which_children()
                       if not name.startswith("ws_"))
        except (ActorDead, ActorNotFound):
            return 0


async def _index_old_runs(storage: Storage) -> None:
    """Give the runs of a data directory from before the listing's indexes their
    entries, a slice per transaction (once: afterwards every run has its summary)."""
    if storage.read(lambda t: t.count(store.RUNS) == t.count(store.RUN_SUMMARIES)):
        return
    after: bytes | None = None
    while True:
        after = await storage.write(listing.rebuild_txn, after, 1000)
        if after is None:
            return
