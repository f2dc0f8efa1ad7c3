"""The daemon: its API (`api.Daemon`) over its actors (run, lease, session, registry, timers,
recovery), the services they stand on, and the tables they write.

Built only on the generic runtime's public API (`stepd.actors`), the pure
machines (`stepd.sansio`) and storage (`stepd.storage`). docs/architecture.md
draws the tree and a step's path through it.
"""

from .api import PROTOCOL_VERSION, Connection, Daemon
from .run import SignalRefused
from .services import DaemonConfig

__all__ = ["PROTOCOL_VERSION", "Connection", "Daemon", "DaemonConfig", "SignalRefused"]
