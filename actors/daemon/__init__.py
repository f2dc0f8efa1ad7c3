"""The daemon's actors (run, lease, registry, timers, recovery) and the engine that wires them.

Built only on the generic runtime's public API (`stepd.actors`), the pure
engine (`stepd.sansio`) and storage (`stepd.storage`).
"""

from .engine import PROTOCOL_VERSION, Engine, EngineConfig
from .run import SignalRefused

__all__ = ["PROTOCOL_VERSION", "Engine", "EngineConfig", "SignalRefused"]
