"""Which event loop runs here: trio or asyncio, and asyncio's loop options."""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["loop_options", "on_trio"]


def on_trio() -> bool:
    """True inside a trio event loop (the websockets client differs)."""
    trio = sys.modules.get("trio")
    if trio is None:
        return False
    try:
        trio.lowlevel.current_trio_token()
    except RuntimeError:
        return False
    return True


def loop_options(backend: str) -> dict[str, Any]:
    """asyncio on uvloop when it is installed: about a quarter less CPU per message."""
    if backend != "asyncio":
        return {}
    try:
        import uvloop  # noqa: F401
    except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
        return {}
    return {"use_uvloop": True}
