"""`copy_in`, `copy_out` and `check_json` (transport/_json.py) give exactly what the JSON
round trip they replace gave: the same value, converted the same way, refused with the
same `Invalid` (or, for `check_json`, the same encoder error)."""

from __future__ import annotations

import collections
import enum
import json
from typing import Any

import pytest

from stepd.sansio.errors import Invalid
from stepd.transport._json import JSON_ENCODER, check_json, copy_in, copy_json, copy_out


class Color(enum.IntEnum):
    RED = 1


class Name(str, enum.Enum):
    X = "x"


SAME: list[Any] = [
    None, True, False, 0, -1, 2**64 - 1, -(2**63), 1.5, -0.0, 1e308, "", "é", "a\u2028b",
    [], {}, [1, (2, 3), {"a": [None, 1.25]}], (1, [2]), {"a": {"b": [1.0, "é", True]}},
    {1: "int key"}, {True: 1, None: 2, 2.5: 3}, Color.RED, [Color.RED], {"k": Name.X},
    collections.OrderedDict(a=1), {"é": {"ü": "ß"}}, [[[[[]]]]],
]

REFUSED: list[Any] = [
    float("nan"), float("inf"), [float("-inf")], {"a": b"bytes"}, 2**64, -(2**63) - 1,
    "\ud800", {"\udfff": 1}, {"a": ["x", "\ud800"]}, {1j: 1}, object(), {"s": {1, 2}},
]


@pytest.mark.parametrize("value", SAME, ids=repr)
@pytest.mark.parametrize("copy", [copy_in, copy_out])
def test_a_copy_is_what_the_json_round_trip_gave(copy: Any, value: Any) -> None:
    got, want = copy(value), copy_json(value)
    assert got == want and repr(got) == repr(want)
    assert type(got) is type(want)


@pytest.mark.parametrize("value", REFUSED, ids=repr)
def test_copy_in_refuses_what_the_json_round_trip_refused(value: Any) -> None:
    with pytest.raises(Invalid) as want:
        copy_json(value)
    with pytest.raises(Invalid) as got:
        copy_in(value)
    assert str(got.value) == str(want.value)


def test_a_copy_shares_no_container() -> None:
    value = {"a": [1, {"b": [2]}], "t": (3, [4])}
    for copy in (copy_in, copy_out):
        out = copy(value)
        assert out == {"a": [1, {"b": [2]}], "t": [3, [4]]}
        assert out is not value and out["a"] is not value["a"]
        assert out["a"][1] is not value["a"][1] and out["a"][1]["b"] is not value["a"][1]["b"]
        assert out["t"][1] is not value["t"][1]


def test_a_cycle_is_refused_as_before() -> None:
    loop: list[Any] = []
    loop.append(loop)
    with pytest.raises(Invalid, match="Circular reference"):
        copy_in(loop)


@pytest.mark.parametrize("value", SAME + REFUSED, ids=repr)
def test_check_json_raises_what_the_encoder_raises(value: Any) -> None:
    try:
        JSON_ENCODER.encode(value)
    except (TypeError, ValueError) as exc:
        with pytest.raises(type(exc)) as got:
            check_json(value)
        assert str(got.value) == str(exc)
    else:
        check_json(value)


def test_check_json_takes_a_decoded_msgpack_frame_in_a_few_calls() -> None:
    """A frame of JSON values costs the walk one call per container, no encoding."""
    import cProfile
    import pstats

    frame = {"op": "complete", "id": 7, "lease_id": "l_1", "output": {"xs": [1, 2]},
             "started": True}
    profile = cProfile.Profile()
    profile.enable()
    check_json(frame)
    profile.disable()
    calls = sum(v[1] for v in pstats.Stats(profile).stats.values())  # type: ignore[attr-defined]
    # check_json, a walk per container (3), items() per map (2), the profiler's disable().
    assert calls <= 7, calls
    assert json.loads(JSON_ENCODER.encode(frame)) == frame
