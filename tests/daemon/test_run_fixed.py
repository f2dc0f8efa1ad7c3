"""A run's fixed cost (branch `run-fixed`, issue 16): what the start path no longer does
must still come out the same.

The idempotency key is claimed in the start's own transaction (no read first):
a key used before still answers its run, with its audit entry, whatever the
repeat asks; and a run started with its creator's machine passivates, wakes and
hears its children as before. Real LMDB, real actors, a virtual clock.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest

from stepd.actors import ManualClock
from stepd.actors.daemon import Daemon
from stepd.actors.daemon.audit import AuditAction
from stepd.sansio.errors import Invalid, Unprocessable

from .helpers import claim_one, eventually, finish, seq_definition

T0 = 1_700_000_000_000


def _entry(d: Daemon, status: int = 201) -> Any:
    return d.audit.new_entry(key_id=None, scope="execute", action=AuditAction.RUNS_START,
                             target=None, status=status)


async def test_a_key_used_before_answers_its_run_and_audits_the_repeat(tmp_path: Path) -> None:
    async with Daemon.open(str(tmp_path / "data"), clock=ManualClock(wall_ms=T0)) as d:
        await d.register_worker(definitions=[seq_definition("seq", 1)])
        run_id, created = await d.start_run("seq", None, idempotency_key="k", audit=_entry(d))
        again, created_again = await d.start_run("seq", {"other": 1}, idempotency_key="k",
                                                 audit=_entry(d))
        assert created and not created_again and again == run_id
        # One run on record, counted once; both calls audited, the repeat as a 200.
        assert d.stats.runs_started == 1
        assert d.stats.status_counts.get("running") == 1
        starts = [e for e in d.audit.page(100, None)[0] if e.action == "runs.start"]
        assert sorted((e.target, e.status) for e in starts) == [(run_id, 200), (run_id, 201)]


async def test_a_refused_start_with_a_key_used_before_answers_that_run(tmp_path: Path) -> None:
    async with Daemon.open(str(tmp_path / "data"), clock=ManualClock(wall_ms=T0)) as d:
        await d.register_worker(definitions=[seq_definition("seq", 1)])
        run_id, _ = await d.start_run("seq", None, idempotency_key="k")
        # The repeat would be refused on its own (no such workflow, a bad deadline):
        # the key decides first, as when it was looked up before anything else.
        assert await d.start_run("nope", None, idempotency_key="k") == (run_id, False)
        assert await d.start_run("seq", None, idempotency_key="k", deadline_ms=-5) == (
            run_id, False)
        # Without a key used before, the same calls are refused.
        with pytest.raises(Unprocessable):
            await d.start_run("nope", None, idempotency_key="fresh")
        with pytest.raises(Invalid):
            await d.start_run("seq", None, idempotency_key="fresh2", deadline_ms=-5)
        assert d.stats.runs_started == 1


async def test_concurrent_starts_under_one_key_make_one_run(tmp_path: Path) -> None:
    async with Daemon.open(str(tmp_path / "data"), clock=ManualClock(wall_ms=T0)) as d:
        await d.register_worker(definitions=[seq_definition("seq", 1)])
        answers: list[tuple[str, bool]] = []

        async def start() -> None:
            answers.append(await d.start_run("seq", None, idempotency_key="same"))

        async with anyio.create_task_group() as tg:
            for _ in range(5):
                tg.start_soon(start)
        assert len({run_id for run_id, _ in answers}) == 1
        assert sorted(created for _, created in answers) == [False, False, False, False, True]
        assert d.stats.runs_started == 1


PARENT = {"name": "parent", "steps": [
    {"id": "kids", "kind": "start_workflows", "workflow": "child", "items": [1, 2]},
    {"id": "after", "kind": "task", "body": "b"},
]}
CHILD = {"name": "child", "steps": [{"id": "c", "kind": "task", "body": "c"}]}


async def test_a_fresh_run_hears_the_children_it_started_in_its_first_transaction(
        tmp_path: Path) -> None:
    # The run's actor starts with its creator's machine and reads no inbox: the
    # children (created in the start's transaction, woken after its actor) tell it
    # when they finish, and it moves on.
    async with Daemon.open(str(tmp_path / "data"), clock=ManualClock(wall_ms=T0)) as d:
        reg = await d.register_worker(name="w", definitions=[PARENT, CHILD])
        wid = str(reg["worker_id"])
        run_id, _ = await d.start_run("parent", None)
        for _ in range(2):
            await finish(d, await claim_one(d, wid), "C")
        await finish(d, await claim_one(d, wid), "B")
        await eventually(lambda: d.status(run_id)["status"] == "completed")
        assert d.stats.runs_started == 3
