"""The embedded step's path (docs/architecture.md "A step in process"): values cross by
copy without a JSON round trip, and the next step of a run, offered inside the
`complete` of the step before it, goes to the runner that sent that `complete`.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest

import stepd

from .conftest import unique

pytestmark = pytest.mark.anyio


def _chain(n: int) -> stepd.Workflow:
    wf = stepd.Workflow(unique("chain"))
    for i in range(n):
        acc: Any = 0 if i == 0 else f"${{steps.s{i - 1}}}"
        wf.then("add", id=f"s{i}", input={"i": i, "acc": acc})
    return wf


async def add(ctx: stepd.StepContext, input: dict[str, int]) -> int:
    return input["acc"] + input["i"]


@asynccontextmanager
async def _serving(path: Path, wf: stepd.Workflow, bodies: dict[str, Callable[..., Any]],
                   **knobs: Any) -> AsyncIterator[tuple[stepd.AsyncClient, stepd.Worker]]:
    """An embedded daemon, its client, and an SDK worker serving `wf` in process until
    the block ends (then stopped; the daemon stays open for the block only)."""
    async with stepd.embedded(path) as daemon:
        client = stepd.AsyncClient(daemon)
        worker = stepd.Worker(client, **knobs)
        worker.register(wf, bodies=bodies)
        async with anyio.create_task_group() as tg:
            await tg.start(worker.run)
            try:
                yield client, worker
            finally:
                worker.stop()


@pytest.mark.parametrize("concurrency", [None, 1])
async def test_the_next_step_goes_to_the_runner_that_completed_the_last(
        tmp_path: Path, concurrency: int | None) -> None:
    """With the default concurrency a step is offered inside its predecessor's
    `complete` and taken by that runner when its call returns. With one slot the
    next step waits for the slot's credit, which the session takes on its own
    turn: no hand-off. The journal is the same either way."""
    wf = _chain(6)
    knobs = {} if concurrency is None else {"concurrency": concurrency}
    async with _serving(tmp_path / "data", wf, {"add": add}, **knobs) as (client, worker):
        run = await client.start(wf.name, None)
        assert await run.result(timeout=20) == 15
        events = [e["type"] for e in await client.journal(run.run_id)
                  if e["type"].startswith("step_")]
    if concurrency is None:
        # The first transition of a run may be the run actor's own turn (not the
        # caller's task): its offer then wakes a runner as over a socket.
        assert worker._handoffs >= 4
    assert events == ["step_scheduled", "step_offered", "step_started", "step_completed"] * 6
    assert worker.running == 0


async def test_values_cross_by_copy_both_ways(tmp_path: Path) -> None:
    """A body that changes its input, or the output it returned, changes nothing the
    daemon holds: the next step and the result see what was sent."""
    kept: list[Any] = []
    wf = (stepd.Workflow(unique("copy"))
          .then("grab", id="a", input={"xs": [1, 2], "m": {"k": "v"}})
          .then("grab", id="b", input={"prev": "${steps.a}"}))

    async def grab(ctx: stepd.StepContext, input: dict[str, Any]) -> Any:
        out = {"seen": input, "list": [1, (2, 3)]}
        kept.append(out)
        if "xs" in input:
            input["xs"].append(99)  # the lease's own copy
            input["m"]["k"] = "changed"
        return out

    async with _serving(tmp_path / "data", wf, {"grab": grab}) as (client, _):
        run = await client.start(wf.name, None)
        result = await run.result(timeout=20)
        for out in kept:  # after the daemon took them
            out["list"].append("late")
            out["seen"]["late"] = True
        again = await client.result(run.run_id, timeout=5)
    first = {"seen": {"xs": [1, 2, 99], "m": {"k": "changed"}}, "list": [1, [2, 3]]}
    assert result == again == {"seen": {"prev": first}, "list": [1, [2, 3]]}


async def test_output_json_cannot_carry_fails_the_attempt_in_process(tmp_path: Path) -> None:
    """The copy refuses what JSON refuses, as HTTP would: the attempt fails, naming why."""
    wf = stepd.Workflow(unique("bad")).then("nan", id="a", retry=stepd.Retry(max_attempts=1))

    async def nan(ctx: stepd.StepContext, input: Any) -> float:
        return float("nan")

    async with _serving(tmp_path / "data", wf, {"nan": nan}) as (client, _):
        run = await client.start(wf.name, None)
        with pytest.raises(stepd.RunFailed) as info:
            await run.result(timeout=20)
    assert "JSON" in str(info.value)


_FIRST_OPEN = """
import asyncio, sys, tempfile, threading
import stepd

importers = {}

def hook(event, args):
    if event == "import" and str(args[0]).startswith("stepd.actors.daemon."):
        importers.setdefault(args[0], threading.get_ident())

sys.addaudithook(hook)

async def main():
    assert "stepd.actors.daemon" not in sys.modules, "import stepd imported the daemon"
    loop_thread = threading.get_ident()
    async with stepd.embedded(tempfile.mkdtemp(dir=sys.argv[1])):
        pass
    print(len(importers), sum(thread == loop_thread for thread in importers.values()))

asyncio.run(main())
"""


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_the_first_open_imports_the_daemon_off_the_event_loop(tmp_path: Path) -> None:
    """The daemon's modules take ~0.5 s to import the first time; `async with
    stepd.embedded(...)` imports them in a worker thread, so the caller's loop keeps
    serving meanwhile. A fresh interpreter, because this one has them imported already."""
    done = await anyio.run_process([sys.executable, "-c", _FIRST_OPEN, str(tmp_path)])
    imported, on_the_loop = map(int, done.stdout.decode().split())
    assert imported > 10 and on_the_loop == 0, done.stdout
