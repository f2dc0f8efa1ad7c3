"""The schedule and prune calls of `stepd.Client` and `stepd.AsyncClient` on an embedded
daemon (in process: the same protocol table, validation and errors as over HTTP)."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import anyio
import pytest

import stepd
from stepd._schedules import AsyncScheduleCalls, ScheduleCalls


def test_client_schedule_calls_in_process(tmp_path: Path) -> None:
    with stepd.embedded(tmp_path / "data") as daemon, stepd.Client(daemon) as client:
        with pytest.raises(stepd.Invalid) as err:
            client.create_schedule("nobody", "* * * * *")
        assert err.value.field == "workflow"
        with pytest.raises(stepd.Invalid) as err:
            client.create_schedule("nobody", "* * * * *", timezone="Nowhere/Land")
        assert err.value.field == "timezone"
        assert client.schedules() == []
        for call in (client.schedule, client.pause_schedule, client.resume_schedule,
                     client.delete_schedule):
            with pytest.raises(stepd.NotFound):
                call("s_01JDV5Z8Q3X4M6N7P8R9S0T1U2")
        assert client.prune_runs("2000-01-01T00:00:00Z") == {"deleted": 0, "more": False}
        with pytest.raises(stepd.Invalid) as err:
            client.prune_runs("soon")
        assert err.value.field == "before"


def nightly(ctx: stepd.StepContext, input: Any) -> Any:
    return input


async def test_async_client_schedule_calls_in_process(tmp_path: Path) -> None:
    """`AsyncClient` has `Client`'s schedule and prune calls, built by the same code."""
    flow = stepd.Workflow("async-nightly", version="n.v1").then(nightly)
    async with stepd.embedded(tmp_path / "data") as daemon:
        client = stepd.AsyncClient(daemon)
        worker = stepd.Worker(client).register(flow)
        async with anyio.create_task_group() as tg:
            await tg.start(worker.run)
            with pytest.raises(stepd.Invalid) as err:
                await client.create_schedule("nobody", "* * * * *")
            assert err.value.field == "workflow"
            with pytest.raises(stepd.Invalid) as err:
                await client.create_schedule("async-nightly", "0 25 * * *")
            assert err.value.field == "cron"
            assert await client.schedules() == []
            made = await client.create_schedule("async-nightly", "0 2 * * *", input={"n": 1},
                                                timezone="Europe/Paris", overlap="allow",
                                                catchup_window="1h", version="n.v1")
            sid = made["schedule_id"]
            assert made["overlap"] == "allow" and made["catchup_window_ms"] == 3_600_000
            assert await client.schedule(sid) == made
            assert [s["schedule_id"] for s in await client.schedules(limit=1)] == [sid]
            assert (await client.pause_schedule(sid))["paused"] is True
            assert (await client.resume_schedule(sid))["paused"] is False
            assert await client.delete_schedule(sid) is None
            for call in (client.schedule, client.pause_schedule, client.resume_schedule,
                         client.delete_schedule):
                with pytest.raises(stepd.NotFound):
                    await call(sid)
            assert await client.prune_runs("2000-01-01T00:00:00Z", idempotency_keys_before=0,
                                           limit=10) == {"deleted": 0, "more": False}
            with pytest.raises(stepd.Invalid) as err:
                await client.prune_runs("soon")
            assert err.value.field == "before"
            worker.stop()


def test_the_async_calls_have_the_sync_names_and_signatures() -> None:
    sync = {n for n in vars(ScheduleCalls) if not n.startswith("_")}
    assert sync == {n for n in vars(AsyncScheduleCalls) if not n.startswith("_")} == {
        "create_schedule", "schedules", "schedule", "pause_schedule", "resume_schedule",
        "delete_schedule", "prune_runs"}
    for name in sync:
        a, b = getattr(ScheduleCalls, name), getattr(AsyncScheduleCalls, name)
        assert inspect.iscoroutinefunction(b) and not inspect.iscoroutinefunction(a), name
        assert inspect.signature(a) == inspect.signature(b), name
    assert issubclass(stepd.Client, ScheduleCalls)
    assert issubclass(stepd.AsyncClient, AsyncScheduleCalls)
