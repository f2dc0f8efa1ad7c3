"""The worker WebSocket's answer frames, and what is wrong with a frame msgpack refused
(transport/websocket.py; PROTOCOL.md "WebSocket").

Pure functions of a reply or an exception: kept apart so the connection's
module holds the connection.
"""

from __future__ import annotations

from typing import Any, TypeGuard

import msgpack  # type: ignore[import-untyped]

from stepd.sansio.errors import StepdError

from .protocol import Reply, error_reply

__all__ = ["answer_frame", "error_frame", "is_frame_id", "msgpack_problem"]


def is_frame_id(value: Any) -> TypeGuard[int]:
    """A request id: an integer, not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def msgpack_problem(data: bytes, exc: Exception) -> str:
    """What is wrong with a frame msgpack refused, in words (msgpack's own can be empty)."""
    text = str(exc)
    if not data:
        return "it is empty"
    if isinstance(exc, msgpack.ExtraData):
        return "there are bytes after the first value (a frame is one map)"
    if isinstance(exc, msgpack.StackError):
        return "it is nested too deeply"
    if isinstance(exc, msgpack.FormatError):  # the one byte no msgpack value starts with
        return "a value starts with byte 0xc1, which msgpack never uses"
    if "incomplete input" in text or " exceeds max_" in text:
        return "it ends in the middle of a value (a length or an item is missing)"
    if "map key" in text:
        return f"a map key is not a string ({text})"
    return text or type(exc).__name__


def answer_frame(frame_id: Any, reply: Reply) -> dict[str, Any]:
    """The frame answering a request: ``ok``, ``conflict`` or ``error`` (PROTOCOL.md)."""
    if reply.status < 300:
        return {"op": "ok", "id": frame_id, **reply.body}
    if reply.status == 409:
        return {"op": "conflict", "id": frame_id, "reason": reply.body.get("reason"),
                "message": reply.body.get("message", "")}
    frame = {"op": "error", "id": frame_id, "status": reply.status,
             "message": reply.body.get("message", "")}
    if "field" in reply.body:
        frame["field"] = reply.body["field"]
    return frame


def error_frame(frame_id: Any, exc: StepdError) -> dict[str, Any]:
    """The ``error`` frame for `exc`, echoing the id only when it is one."""
    return answer_frame(frame_id if is_frame_id(frame_id) else None, error_reply(exc))
