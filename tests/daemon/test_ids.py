"""Ids: time-ordered and unique, also across a fork (the random bytes are pooled)."""

from __future__ import annotations

import os
import warnings

import pytest

from stepd.actors.daemon import ids


def test_ids_sort_in_the_order_they_were_made_across_pool_refills() -> None:
    # 200 ids use the pooled random bytes up several times over
    made = [ids.lease_id(1_000) for _ in range(200)]
    assert made == sorted(made)
    assert len(set(made)) == len(made)
    assert all(len(i) == 28 and i.startswith("l_") for i in made)


def _child_and_parent_ulid(time_ms: int) -> tuple[str, str]:
    """`ulid(time_ms)` made in a fork child, then in this process."""
    read_end, write_end = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # 3.12+: fork with threads
        pid = os.fork()
    if pid == 0:  # the child: report through the pipe only, never return
        try:
            os.write(write_end, ids.ulid(time_ms).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    try:
        child = os.read(read_end, 64).decode()
    finally:
        os.close(read_end)
        os.waitpid(pid, 0)
    return child, ids.ulid(time_ms)


def test_a_fork_child_does_not_reuse_the_parents_random_bytes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ids, "_last", 0)  # restored after: other tests' ids stay monotonic
    ids.ulid(1_000)  # the pool holds unused bytes now
    child, parent = _child_and_parent_ulid(2_000)
    # same millisecond, so only the 80 random bits tell them apart
    assert child[:10] == parent[:10]
    assert child != parent


def test_a_fork_child_does_not_continue_the_parents_sequence(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A clock behind the last id: the parent adds one to it; a child doing the same
    # would make the very same id.
    monkeypatch.setattr(ids, "_last", 3_000 << 80)
    child, parent = _child_and_parent_ulid(2_000)
    assert child != parent
    assert parent > child  # the parent's sequence goes on; the child's started anew
