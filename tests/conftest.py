"""Test configuration shared by the whole suite.

Two things live here:

* ``anyio_backend``: async tests run on asyncio (in debug mode) and on trio
  unless a module narrows the parameter.
* The loop-block guard (``tests/_loopguard.py``): an async test fails when
  its event loop stops turning for longer than a threshold, and the failure
  shows the stack of the call that blocked it. LMDB fsyncs must happen off the
  loop (DESIGN.md), and a blocked loop shows up as latency, never as an error,
  unless something looks for it.
"""

from __future__ import annotations

import pytest

pytest_plugins = ["tests._loopguard", "pytester"]


@pytest.fixture(
    params=[
        pytest.param(("asyncio", {"debug": True}), id="asyncio"),
        pytest.param(("trio", {}), id="trio"),
    ]
)
def anyio_backend(request: pytest.FixtureRequest) -> tuple[str, dict[str, object]]:
    return request.param  # type: ignore[no-any-return]
