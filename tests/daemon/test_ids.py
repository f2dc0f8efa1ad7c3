"""Ids: time-ordered and unique, also across a fork (the random bytes are pooled)."""

from __future__ import annotations

import os
import warnings

from stepd.actors.daemon import ids


def test_ids_sort_in_the_order_they_were_made_across_pool_refills() -> None:
    # 200 ids use the pooled random bytes up several times over
    made = [ids.lease_id(1_000) for _ in range(200)]
    assert made == sorted(made)
    assert len(set(made)) == len(made)
    assert all(len(i) == 28 and i.startswith("l_") for i in made)


def test_a_fork_child_does_not_reuse_the_parents_random_bytes() -> None:
    ids.ulid(1_000)  # the pool holds unused bytes now
    read_end, write_end = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # 3.12+: fork with threads
        pid = os.fork()
    if pid == 0:  # the child: report through the pipe only, never return
        try:
            os.write(write_end, ids.ulid(2_000).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    try:
        child = os.read(read_end, 64).decode()
    finally:
        os.close(read_end)
        os.waitpid(pid, 0)
    parent = ids.ulid(2_000)
    # same millisecond, so only the 80 random bits tell them apart
    assert child[:10] == parent[:10]
    assert child != parent
