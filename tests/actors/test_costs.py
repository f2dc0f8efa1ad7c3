"""What an ask, a tell and a child's start and stop cost, in Python calls (issue 13).

Timings on a shared machine move by tens of percent, so the runtime's cost is
held by counts instead: cProfile's call events (a function called, a
coroutine resumed, a C function called from Python) per operation, as
`python -m bench.actors` prints them (`bench.actors.count_calls_per_op`). The
counts are deterministic on plain asyncio; on trio the scheduler shuffles the
tasks it wakes together, so the tell (a producer and a dispatcher) may move a
little. Each budget is the figure measured when the runtime was cut to it,
plus a small margin: a change that adds a call to one of these paths fails
here and must say why (docs/actors.md, "Performance").
"""

from __future__ import annotations

import anyio
import pytest

from bench.actors import count_calls_per_op

#: Calls per operation (Python + C), as measured (docs/actors.md, bench/README.md).
#: A tell counts one call more than it did before branch `rt-cost2`: its
#: handler runs inside a generator that stays alive (`_turn._runner`, one
#: resumption counted per message) instead of being stepped by
#: ``coro.send(None)``, whose `StopIteration` cost more than that call.
MEASURED = {
    "asyncio": {"ask": 6.6, "tell": 8.1, "spawn+stop": 13.0},
    "trio": {"ask": 6.7, "tell": 8.3, "spawn+stop": 13.0},
}
#: Room above the measured figure before the test fails.
MARGIN = 0.5


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_calls_per_op_stay_within_budget(backend: str) -> None:
    counts = anyio.run(count_calls_per_op, 1024, backend=backend)
    assert set(counts) == set(MEASURED[backend])
    over = {
        op: round(python + c, 2)
        for op, (python, c) in counts.items()
        if python + c > MEASURED[backend][op] + MARGIN
    }
    assert not over, f"calls per op above the budget {MEASURED[backend]} (+{MARGIN}): {over}"


def test_an_inline_ask_that_does_not_wait_is_one_python_call_of_the_runtime() -> None:
    """The ask itself; the handler and its coroutine's `send` are the rest."""
    counts = anyio.run(count_calls_per_op, 1024, backend="asyncio")
    python, _c = counts["ask"]
    # ask + the handler + the scope token of a class that may be killed half way
    assert python <= 3.5
