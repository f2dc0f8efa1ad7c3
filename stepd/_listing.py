"""Run listings: `RunList` (`stepd.Client.list_runs`) and `AsyncRunList` (`stepd.AsyncClient`).

Both fetch pages of ``GET /v1/api/runs`` as the iteration goes; `list_query`
turns the filters into its query parameters.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, Self

from stepd import _wire
from stepd._runs import RunSummary
from stepd.sansio.canonical import canonical_json
from stepd.sansio.errors import Invalid

__all__ = ["AsyncRunList", "RunList", "check_size", "list_query"]


_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)
_ORDERS = ("desc", "asc")


def _created(value: int | str | datetime.datetime | None, field: str) -> int | str | None:
    """A ``created_after``/``created_before`` bound as the API takes it: epoch ms or ISO-8601."""
    if value is None:
        return None
    if isinstance(value, datetime.datetime):
        if value.tzinfo is None:  # local or UTC? refuse to guess
            raise Invalid("must be a timezone-aware datetime", field=field)
        return (value - _EPOCH) // datetime.timedelta(milliseconds=1)
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise Invalid("must be epoch ms (an int), an ISO-8601 string or an aware datetime",
                      field=field)
    return value


def check_size(value: int | None, field: str) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                              or value < 1):
        raise Invalid("must be an integer >= 1 or None", field=field)


def list_query(*, workflow: str | None, status: str | None,
                created_after: int | str | datetime.datetime | None,
                created_before: int | str | datetime.datetime | None, correlation: Any,
                idempotency_key: str | None, order: str | None) -> dict[str, Any]:
    """The filters of ``GET /v1/api/runs`` as query parameters (None: not sent).

    ``correlation`` travels as its canonical JSON (the form the daemon compares),
    so ``{"b": 1, "a": 2}`` and ``{"a": 2, "b": 1}`` find the same runs.

    Raises:
        Invalid: a bound, an order or a correlation the API cannot take.
    """
    if order is not None and order not in _ORDERS:
        raise Invalid("must be 'desc' or 'asc'", field="order")
    corr = None
    if correlation is not None:
        try:
            corr = canonical_json(correlation).decode()
        except Invalid as exc:
            raise Invalid(exc.message, field="correlation") from exc
    return {
        "workflow": workflow,
        "status": status,
        "created_after": _created(created_after, "created_after"),
        "created_before": _created(created_before, "created_before"),
        "correlation": corr,
        "idempotency_key": idempotency_key,
        "order": order,
    }


def _list_call(query: dict[str, Any], page_size: int, cursor: str | None) -> _wire.Call:
    base = _wire.list_runs(query["workflow"], query["status"], page_size, cursor)
    return dataclasses.replace(base, query={**base.query, **query})


class _Listing:
    """What both run listings share: the paging arithmetic and ``next_cursor``."""

    def __init__(self, query: dict[str, Any], limit: int | None, page_size: int | None,
                 cursor: str | None) -> None:
        self.next_cursor: str | None = cursor
        self._query = query
        self._left = limit
        self._page_size = min(page_size or _wire.LIST_PAGE_MAX, _wire.LIST_PAGE_MAX)
        self._buffer: collections.deque[dict[str, Any]] = collections.deque()
        self._started = False

    def _next_call(self) -> _wire.Call | None:
        """The next page to fetch, or None when the listing is over."""
        if self._left is not None and self._left <= 0:
            return None
        if self._started and self.next_cursor is None:
            return None
        self._started = True
        size = self._page_size if self._left is None else min(self._left, self._page_size)
        return _list_call(self._query, size, self.next_cursor)

    def _take(self, page: dict[str, Any]) -> None:
        runs = list(page["runs"])
        if self._left is not None:
            runs = runs[: self._left]  # never more than asked, even from a daemon that sends more
            self._left -= len(runs)
        self._buffer.extend(runs)
        self.next_cursor = page.get("next_cursor") or None


class RunList(_Listing, Iterator[RunSummary]):
    """What `Client.list_runs` returns: an iterator of `RunSummary` that fetches pages as it goes.

    A page may hold fewer runs than asked while more follow (the daemon bounds
    the work one page costs); the iterator keeps fetching until ``limit`` runs
    or the last one.

    Attributes:
        next_cursor: once the iteration has ended, the cursor of the runs after
            the last one yielded (pass it as ``cursor=`` to go on), or None when
            there are no more.
    """

    def __init__(self, send: Callable[[_wire.Call], dict[str, Any]], query: dict[str, Any],
                 limit: int | None, page_size: int | None, cursor: str | None) -> None:
        super().__init__(query, limit, page_size, cursor)
        self._send = send

    def __iter__(self) -> Self:
        return self

    def __next__(self) -> RunSummary:
        while not self._buffer:
            call = self._next_call()
            if call is None:
                raise StopIteration
            self._take(self._send(call))
        return RunSummary.from_json(self._buffer.popleft())


class AsyncRunList(_Listing, AsyncIterator[RunSummary]):
    """`RunList` for `AsyncClient`: ``async for run in client.list_runs(...)``."""

    def __init__(self, send: Callable[[_wire.Call], Awaitable[dict[str, Any]]],
                 query: dict[str, Any], limit: int | None, page_size: int | None,
                 cursor: str | None) -> None:
        super().__init__(query, limit, page_size, cursor)
        self._send = send

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> RunSummary:
        while not self._buffer:
            call = self._next_call()
            if call is None:
                raise StopAsyncIteration
            self._take(await self._send(call))
        return RunSummary.from_json(self._buffer.popleft())


