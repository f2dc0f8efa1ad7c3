"""The schedule and prune calls of `stepd.Client` (docs/schedules.md, docs/storage.md
"Retention"): call builders, sans I/O, and the client methods over them.

Kept apart from `stepd.client` so the run client stays about runs; `Client`
mixes `ScheduleCalls` in.
"""

from __future__ import annotations

from typing import Any, Protocol
from urllib.parse import quote

from stepd._wire import Call
from stepd.sansio.durations import Duration

__all__ = ["ScheduleCalls"]


def _seg(value: str) -> str:
    return quote(value, safe="")


class _Backend(Protocol):
    def send(self, call: Call) -> dict[str, Any]: ...


class ScheduleCalls:
    """`stepd.Client`'s schedule operations and ``prune_runs``."""

    _backend: _Backend

    def create_schedule(self, workflow: str, cron: str, *, input: Any = None,
                        timezone: str = "UTC", overlap: str = "skip",
                        catchup_window: Duration = 0, version: str | None = None) -> dict[str, Any]:
        """Create a schedule (``POST /v1/api/schedules``): a run of `workflow` per fire.

        Args:
            cron: 5 fields (or 6, seconds first), in `timezone` (IANA).
            overlap: ``skip``, ``buffer_one`` or ``allow`` (while the previous
                fire's run still runs).
            catchup_window: after downtime, fires missed within this are started.

        Raises:
            Invalid: naming the field (``cron``, ``timezone``, ``workflow``...).
        """
        body: dict[str, Any] = {"cron": cron, "workflow": workflow, "input": input,
                                "timezone": timezone, "overlap": overlap,
                                "catchup_window_ms": catchup_window}
        if version is not None:
            body["version"] = version
        return self._backend.send(Call("create_schedule", "POST", "/v1/api/schedules", body=body))

    def schedules(self, *, limit: int = 1000) -> list[dict[str, Any]]:
        """Every schedule, oldest first (pages of `limit`)."""
        out: list[dict[str, Any]] = []
        cursor: str | None = None
        while True:
            page = self._backend.send(Call("list_schedules", "GET", "/v1/api/schedules",
                                           query={"limit": limit, "cursor": cursor},
                                           idempotent=True))
            out += page["schedules"]
            cursor = page.get("next_cursor")
            if not cursor:
                return out

    def schedule(self, schedule_id: str) -> dict[str, Any]:
        """One schedule. Raises: NotFound."""
        return self._backend.send(Call("get_schedule", "GET",
                                       f"/v1/api/schedules/{_seg(schedule_id)}",
                                       target=schedule_id, idempotent=True))

    def pause_schedule(self, schedule_id: str) -> dict[str, Any]:
        """Stop firing until resumed. Raises: NotFound."""
        return self._backend.send(Call("pause_schedule", "POST",
                                       f"/v1/api/schedules/{_seg(schedule_id)}/pause",
                                       target=schedule_id, body={}, idempotent=True))

    def resume_schedule(self, schedule_id: str) -> dict[str, Any]:
        """Fire again from the next fire after now. Raises: NotFound."""
        return self._backend.send(Call("resume_schedule", "POST",
                                       f"/v1/api/schedules/{_seg(schedule_id)}/resume",
                                       target=schedule_id, body={}, idempotent=True))

    def delete_schedule(self, schedule_id: str) -> None:
        """Delete it; its runs stay. Raises: NotFound."""
        self._backend.send(Call("delete_schedule", "DELETE",
                                f"/v1/api/schedules/{_seg(schedule_id)}", target=schedule_id))

    def prune_runs(self, before: int | str, *, idempotency_keys_before: int | str | None = None,
                   limit: int | None = None) -> dict[str, Any]:
        """Delete finished runs that ended before `before` (admin scope).

        Args:
            before: epoch milliseconds or an ISO-8601 time.

        Returns:
            ``{"deleted": n, "more": bool}`` (call again while ``more``).
        """
        body: dict[str, Any] = {"before": before}
        if idempotency_keys_before is not None:
            body["idempotency_keys_before"] = idempotency_keys_before
        if limit is not None:
            body["limit"] = limit
        return self._backend.send(Call("prune_runs", "POST", "/v1/api/runs/prune", body=body,
                                       idempotent=True))
