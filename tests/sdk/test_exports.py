"""The public API: what ``stepd`` exports, and that importing it stays light."""

from __future__ import annotations

import inspect
import subprocess
import sys

import stepd

EXPECTED = {
    # building
    "Workflow", "Retry", "body",
    # running bodies
    "Worker", "StepContext", "Span", "current_context", "SessionAcquired",
    # clients
    "Client", "AsyncClient", "RunHandle", "AsyncRunHandle",
    "RunStatus", "RunSummary", "RunError", "Usage", "Budget",
    # embedded
    "embedded", "Embedded", "tune_gc",
    # errors
    "StepdError", "Invalid", "NotFound", "Unauthorized", "Forbidden", "Conflict",
    "AlreadyApplied", "Fenced", "RunTerminal", "NotStarted", "NotRetryable", "BudgetExceeded", "TooLarge",
    "Unprocessable", "Unavailable", "ServerError", "RunFailed", "RunCancelled", "RunTimedOut",
    "Retryable", "StepFailure", "Cancelled",
    "__version__",
}


def test_the_exports_are_exactly_the_documented_api() -> None:
    assert set(stepd.__all__) == EXPECTED
    for name in stepd.__all__:
        obj = getattr(stepd, name)
        if name != "__version__":
            assert inspect.getdoc(obj), f"stepd.{name} has no docstring"


def test_error_hierarchy() -> None:
    for cls in (stepd.Invalid, stepd.NotFound, stepd.Unauthorized, stepd.Forbidden,
                stepd.Conflict, stepd.TooLarge, stepd.Unprocessable, stepd.Unavailable,
                stepd.ServerError, stepd.RunFailed):
        assert issubclass(cls, stepd.StepdError)
    for cls in (stepd.AlreadyApplied, stepd.Fenced, stepd.RunTerminal, stepd.NotStarted,
                stepd.BudgetExceeded, stepd.NotRetryable):
        assert issubclass(cls, stepd.Conflict)
    assert issubclass(stepd.RunCancelled, stepd.RunFailed)
    assert issubclass(stepd.RunTimedOut, stepd.RunFailed)
    assert not issubclass(stepd.Cancelled, Exception)  # like asyncio.CancelledError
    assert stepd.StepFailure("rate_limited", "429").error_class == "rate_limited"


def test_importing_stepd_does_not_load_the_engine_or_the_network_stack() -> None:
    code = ("import sys, stepd; print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('lmdb', 'uvicorn', 'websockets') or m.startswith(('stepd.actors', "
            "'stepd.storage', 'stepd.transport.protocol'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60)
    assert out.stdout.strip() == "[]"
