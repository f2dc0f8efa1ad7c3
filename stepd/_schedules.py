"""The schedule and prune calls of `stepd.Client` and `stepd.AsyncClient` (docs/schedules.md,
docs/storage.md "Retention"): call builders, sans I/O, and the client methods over them.

Kept apart from `stepd.client` so the run clients stay about runs; `Client`
mixes `ScheduleCalls` in, `AsyncClient` mixes `AsyncScheduleCalls` in. Both
build every request with the same functions below, so the two clients cannot
drift apart: only the ``send`` (and the paging loop around it) differs.
"""

from __future__ import annotations

from typing import Any, Protocol
from urllib.parse import quote

from stepd._wire import Call
from stepd.sansio.durations import Duration

__all__ = ["AsyncScheduleCalls", "ScheduleCalls"]


def _seg(value: str) -> str:
    return quote(value, safe="")


# --------------------------------------------------------------------------- call builders


def create_schedule_call(workflow: str, cron: str, *, input: Any, timezone: str, overlap: str,
                         catchup_window: Duration, version: str | None) -> Call:
    body: dict[str, Any] = {"cron": cron, "workflow": workflow, "input": input,
                            "timezone": timezone, "overlap": overlap,
                            "catchup_window_ms": catchup_window}
    if version is not None:
        body["version"] = version
    return Call("create_schedule", "POST", "/v1/api/schedules", body=body)


def list_schedules_call(limit: int, cursor: str | None) -> Call:
    return Call("list_schedules", "GET", "/v1/api/schedules",
                query={"limit": limit, "cursor": cursor}, idempotent=True)


def get_schedule_call(schedule_id: str) -> Call:
    return Call("get_schedule", "GET", f"/v1/api/schedules/{_seg(schedule_id)}",
                target=schedule_id, idempotent=True)


def schedule_action_call(action: str, schedule_id: str) -> Call:
    """``pause`` or ``resume``: idempotent (pausing a paused schedule changes nothing)."""
    return Call(f"{action}_schedule", "POST",
                f"/v1/api/schedules/{_seg(schedule_id)}/{action}",
                target=schedule_id, body={}, idempotent=True)


def delete_schedule_call(schedule_id: str) -> Call:
    return Call("delete_schedule", "DELETE", f"/v1/api/schedules/{_seg(schedule_id)}",
                target=schedule_id)


def prune_runs_call(before: int | str, idempotency_keys_before: int | str | None,
                    limit: int | None) -> Call:
    body: dict[str, Any] = {"before": before}
    if idempotency_keys_before is not None:
        body["idempotency_keys_before"] = idempotency_keys_before
    if limit is not None:
        body["limit"] = limit
    return Call("prune_runs", "POST", "/v1/api/runs/prune", body=body, idempotent=True)


# --------------------------------------------------------------------------- the mixins


class _Backend(Protocol):
    def send(self, call: Call) -> dict[str, Any]: ...


class _AsyncBackend(Protocol):
    async def send(self, call: Call) -> dict[str, Any]: ...


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
        return self._backend.send(create_schedule_call(
            workflow, cron, input=input, timezone=timezone, overlap=overlap,
            catchup_window=catchup_window, version=version))

    def schedules(self, *, limit: int = 1000) -> list[dict[str, Any]]:
        """Every schedule, oldest first (pages of `limit`)."""
        out: list[dict[str, Any]] = []
        cursor: str | None = None
        while True:
            page = self._backend.send(list_schedules_call(limit, cursor))
            out += page["schedules"]
            cursor = page.get("next_cursor")
            if not cursor:
                return out

    def schedule(self, schedule_id: str) -> dict[str, Any]:
        """One schedule. Raises: NotFound."""
        return self._backend.send(get_schedule_call(schedule_id))

    def pause_schedule(self, schedule_id: str) -> dict[str, Any]:
        """Stop firing until resumed. Raises: NotFound."""
        return self._backend.send(schedule_action_call("pause", schedule_id))

    def resume_schedule(self, schedule_id: str) -> dict[str, Any]:
        """Fire again from the next fire after now. Raises: NotFound."""
        return self._backend.send(schedule_action_call("resume", schedule_id))

    def delete_schedule(self, schedule_id: str) -> None:
        """Delete it; its runs stay. Raises: NotFound."""
        self._backend.send(delete_schedule_call(schedule_id))

    def prune_runs(self, before: int | str, *, idempotency_keys_before: int | str | None = None,
                   limit: int | None = None) -> dict[str, Any]:
        """Delete finished runs that ended before `before` (admin scope).

        Args:
            before: epoch milliseconds or an ISO-8601 time.

        Returns:
            ``{"deleted": n, "more": bool}`` (call again while ``more``).
        """
        return self._backend.send(prune_runs_call(before, idempotency_keys_before, limit))


class AsyncScheduleCalls:
    """`stepd.AsyncClient`'s schedule operations and ``prune_runs``: `ScheduleCalls`, awaited."""

    _backend: _AsyncBackend

    async def create_schedule(self, workflow: str, cron: str, *, input: Any = None,
                              timezone: str = "UTC", overlap: str = "skip",
                              catchup_window: Duration = 0,
                              version: str | None = None) -> dict[str, Any]:
        """`Client.create_schedule`."""
        return await self._backend.send(create_schedule_call(
            workflow, cron, input=input, timezone=timezone, overlap=overlap,
            catchup_window=catchup_window, version=version))

    async def schedules(self, *, limit: int = 1000) -> list[dict[str, Any]]:
        """`Client.schedules`."""
        out: list[dict[str, Any]] = []
        cursor: str | None = None
        while True:
            page = await self._backend.send(list_schedules_call(limit, cursor))
            out += page["schedules"]
            cursor = page.get("next_cursor")
            if not cursor:
                return out

    async def schedule(self, schedule_id: str) -> dict[str, Any]:
        """`Client.schedule`."""
        return await self._backend.send(get_schedule_call(schedule_id))

    async def pause_schedule(self, schedule_id: str) -> dict[str, Any]:
        """`Client.pause_schedule`."""
        return await self._backend.send(schedule_action_call("pause", schedule_id))

    async def resume_schedule(self, schedule_id: str) -> dict[str, Any]:
        """`Client.resume_schedule`."""
        return await self._backend.send(schedule_action_call("resume", schedule_id))

    async def delete_schedule(self, schedule_id: str) -> None:
        """`Client.delete_schedule`."""
        await self._backend.send(delete_schedule_call(schedule_id))

    async def prune_runs(self, before: int | str, *,
                         idempotency_keys_before: int | str | None = None,
                         limit: int | None = None) -> dict[str, Any]:
        """`Client.prune_runs`."""
        return await self._backend.send(prune_runs_call(before, idempotency_keys_before, limit))
