"""stepd: a durable step orchestrator for Python.

::

    import stepd

    async def classify(ctx, input, steps):
        with ctx.span("llm.call") as span:
            span.set_usage(model="m", input_tokens=10, output_tokens=5)
        return {"label": "billing"}

    support = stepd.Workflow("support", version="support.v2").then(classify)

    with stepd.embedded("./data") as daemon:        # or stepd.Client("http://127.0.0.1:7707")
        client = stepd.Client(daemon)
        worker = stepd.Worker(client).register(support)
        ...                                          # worker.serve() on a thread, or await worker.run()
        run = client.start("support", {"ticket": 42}, idempotency_key="ticket:42")
        print(run.result(timeout=30))

See docs/sdk.md.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Names are imported on first use (PEP 562): `import stepd.actors` (the generic
# runtime) must not drag in the engine, httpx or the builder with it.
_EXPORTS: dict[str, str] = {
    **dict.fromkeys(
        ("AlreadyApplied", "BudgetExceeded", "Cancelled", "Conflict", "Fenced", "Forbidden",
         "Invalid", "NotFound", "NotRetryable", "NotStarted", "Retryable", "RunCancelled", "RunFailed",
         "RunTerminal", "RunTimedOut", "ServerError", "StepdError", "StepFailure", "TooLarge",
         "Unauthorized", "Unavailable", "Unprocessable"),
        "stepd._errors"),
    **dict.fromkeys(("Budget", "RunError", "RunStatus", "RunSummary", "Usage"), "stepd._runs"),
    **dict.fromkeys(("AsyncClient", "AsyncRunHandle", "Client", "RunHandle"), "stepd.client"),
    **dict.fromkeys(("Span", "StepContext", "current_context"), "stepd.context"),
    **dict.fromkeys(("Embedded", "embedded"), "stepd.embedded"),
    "Worker": "stepd.worker",
    "SessionAcquired": "stepd._work_sessions",
    "tune_gc": "stepd.gc_policy",
    **dict.fromkeys(("Retry", "Workflow", "body"), "stepd.workflow"),
}

__all__ = [
    "AlreadyApplied",
    "AsyncClient",
    "AsyncRunHandle",
    "Budget",
    "BudgetExceeded",
    "Cancelled",
    "Client",
    "Conflict",
    "Embedded",
    "Fenced",
    "Forbidden",
    "Invalid",
    "NotFound",
    "NotRetryable",
    "NotStarted",
    "Retry",
    "Retryable",
    "RunCancelled",
    "RunError",
    "RunFailed",
    "RunHandle",
    "RunStatus",
    "RunSummary",
    "RunTerminal",
    "RunTimedOut",
    "ServerError",
    "SessionAcquired",
    "Span",
    "StepContext",
    "StepFailure",
    "StepdError",
    "TooLarge",
    "Unauthorized",
    "Unavailable",
    "Unprocessable",
    "Usage",
    "Worker",
    "Workflow",
    "__version__",
    "body",
    "current_context",
    "embedded",
    "tune_gc",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _Package(types.ModuleType):
    """This package's module type: the submodule ``stepd.embedded`` never shadows the function.

    Importing a submodule binds it on its package, so the first
    ``import stepd.embedded`` (``stepd.Client(url)`` does one) would otherwise
    replace the lazily exported function ``stepd.embedded`` with the module, and
    ``stepd.embedded(path)`` would fail depending on import order. The module stays
    reachable as ``sys.modules["stepd.embedded"]`` and through
    ``from stepd.embedded import Embedded``.
    """

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "embedded" and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


if TYPE_CHECKING:
    from stepd._errors import (
        AlreadyApplied,
        BudgetExceeded,
        Cancelled,
        Conflict,
        Fenced,
        Forbidden,
        Invalid,
        NotFound,
        NotRetryable,
        NotStarted,
        Retryable,
        RunCancelled,
        RunFailed,
        RunTerminal,
        RunTimedOut,
        ServerError,
        StepdError,
        StepFailure,
        TooLarge,
        Unauthorized,
        Unavailable,
        Unprocessable,
    )
    from stepd._runs import Budget, RunError, RunStatus, RunSummary, Usage
    from stepd._work_sessions import SessionAcquired
    from stepd.client import AsyncClient, AsyncRunHandle, Client, RunHandle
    from stepd.context import Span, StepContext, current_context
    from stepd.embedded import Embedded, embedded
    from stepd.gc_policy import tune_gc
    from stepd.worker import Worker
    from stepd.workflow import Retry, Workflow, body
