"""Run listing by indexes (the hardening issue, defect 1): O(limit), filters, cursors.

A listing once scanned and decoded up to 512 whole run records (input,
state, result) on the event loop even for ``limit=1``: twenty concurrent
calls against runs with MB-sized inputs held ``/healthz`` for 10 s. Costs are
counted here, not timed: the bytes a page decodes.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import stepd.storage._txn as txn_module
from stepd.actors.daemon import Daemon, listing, store, tables
from stepd.sansio.errors import Invalid

from .helpers import claim_one, finish

FLOW = {"name": "flow", "steps": [{"id": "a", "kind": "task", "body": "a"}]}
OTHER = {"name": "other", "steps": [{"id": "a", "kind": "task", "body": "a"}]}


@pytest.fixture
def decoded(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Counts the bytes every storage read decodes (the real codec still decodes them)."""
    sizes: list[int] = []
    real = txn_module.decode

    def counting(raw: bytes) -> Any:
        sizes.append(len(raw))
        return real(raw)

    monkeypatch.setattr(txn_module, "decode", counting)
    yield sizes


async def test_a_page_decodes_summaries_not_runs(tmp_path: Path, decoded: list[int]) -> None:
    big = "x" * 200_000
    async with Daemon.open(str(tmp_path / "data")) as engine:
        await engine.register_worker(definitions=[FLOW])
        for i in range(40):
            await engine.start_run("flow", {"blob": big, "i": i})
        await engine.cancel((await engine.start_run("flow", {"blob": big}))[0])
        decoded.clear()
        page, cursor = engine.list_runs(status="cancelled", limit=1)
        assert [r["status"] for r in page] == ["cancelled"] and cursor is not None
        page, _ = engine.list_runs(limit=1)
        assert len(page) == 1
        # Two pages of one summary each: a few hundred bytes, never a 200 KB input.
        assert sum(decoded) < 2_000, decoded
        assert max(decoded) < 1_000


async def test_filters_order_and_cursors(tmp_path: Path) -> None:
    async with Daemon.open(str(tmp_path / "data")) as engine:
        wid = (await engine.register_worker(definitions=[FLOW, OTHER]))["worker_id"]
        made: list[tuple[str, str]] = []
        for i in range(30):
            wf = "flow" if i % 3 else "other"
            run_id, _ = await engine.start_run(wf, i, correlation={"ticket": i % 2},
                                               idempotency_key=f"k{i}")
            made.append((run_id, wf))
        # Complete a few so statuses differ.
        for _ in range(4):
            lease = await claim_one(engine, wid)
            await finish(engine, lease, "done")
        ids = [r for r, _ in made]

        def all_pages(**filters: Any) -> list[str]:
            out: list[str] = []
            cursor = None
            for _ in range(100):  # bounded
                page, cursor = engine.list_runs(limit=7, cursor=cursor, **filters)
                out += [r["run_id"] for r in page]
                if cursor is None:
                    return out
            raise AssertionError("never ended")

        assert all_pages() == ids[::-1]  # newest first by default
        assert all_pages(order="asc") == ids
        assert all_pages(workflow="other") == [r for r, wf in made if wf == "other"][::-1]
        completed = {engine.status(r)["run_id"] for r in ids
                     if engine.status(r)["status"] == "completed"}
        assert len(completed) == 4
        assert set(all_pages(status="completed")) == completed
        assert set(all_pages(status="running")) == set(ids) - completed
        assert set(all_pages(workflow="flow", status="running")) == {
            r for r, wf in made if wf == "flow"} - completed
        assert all_pages(correlation={"ticket": 1}) == [r for i, r in enumerate(ids) if i % 2][::-1]
        assert all_pages(correlation={"ticket": 1}, workflow="other") == [
            r for i, (r, wf) in enumerate(made) if i % 2 and wf == "other"][::-1]
        assert all_pages(idempotency_key="k7") == [ids[7]]
        assert all_pages(idempotency_key="k7", workflow="other") == []
        assert all_pages(idempotency_key="nope") == []
        created = [engine.status(r)["created_at"] for r in ids]
        assert created == sorted(created)
        lo, hi = engine.storage.get(store.RUN_SUMMARIES, ids[5])["created_at"], \
            engine.storage.get(store.RUN_SUMMARIES, ids[20])["created_at"]
        window = all_pages(created_after=lo, created_before=hi, order="asc")
        assert window and all(lo <= engine.storage.get(store.RUN_SUMMARIES, r)["created_at"] < hi
                              for r in window)
        assert ids[5] in window and ids[20] not in window
        with pytest.raises(Invalid) as info:
            engine.list_runs(status="running", cursor=engine.list_runs(limit=1)[1])
        assert info.value.field == "cursor"


async def test_a_page_examines_a_bounded_number_of_entries(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A filter no index covers whole ends the page early, with a cursor; nothing is lost.

    With a budget of 40 rather than 1,000 (read at each page): the same pages,
    90 runs to start instead of 1,050 (most of the test's ~20 s).
    """
    monkeypatch.setattr(listing, "SCAN_BUDGET", 40)
    async with Daemon.open(str(tmp_path / "data")) as engine:
        await engine.register_worker(definitions=[FLOW])
        ids = [(await engine.start_run("flow", i, correlation="same"))[0]
               for i in range(listing.SCAN_BUDGET + 50)]
        await engine.cancel(ids[0])
        page, cursor = engine.list_runs(correlation="same", status="cancelled", limit=10)
        assert page == [] and cursor is not None  # the budget ran out before the oldest
        page, cursor = engine.list_runs(correlation="same", status="cancelled", limit=10,
                                        cursor=cursor)
        assert [r["run_id"] for r in page] == [ids[0]] and cursor is None


async def test_a_data_directory_from_before_the_indexes_is_indexed_at_open(tmp_path: Path) -> None:
    path = str(tmp_path / "data")
    async with Daemon.open(path) as engine:
        await engine.register_worker(definitions=[FLOW])
        ids = [(await engine.start_run("flow", i))[0] for i in range(25)]
        await engine.cancel(ids[3])

        def forget_txn(txn: Any) -> None:  # as a data directory written before them
            for table in (tables.RUN_SUMMARIES, tables.IDX_RUNS_CREATED, tables.IDX_RUNS_STATUS,
                          tables.IDX_RUNS_WORKFLOW, tables.IDX_RUNS_WF_STATUS,
                          tables.IDX_RUNS_CORRELATION):
                for key, _ in list(txn.scan_raw(table)):
                    txn.delete(table, key)

        await engine.storage.write(forget_txn)
    async with Daemon.open(path) as engine:
        page, _ = engine.list_runs(limit=100)
        assert [r["run_id"] for r in page] == ids[::-1]
        assert [r["run_id"] for r in engine.list_runs(status="cancelled")[0]] == [ids[3]]
        assert engine.stats.status_counts == {"running": 24, "cancelled": 1}
