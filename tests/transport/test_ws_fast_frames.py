"""The daemon's own frame parser for whole data frames (`WebSocketProtocol._read_fast`).

Frames that are final, masked, text or binary are parsed in the protocol's
callback; everything else (control frames, fragments, frames to refuse, a
large frame split across reads, a closing connection) goes to websockets'
parser, whole or from a frame boundary on. These tests send such streams over
a raw socket to a real daemon (uvicorn on 127.0.0.1) and check the answers,
the close codes, and that the fast path is back in charge afterwards.
"""

from __future__ import annotations

import time
from typing import Any

import msgpack

from stepd.transport._uvicorn import WebSocketProtocol
from stepd.transport.websocket import WorkerConnection

from .conftest import InProcDaemon
from .test_ws_backpressure import RawWs


def _heartbeat(frame_id: int, pad: int = 0) -> bytes:
    return msgpack.packb({"op": "heartbeat", "id": frame_id, "lease_id": "l_x",
                          **({"pad": "p" * pad} if pad else {})})


def _wires(inproc: InProcDaemon) -> list[bool]:
    """Whether each open worker connection's protocol is on the fast path."""

    def read() -> list[bool]:
        return [c._wire._fast for c in inproc.daemon.protocol._connections
                if isinstance(c, WorkerConnection) and isinstance(c._wire, WebSocketProtocol)]

    return inproc.run(read)  # type: ignore[no-any-return]


def _answers(ws: RawWs, n: int) -> list[dict[str, Any]]:
    return [ws.recv() for _ in range(n)]


def test_a_frame_split_across_reads_is_put_together(inproc: InProcDaemon) -> None:
    ws = RawWs(inproc.url)
    try:
        for pad in (10, 200, 100_000):  # buffered here; and one larger than the fast path keeps
            frame = RawWs.frame(_heartbeat(pad, pad))
            for cut in (1, 3, len(frame) // 2):
                ws.sock.sendall(frame[:cut])
                time.sleep(0.02)  # two reads on the daemon's side
                ws.sock.sendall(frame[cut:])
                answer = ws.recv()
                assert answer["id"] == pad and answer["op"] == "error", answer
        assert _wires(inproc) == [True]
    finally:
        ws.close()


def test_control_frames_and_fragments_between_data_frames(inproc: InProcDaemon) -> None:
    ws = RawWs(inproc.url)
    try:
        ping = bytes([0x89, 0x80 | 4]) + b"\0\0\0\0" + b"ping"
        first = _heartbeat(2)
        fragments = (bytes([0x02, 0x80 | 5]) + b"\0\0\0\0" + first[:5]
                     + bytes([0x80, 0x80 | (len(first) - 5)]) + b"\0\0\0\0" + first[5:])
        ws.sock.sendall(RawWs.frame(_heartbeat(1)) + ping + fragments + RawWs.frame(_heartbeat(3)))
        seen: list[Any] = []
        for _ in range(4):
            opcode, payload = ws.recv_frame()
            seen.append(("pong", payload) if opcode == 0xA else msgpack.unpackb(payload)["id"])
        assert seen[0] == ("pong", b"ping"), seen  # answered inside the read, by websockets
        assert sorted(seen[1:]) == [1, 2, 3], seen
        assert _wires(inproc) == [True]
    finally:
        ws.close()


def test_frames_to_refuse_close_the_connection_as_websockets_does(inproc: InProcDaemon) -> None:
    cases = {
        1002: bytes([0x82, len(_heartbeat(1))]) + _heartbeat(1),  # unmasked
        1007: bytes([0x81, 0x80 | 2]) + b"\0\0\0\0" + b"\xff\xfe",  # not UTF-8 (JSON)
    }
    for code, data in cases.items():
        ws = RawWs(inproc.url, subprotocol="stepd.v1.json" if code == 1007 else "stepd.v1.msgpack")
        try:
            ws.sock.sendall(data)
            assert ws.close_code() == code
        finally:
            ws.close()
    ws = RawWs(inproc.url)
    try:  # over ws_max_size (max_body_bytes + 4 KiB): 1009, from the head alone
        ws.sock.sendall(bytes([0x82, 0x80 | 127]) + (64 << 20).to_bytes(8, "big") + b"\0\0\0\0")
        assert ws.close_code() == 1009
    finally:
        ws.close()
