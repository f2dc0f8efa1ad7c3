"""A bare HTTP/1.1 keep-alive client for loading a daemon with runs (E).

Not the SDK: E only needs 100,000 runs to exist, as fast as the daemon takes
them, so it skips everything the SDK does per call (typed answers, retries).
It was written when `stepd.AsyncClient` went through httpx (~1.4 ms of CPU
per request at 100 in flight, ~700 starts/s at most); the SDK now has a lean
client of its own (`stepd/_http1.py`), and this one stays because it is
smaller still. Requests are JSON, answers parsed as JSON; a status >= 300
raises.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any
from urllib.parse import urlsplit


class LeanHttpError(Exception):
    pass


class LeanHttp:
    """`connections` persistent connections, one request at a time each."""

    def __init__(self, url: str, connections: int = 16) -> None:
        parts = urlsplit(url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self.size = connections
        self._idle: asyncio.Queue[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = asyncio.Queue()
        self._opened = 0

    async def _conn(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self._idle.empty() and self._opened < self.size:
            self._opened += 1
            return await asyncio.open_connection(self.host, self.port)
        return await self._idle.get()

    async def request(self, method: str, path: str, body: Any = None) -> Any:
        reader, writer = await self._conn()
        ok = False
        try:
            data = b"" if body is None else json.dumps(body).encode()
            head = (f"{method} {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                    f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n")
            writer.write(head.encode() + data)
            raw = await reader.readuntil(b"\r\n\r\n")
            lines = raw.decode("latin-1").split("\r\n")
            status = int(lines[0].split(" ", 2)[1])
            length = 0
            close = False
            for line in lines[1:]:
                name, _, value = line.partition(":")
                name = name.strip().lower()
                if name == "content-length":
                    length = int(value)
                elif name == "connection" and value.strip().lower() == "close":
                    close = True
            payload = await reader.readexactly(length) if length else b""
            ok = not close
        finally:
            if ok:
                self._idle.put_nowait((reader, writer))
            else:
                self._opened -= 1
                writer.close()
        answer = json.loads(payload) if payload else None
        if status >= 300:
            raise LeanHttpError(f"{method} {path}: {status} {answer}")
        return answer

    async def aclose(self) -> None:
        while not self._idle.empty():
            _, writer = self._idle.get_nowait()
            writer.close()
