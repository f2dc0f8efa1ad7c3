"""A file written and fsynced with its directory entry: how the worker processes of the
campaign and the affinity tests count a body's run so that a SIGKILL cannot hide it."""

from __future__ import annotations

import os
from pathlib import Path


def write_synced(path: Path, text: str) -> None:
    """Create `path` (it must not exist) holding `text`; durable, name included, on return."""
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    try:
        os.write(fd, text.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
