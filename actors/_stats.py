"""Introspection records: per-actor statistics and the supervision tree.

Both are frozen, and `to_dict()` gives plain JSON-ready dicts: they are the
payload of ``GET /v1/api/actors`` (PROTOCOL.md, "the supervision tree: path,
kind, restarts").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["ActorStatistics", "ActorTree"]


@dataclass(frozen=True, slots=True)
class ActorStatistics:
    """A snapshot of one actor, taken without awaiting.

    Attributes:
        path: where the actor is registered.
        kind: the actor class's `kind` attribute, or its class name.
        state: ``"starting"`` (in `on_start`), ``"running"``, ``"stopping"``
            (stop requested, or in `on_stop`), or ``"dead"`` (between an exit
            and its restart, or gone for good).
        restarts: how many times its supervisor restarted it at this path
            (reset when the supervisor itself restarts).
        mailbox_depth: messages waiting in its mailbox.
        mailbox_size: the mailbox's capacity.
        timers: timers armed and not yet delivered or cancelled.
        started_at: wall-clock epoch milliseconds (from the system's clock)
            when the current incarnation finished `on_start`, or `None`.
    """

    path: str
    kind: str
    state: str
    restarts: int
    mailbox_depth: int
    mailbox_size: int
    timers: int
    started_at: int | None

    def to_dict(self) -> dict[str, Any]:
        """Return the record as a JSON-ready dict."""
        return {
            "path": self.path,
            "kind": self.kind,
            "state": self.state,
            "restarts": self.restarts,
            "mailbox_depth": self.mailbox_depth,
            "mailbox_size": self.mailbox_size,
            "timers": self.timers,
            "started_at": self.started_at,
        }


@dataclass(frozen=True, slots=True)
class ActorTree:
    """One node of the supervision tree: an actor and, for a supervisor, its children.

    Attributes:
        statistics: the actor's `ActorStatistics`.
        children: its children in start order (empty for workers).
    """

    statistics: ActorStatistics
    children: tuple[ActorTree, ...] = ()

    @property
    def path(self) -> str:
        return self.statistics.path

    def find(self, path: str) -> ActorTree | None:
        """Return the node at `path` in this subtree, or `None`."""
        if self.statistics.path == path:
            return self
        for child in self.children:
            found = child.find(path)
            if found is not None:
                return found
        return None

    def walk(self) -> list[ActorTree]:
        """Return this node and all its descendants, depth first, in start order."""
        nodes = [self]
        for child in self.children:
            nodes.extend(child.walk())
        return nodes

    def to_dict(self) -> dict[str, Any]:
        """Return the subtree as nested JSON-ready dicts (``children`` key)."""
        data = self.statistics.to_dict()
        data["children"] = [child.to_dict() for child in self.children]
        return data
