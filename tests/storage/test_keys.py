"""Key encodings: byte order must equal the numeric / composite order."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stepd.storage import (
    U64_MAX,
    journal_key,
    journal_prefix,
    parse_journal_key,
    parse_timer_key,
    parse_u64be,
    prefix_end,
    timer_key,
    to_key,
    u64be,
)

u64 = st.integers(min_value=0, max_value=U64_MAX)
ids = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=40)


@given(u64, u64)
def test_u64_byte_order_is_numeric_order(a: int, b: int) -> None:
    assert (u64be(a) < u64be(b)) == (a < b)
    assert (u64be(a) == u64be(b)) == (a == b)


@given(u64)
def test_u64_round_trip(n: int) -> None:
    assert len(u64be(n)) == 8
    assert parse_u64be(u64be(n)) == n


@pytest.mark.parametrize("n", [-1, U64_MAX + 1])
def test_u64_out_of_range(n: int) -> None:
    with pytest.raises(ValueError, match="out of range"):
        u64be(n)


def test_parse_u64_needs_8_bytes() -> None:
    with pytest.raises(ValueError):
        parse_u64be(b"\x00" * 7)


@given(st.lists(st.tuples(ids, u64), min_size=2, max_size=30))
def test_journal_keys_sort_by_run_then_seq(entries: list[tuple[str, int]]) -> None:
    by_bytes = sorted(entries, key=lambda e: journal_key(*e))
    by_tuple = sorted(entries, key=lambda e: (e[0].encode(), e[1]))
    assert by_bytes == by_tuple


@given(ids, u64)
def test_journal_key_round_trip_and_prefix(run_id: str, seq: int) -> None:
    key = journal_key(run_id, seq)
    assert parse_journal_key(key) == (run_id, seq)
    assert key.startswith(journal_prefix(run_id))


def test_journal_runs_do_not_interleave() -> None:
    # run "a" must not share a prefix range with run "ab"
    assert not journal_key("ab", 0).startswith(journal_prefix("a"))
    assert journal_key("a", U64_MAX) < journal_key("ab", 0)


def test_ids_with_nul_are_refused() -> None:
    with pytest.raises(ValueError, match="NUL"):
        journal_key("a\x00b", 1)
    with pytest.raises(ValueError, match="NUL"):
        timer_key(1, "a\x00b", "t")
    for run_id in ("a\x00b", b"a\x00b"):  # a str takes its own path (`journal_prefix`)
        with pytest.raises(ValueError, match="NUL"):
            journal_prefix(run_id)
    assert journal_prefix("ab") == journal_prefix(b"ab") == b"ab\x00"


@given(st.lists(st.tuples(u64, ids, st.binary(max_size=10)), min_size=2, max_size=30))
def test_timer_keys_sort_by_due_time_first(timers: list[tuple[int, str, bytes]]) -> None:
    by_bytes = sorted(timers, key=lambda t: timer_key(*t))
    by_tuple = sorted(timers, key=lambda t: (t[0], t[1].encode() + b"\x00" + t[2]))
    assert by_bytes == by_tuple
    assert [t[0] for t in by_bytes] == sorted(t[0] for t in timers)


@given(u64, ids, st.binary(max_size=20))
def test_timer_key_round_trip(due: int, owner: str, tag: bytes) -> None:
    assert parse_timer_key(timer_key(due, owner, tag)) == (due, owner, tag)


def test_prefix_end() -> None:
    assert prefix_end(b"ab") == b"ac"
    assert prefix_end(b"a\xff") == b"b"
    assert prefix_end(b"\xff\xff") is None
    assert prefix_end(b"") is None


@given(st.binary(min_size=1, max_size=8), st.binary(max_size=8))
def test_prefix_end_bounds_the_prefix(prefix: bytes, rest: bytes) -> None:
    end = prefix_end(prefix)
    assert end is None or prefix + rest < end


def test_to_key() -> None:
    assert to_key("é") == "é".encode()
    assert to_key(b"x") == b"x"
    with pytest.raises(TypeError):
        to_key(1)  # type: ignore[arg-type]
