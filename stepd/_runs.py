"""Typed views of what the runs API answers: `RunStatus`, `RunSummary` and their parts.

Each is a frozen, slotted dataclass built from the JSON the daemon sends
(WORKFLOWS.md "Run status"); ``raw`` keeps that JSON whole, so a key a newer
daemon adds is never lost. Timestamps become aware `datetime`\\ s (UTC).
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

__all__ = ["TERMINAL", "Budget", "RunError", "RunStatus", "RunSummary", "Usage"]

TERMINAL = frozenset({"completed", "failed", "cancelled", "timed_out"})
"""The statuses a run never leaves."""


def _time(value: Any) -> datetime.datetime | None:
    if not isinstance(value, str):
        return None
    try:
        return datetime.datetime.fromisoformat(value)
    except ValueError:
        return None


def _frozen(value: Any) -> Mapping[str, Any]:
    return MappingProxyType(dict(value)) if isinstance(value, dict) else MappingProxyType({})


@dataclass(frozen=True, slots=True)
class Usage:
    """Tokens a run (or step) spent, and their price from the daemon's price book."""

    input_tokens: int = 0
    output_tokens: int = 0
    cost_usd: float = 0.0

    @classmethod
    def from_json(cls, raw: Any) -> Usage:
        r = raw if isinstance(raw, dict) else {}
        return cls(int(r.get("input_tokens") or 0), int(r.get("output_tokens") or 0),
                   float(r.get("cost_usd") or 0.0))


@dataclass(frozen=True, slots=True)
class Budget:
    """The run's budget limits (None: no limit) and what it has used so far."""

    limits: Mapping[str, int | None] = field(default_factory=lambda: MappingProxyType({}))
    usage: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))

    @classmethod
    def from_json(cls, raw: Any) -> Budget:
        r = raw if isinstance(raw, dict) else {}
        return cls(_frozen(r.get("limits")), _frozen(r.get("usage")))


@dataclass(frozen=True, slots=True)
class RunError:
    """Why a run failed: ``reason`` (``step_failed``, ``budget_exceeded``, ``lease_lost``,
    ``wait_timeout``, ``template``, ``cancelled``, ``deadline``), a message, the step."""

    reason: str
    message: str
    step_id: str | None = None

    @classmethod
    def from_json(cls, raw: Any) -> RunError | None:
        if not isinstance(raw, dict):
            return None
        return cls(str(raw.get("reason") or ""), str(raw.get("message") or ""), raw.get("step_id"))


@dataclass(frozen=True, slots=True)
class RunStatus:
    """A run's status, every field of WORKFLOWS.md "Run status".

    Attributes:
        run_id, workflow: the run and its workflow name.
        status: ``running``, ``waiting``, ``sleeping``, ``completed``, ``failed``,
            ``cancelled`` or ``timed_out``.
        definition_version, definition_hash: what the run executes (pinned at start).
        idempotency_key, correlation, input: as given at start.
        state: the run's public state.
        result: the run's result once completed (the last step's output), else None.
        error: why it failed, or None.
        current_steps: the step(s) running now.
        waiting_for: the signal a ``wait`` step waits for, or None.
        budget: limits and usage.
        usage: tokens and cost, summed over the run's steps.
        created_at, updated_at, deadline_at: times (UTC), deadline_at None without one.
        parent_run_id: the run that started this one (``start_workflows``), or None.
        raw: the JSON the daemon answered, whole.
        forked_from: ``{"run_id", "step_id"}`` when this run is a fork, else None.
        forks: the runs forked from this one, ``({"run_id", "step_id"}, ...)``.
    """

    run_id: str
    workflow: str
    status: str
    definition_version: str | None
    definition_hash: str
    idempotency_key: str | None
    correlation: Any
    input: Any
    state: Mapping[str, Any]
    result: Any
    error: RunError | None
    current_steps: tuple[str, ...]
    waiting_for: str | None
    budget: Budget
    usage: Usage
    created_at: datetime.datetime | None
    updated_at: datetime.datetime | None
    deadline_at: datetime.datetime | None
    parent_run_id: str | None
    raw: Mapping[str, Any] = field(repr=False, compare=False)
    forked_from: Mapping[str, Any] | None = None
    forks: tuple[Mapping[str, Any], ...] = ()

    @property
    def done(self) -> bool:
        """True once the run is over (completed, failed, cancelled or timed out)."""
        return self.status in TERMINAL

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> RunStatus:
        return cls(
            run_id=raw["run_id"],
            workflow=raw.get("workflow", ""),
            status=raw["status"],
            definition_version=raw.get("definition_version"),
            definition_hash=raw.get("definition_hash", ""),
            idempotency_key=raw.get("idempotency_key"),
            correlation=raw.get("correlation"),
            input=raw.get("input"),
            state=_frozen(raw.get("state")),
            result=raw.get("result"),
            error=RunError.from_json(raw.get("error")),
            current_steps=tuple(raw.get("current_steps") or ()),
            waiting_for=raw.get("waiting_for"),
            budget=Budget.from_json(raw.get("budget")),
            usage=Usage.from_json(raw.get("usage")),
            created_at=_time(raw.get("created_at")),
            updated_at=_time(raw.get("updated_at")),
            deadline_at=_time(raw.get("deadline_at")),
            parent_run_id=raw.get("parent_run_id"),
            raw=MappingProxyType(raw),
            forked_from=(_frozen(raw["forked_from"]) if isinstance(raw.get("forked_from"), dict)
                         else None),
            forks=tuple(_frozen(f) for f in raw.get("forks") or () if isinstance(f, dict)),
        )


@dataclass(frozen=True, slots=True)
class RunSummary:
    """One run of a `list_runs` page."""

    run_id: str
    workflow: str
    status: str
    definition_version: str | None
    created_at: datetime.datetime | None
    updated_at: datetime.datetime | None
    parent_run_id: str | None
    raw: Mapping[str, Any] = field(repr=False, compare=False)

    @property
    def done(self) -> bool:
        return self.status in TERMINAL

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> RunSummary:
        return cls(
            run_id=raw["run_id"],
            workflow=raw.get("workflow", ""),
            status=raw["status"],
            definition_version=raw.get("definition_version"),
            created_at=_time(raw.get("created_at")),
            updated_at=_time(raw.get("updated_at")),
            parent_run_id=raw.get("parent_run_id"),
            raw=MappingProxyType(raw),
        )
