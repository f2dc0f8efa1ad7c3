"""The web console's static files at ``/ui/`` (``transport/console/``, docs/console.md).

Read once from the package, served by exact name (no directory listing, no
path from the request ever reaches the file system), with a strict
``Content-Security-Policy`` and an ``ETag`` (``304`` when it matches).
"""

from __future__ import annotations

import functools
import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from importlib.abc import Traversable
from pathlib import Path
from typing import Final

from ._asgi import JSON_HEADER, Scope, Send, header, send_response
from ._json import encode_json

__all__ = ["CONSOLE_CSP", "CONSOLE_DIR", "CONTENT_TYPES", "Asset", "console_assets", "send_asset",
           "send_redirect"]

CONSOLE_DIR: Final = "console"
"""The console's static files: ``transport/console/``, package data of ``stepd.transport``."""

CONTENT_TYPES: Final[Mapping[str, str]] = {
    ".html": "text/html; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
}
"""The only files served, by suffix: anything else in the folder is never sent."""

CONSOLE_CSP: Final = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; font-src 'self'; object-src 'none'; base-uri 'none'; "
    "form-action 'self'; frame-ancestors 'none'; "
    "require-trusted-types-for 'script'; trusted-types 'none'"
)
"""The console's Content-Security-Policy: its own files only, no inline script or
style, no frames; and (Trusted Types, where the browser has them) no string ever
reaches an HTML sink such as ``innerHTML``: it throws instead."""

_UI_HEADERS: Final[tuple[tuple[bytes, bytes], ...]] = (
    (b"content-security-policy", CONSOLE_CSP.encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"x-frame-options", b"DENY"),
    (b"cross-origin-opener-policy", b"same-origin"),
    (b"cross-origin-resource-policy", b"same-origin"),
)
_UI_CACHE: Final = (b"cache-control", b"no-cache")
_ASSET_NAME: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*(\.[A-Za-z0-9_-]+)*")


@dataclass(frozen=True, slots=True)
class Asset:
    """One file of the console, as served."""

    body: bytes
    content_type: str
    etag: bytes


def _console_root() -> Traversable:
    root = resources.files(__package__).joinpath(CONSOLE_DIR)
    if root.is_dir():
        return root
    # A strict editable install links only declared files: use the folder itself.
    return Path(__file__).resolve().parent / CONSOLE_DIR


@functools.cache
def console_assets() -> Mapping[str, Asset]:
    """The console's files by name (``index.html``, ``js/run.js``), read once.

    Only files whose every path segment is a plain name (letters, digits,
    ``_``, ``-``, dots between them: no dotfile, no ``..``) and whose suffix is
    in `CONTENT_TYPES` are kept. A request is answered from this mapping by
    exact name, so nothing in a request path reaches the file system.
    """
    assets: dict[str, Asset] = {}

    def walk(folder: Traversable, prefix: str) -> None:
        for entry in sorted(folder.iterdir(), key=lambda e: e.name):
            if not _ASSET_NAME.fullmatch(entry.name):
                continue
            if entry.is_dir():
                walk(entry, f"{prefix}{entry.name}/")
                continue
            ctype = CONTENT_TYPES.get(Path(entry.name).suffix)
            if ctype is None:
                continue
            body = entry.read_bytes()
            etag = f'"{hashlib.sha256(body).hexdigest()[:32]}"'.encode()
            assets[prefix + entry.name] = Asset(body, ctype, etag)

    root = _console_root()
    if root.is_dir():
        walk(root, "")
    return assets


def _etag_matches(value: bytes | None, etag: bytes) -> bool:
    if value is None:
        return False
    tags = [t.strip().removeprefix(b"W/") for t in value.split(b",")]
    return etag in tags or b"*" in tags


async def send_asset(scope: Scope, send: Send, name: str | None) -> int:
    """One console file; 404 for any name that is not exactly one of them."""
    asset = console_assets().get(name) if name else None
    if asset is None:
        body = encode_json({"error": "not_found", "message": "no such file in the console"})
        await send_response(send, 404, body, [JSON_HEADER, *_UI_HEADERS])
        return 404
    headers = [(b"etag", asset.etag), _UI_CACHE, *_UI_HEADERS]
    if _etag_matches(header(scope, b"if-none-match"), asset.etag):
        await send({"type": "http.response.start", "status": 304, "headers": headers})
        await send({"type": "http.response.body", "body": b""})
        return 304
    headers += [(b"content-type", asset.content_type.encode()),
                (b"content-length", str(len(asset.body)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body",
                "body": b"" if scope["method"] == "HEAD" else asset.body})
    return 200


async def send_redirect(send: Send) -> int:
    """``/ui`` -> ``/ui/``: /ui/ is the page, so its relative links (./app.js) resolve under it."""
    await send_response(send, 308, b"", [(b"location", b"/ui/"), _UI_CACHE, *_UI_HEADERS])
    return 308
