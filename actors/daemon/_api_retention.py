"""The daemon API, retention side: prune finished runs now, and the data directory's size
(see `api`, `retention`)."""

from __future__ import annotations

from typing import Any

from . import retention
from ._api_base import ApiBase

__all__ = ["RetentionOps"]

#: Runs one prune call deletes at most; the answer says whether more are left.
MAX_PRUNE: int = 100_000


class RetentionOps(ApiBase):
    """`Daemon`'s retention operations."""

    async def prune_runs(self, before_ms: int, *, key_before_ms: int | None = None,
                         limit: int = 10_000) -> dict[str, Any]:
        """Delete finished runs that ended before `before_ms`, a slice per transaction.

        Each slice commits on its own and the event loop turns between them, so
        a large prune delays other writes by one slice at most. Idempotency keys
        go with their runs if older than `key_before_ms` (default: `before_ms`).

        Returns:
            ``{"deleted": n, "more": bool}``: ``more`` when `limit` stopped it.
        """
        key_before = before_ms if key_before_ms is None else key_before_ms
        deleted = 0
        cursor: bytes | None = None
        while deleted < limit:
            done = await self.storage.write(retention.prune_txn, before_ms, key_before, cursor,
                                            min(retention.SLICE, limit - deleted))
            retention.counted_out(self.services, done)
            deleted += done.deleted
            cursor = done.cursor
            if cursor is None:
                break
        more = cursor is not None
        if not more:
            keys: bytes | None = None
            while True:
                _n, keys = await self.storage.write(retention.prune_keys_txn, key_before, keys)
                if keys is None:
                    break
        return {"deleted": deleted, "more": more}

    def data_dir_bytes(self) -> int:
        """What the data directory's files take on disk (``stepd_data_dir_bytes``)."""
        return retention.data_dir_bytes(self.storage.path)
