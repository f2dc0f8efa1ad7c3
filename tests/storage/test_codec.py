"""The msgpack codec: every msgpack type round-trips; the known lossy spots are pinned."""

from __future__ import annotations

import math
import threading

import msgpack  # type: ignore[import-untyped]  # no stubs published
import pytest
from hypothesis import given
from hypothesis import strategies as st

from stepd.storage import decode, encode

VALUES: list[object] = [
    None,
    True,
    False,
    0,
    -1,
    127,
    128,
    -33,
    2**63 - 1,
    -(2**63),
    2**64 - 1,
    0.0,
    -1.5,
    math.inf,
    1e308,
    "",
    "ascii",
    "ünïcødé ✓",
    "x" * 70_000,  # str 32
    b"",
    b"\x00\xff" * 10,
    bytes(range(256)) * 400,  # bin 32
    [],
    [1, "two", b"three", None, [4.0]],
    list(range(70_000)),  # array 32
    {},
    {"a": 1, "b": [1, 2, {"c": b"d"}]},
    {1: "int key", b"k": "bytes key"},  # strict_map_key=False
    {f"k{i}": i for i in range(70_000)},  # map 32
]


@pytest.mark.parametrize("value", VALUES, ids=lambda v: type(v).__name__)
def test_round_trip(value: object) -> None:
    assert decode(encode(value)) == value


def test_big_value_round_trips() -> None:
    big = {"blob": b"\xab" * (8 << 20), "items": [{"i": i, "s": str(i)} for i in range(10_000)]}
    assert decode(encode(big)) == big


def test_nan_round_trips() -> None:
    result = decode(encode(math.nan))
    assert isinstance(result, float) and math.isnan(result)


def test_tuples_come_back_as_lists() -> None:
    # Documented: msgpack has one array type.
    assert decode(encode((1, (2, 3)))) == [1, [2, 3]]


def test_bytes_and_str_stay_distinct() -> None:
    assert decode(encode([b"abc", "abc"])) == [b"abc", "abc"]
    assert isinstance(decode(encode(b"abc")), bytes)
    assert isinstance(decode(encode("abc")), str)


def test_unserialisable_value_raises_type_error() -> None:
    with pytest.raises(TypeError):
        encode(object())
    with pytest.raises(TypeError):
        encode({1, 2})


def test_int_beyond_64_bits_raises_overflow() -> None:
    with pytest.raises(OverflowError):
        encode(2**64)


def test_garbage_raises_value_error() -> None:
    with pytest.raises(ValueError):
        decode(b"\xc1")  # never used in msgpack


json_like = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False) | st.text() | st.binary(),
    lambda children: st.lists(children) | st.dictionaries(st.text() | st.integers(0, 99), children),
    max_leaves=30,
)


@given(json_like)
def test_round_trip_property(value: object) -> None:
    assert decode(encode(value)) == value


def test_a_failed_encode_leaves_the_next_one_whole() -> None:
    # encode reuses one Packer per thread: a value it refused halfway must not
    # leave bytes behind in the next one's output
    with pytest.raises(TypeError):
        encode({"a": [1, 2, object()]})
    with pytest.raises(OverflowError):
        encode(["x", 2**64])
    assert encode({"b": [1, "two"]}) == msgpack.packb({"b": [1, "two"]}, use_bin_type=True)


def test_threads_encoding_at_once_get_their_own_bytes() -> None:
    # the event loop's thread and the writer's both encode, each with its own Packer
    errors: list[str] = []

    def encode_many(n: int) -> None:
        for i in range(2_000):
            value = {"thread": n, "i": i, "pad": "x" * (i % 50)}
            if decode(encode(value)) != value:
                errors.append(f"thread {n} value {i}")
                return

    threads = [threading.Thread(target=encode_many, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
