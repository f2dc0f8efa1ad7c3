"""Worker construction and registration: refused early, naming what is wrong."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest

import stepd


async def ok(ctx: stepd.StepContext, input: Any, steps: Any) -> None: ...


def too_many(ctx: Any, input: Any, steps: Any, extra: Any) -> None: ...


def keyword_only(ctx: Any, *, flag: bool) -> None: ...


class AsyncCallable:
    __name__ = "async_callable"

    async def __call__(self, ctx: Any) -> str:
        return "called"


def test_bad_bodies_are_refused_at_register(tmp_path: Path) -> None:
    worker = stepd.Worker(stepd.Client("http://127.0.0.1:1"))
    with pytest.raises(stepd.Invalid) as err:
        worker.register(stepd.Workflow("w1").then(too_many))
    assert err.value.field == "bodies.too_many" and "requires 4 arguments" in str(err.value)
    with pytest.raises(stepd.Invalid) as err:
        worker.register(stepd.Workflow("w2").then(keyword_only))
    assert "keyword-only parameter 'flag'" in str(err.value)
    with pytest.raises(stepd.Invalid) as err:
        worker.register("not a workflow")  # type: ignore[arg-type]
    assert err.value.field == "workflows"
    worker.register(stepd.Workflow("w3").then(ok))
    with pytest.raises(stepd.Invalid, match="registered twice"):
        worker.register(stepd.Workflow("w3").then(ok))


def test_bodies_are_inspected_once() -> None:
    from stepd._bodies import Body

    assert Body.of("ok", ok, "w") == Body("ok", ok, True, 3)
    partial = functools.partial(too_many, 1)
    assert Body.of("p", partial, "w").nargs == 3 and not Body.of("p", partial, "w").is_async
    call = AsyncCallable()
    assert Body.of("c", call, "w").is_async and Body.of("c", call, "w").nargs == 1
    assert Body.of("v", lambda *args: None, "w").nargs == 3


def test_bad_worker_arguments_are_refused() -> None:
    with pytest.raises(stepd.Invalid) as err:
        stepd.Worker("http://127.0.0.1:1", concurrency=0)
    assert err.value.field == "concurrency"
    with pytest.raises(stepd.Invalid) as err:
        stepd.Worker("http://127.0.0.1:1", transport="carrier-pigeon")
    assert err.value.field == "transport"
    with pytest.raises(stepd.Invalid) as err:
        stepd.Worker(42)  # type: ignore[arg-type]
    assert err.value.field == "target"
    with pytest.raises(stepd.Invalid) as err:
        stepd.Client("ftp://example")
    assert err.value.field == "url"


def test_a_worker_without_workflows_does_not_run(tmp_path: Path) -> None:
    with stepd.embedded(tmp_path / "data") as daemon:
        worker = stepd.Worker(daemon)
        with pytest.raises(stepd.Invalid, match="register at least one workflow"):
            worker.serve()
        assert not worker.wait_ready(0.1)
        with pytest.raises(RuntimeError, match="runs once"):
            worker.serve()
