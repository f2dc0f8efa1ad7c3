"""The public surface of stepd.actors, and its layering (STYLE.md rule 5).

The generic runtime is `stepd.actors` itself and its private `_*.py` modules.
(Daemon actors built on it live in subpackages such as `actors/daemon/`, which
may import the engine and storage; they are not checked here.)
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import stepd.actors

ACTORS_DIR = Path(stepd.actors.__file__).resolve().parent
RUNTIME_MODULES = sorted(
    ["stepd.actors"]
    + [f"stepd.actors.{p.stem}" for p in ACTORS_DIR.glob("_*.py") if p.stem != "__init__"]
)
FORBIDDEN = (
    "stepd.sansio",
    "stepd.storage",
    "stepd.transport",
    "stepd.workflow",
    "lmdb",
    "starlette",
    "websockets",
    "uvicorn",
    "httpx",
    "msgpack",
)

EXPECTED_EXPORTS = {
    "DEFAULT_WORKER_SHUTDOWN",
    "Actor",
    "ActorDead",
    "ActorError",
    "ActorKilled",
    "Mailbox",
    "ActorNotFound",
    "ActorRef",
    "ActorStatistics",
    "ActorSystem",
    "ActorTree",
    "ChildExists",
    "ChildSpec",
    "Clock",
    "ManualClock",
    "MutableMessageError",
    "Restart",
    "StartFailed",
    "Strategy",
    "Supervisor",
    "SupervisorEscalation",
    "SupervisorRef",
    "SystemClock",
    "Waiter",
    "WouldBlock",
    "add_restart",
    "check_message",
    "current_time",
    "is_immutable_type",
    "register_immutable",
}


def test_all_is_exactly_the_public_api() -> None:
    assert set(stepd.actors.__all__) == EXPECTED_EXPORTS
    assert len(stepd.actors.__all__) == len(EXPECTED_EXPORTS), "duplicates in __all__"
    for name in stepd.actors.__all__:
        assert getattr(stepd.actors, name) is not None


def test_public_names_are_not_private_module_paths() -> None:
    public = {n for n in dir(stepd.actors) if not n.startswith("_")}
    # Everything public is exported, except the private submodules themselves,
    # `annotations` from the __future__ import, and the `daemon` subpackage
    # (the daemon's own actors, built on this API, once something imports it).
    assert public - EXPECTED_EXPORTS <= {"annotations", "daemon"}


def test_error_hierarchy_is_closed() -> None:
    from stepd.actors import (
        ActorDead,
        ActorError,
        ActorKilled,
        ActorNotFound,
        ChildExists,
        MutableMessageError,
        StartFailed,
        SupervisorEscalation,
    )

    for err in (
        ActorDead,
        ActorKilled,
        ActorNotFound,
        ChildExists,
        MutableMessageError,
        StartFailed,
        SupervisorEscalation,
    ):
        assert issubclass(err, ActorError)
    assert issubclass(ActorNotFound, LookupError)
    assert issubclass(ChildExists, ValueError)
    assert issubclass(MutableMessageError, TypeError)


def test_runtime_imports_nothing_of_the_daemon_or_io() -> None:
    code = (
        "import importlib, sys\n"
        f"for name in {RUNTIME_MODULES!r}:\n"
        "    importlib.import_module(name)\n"
        f"bad = sorted(m for m in sys.modules if m.startswith({FORBIDDEN!r}))\n"
        "print('\\n'.join(bad))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "", f"stepd.actors pulled in: {result.stdout}"


#: The one module allowed to touch the backends: `Waiter` parks a task on the
#: backend's own primitive (a future, a trio reschedule), the runtime's hottest
#: wait, where anyio's Event costs several times more (measured in bench/actors.py
#: and docs/actors.md). Everything else stays anyio-only.
BACKEND_SHIM = "_waiter.py"


def test_runtime_source_imports_no_backend_directly() -> None:
    """Backend-agnostic: anyio only, never asyncio or trio (STYLE.md rule 7)."""
    offenders = []
    for path in ACTORS_DIR.glob("*.py"):
        if path.name == BACKEND_SHIM:
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            for name in names:
                root = name.split(".")[0]
                if root in ("asyncio", "trio", "sniffio") or name.startswith(FORBIDDEN):
                    offenders.append(f"{path.name}: import {name}")
    assert offenders == []
    assert len(RUNTIME_MODULES) >= 10, RUNTIME_MODULES
