"""The C-only paths of `stepd.transport._json` and the inline checks of claim and complete
bodies (`stepd.transport._validate`) decide exactly as the general paths do.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stepd.sansio.errors import Invalid
from stepd.transport._json import JSON_ENCODER, _scan_plain, decode_json, encode_json
from stepd.transport._validate import NO_BODY, parse_claim, parse_complete

_NOT_PLAIN = _scan_plain(b"")

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)


def _strict(data: bytes) -> Any:
    """What the general path answers: the value, or the Invalid's message."""
    try:
        return decode_json(bytearray(data))  # a bytearray never takes the C-only path
    except Invalid as exc:
        return f"Invalid: {exc}"


def _decoded(data: bytes) -> Any:
    try:
        return decode_json(data)
    except Invalid as exc:
        return f"Invalid: {exc}"


@settings(max_examples=300, deadline=None)
@given(json_values, st.sampled_from(["", " ", "\n\t", "x", "\x0b"]))
def test_the_c_only_parse_decides_as_the_general_one(value: Any, tail: str) -> None:
    data = (json.dumps(value, ensure_ascii=False) + tail).encode()
    assert repr(_decoded(data)) == repr(_strict(data))


@pytest.mark.parametrize("data", [
    b'{"a":1e400}', b'{"a":-1E+309}', b'[123456789012345678901]', b'{"a":18446744073709551616}',
    b'{"a":NaN}', b'[Infinity]', b'{"s":"\\ud800"}', b'{"a":1}x', b'{"a":1}\x0b',
    b'{"a":"\xff"}', b'[' * 100_000,
])
def test_what_the_c_only_parse_leaves_to_the_general_one(data: bytes) -> None:
    assert _scan_plain(data) is _NOT_PLAIN
    assert isinstance(_decoded(data), str) and _decoded(data).startswith("Invalid")


def test_utf16_is_left_to_the_general_parse() -> None:
    data = "{}".encode("utf-16-le")  # b'{\x00}\x00': json.loads reads it as UTF-16
    assert _scan_plain(data) is _NOT_PLAIN
    assert _decoded(data) == {} == json.loads(data)


@pytest.mark.parametrize("data", [b'{"a":1.5e99,"b":[1,2,3],"c":"\xc3\xa9"}\r\n', b'[]',
                                  b'{"k":"\\ud83d\\ude00"}', b'{"a":999999999999999999}',
                                  b'{"worker_id":"w_01KBE1234XY","x":2e300}'])
def test_the_c_only_parse_takes_the_common_bodies(data: bytes) -> None:
    expected = json.loads(data)
    assert _decoded(data) == expected
    if b"\\ud" not in data:
        assert _scan_plain(data) == expected


@settings(max_examples=200, deadline=None)
@given(json_values)
def test_answers_encode_as_the_encoder_object_does(value: Any) -> None:
    assert encode_json(value) == JSON_ENCODER.encode(value).encode()


def test_an_answer_that_is_not_json_is_refused() -> None:
    with pytest.raises(ValueError):
        encode_json({"a": float("nan")})
    with pytest.raises(TypeError):
        encode_json({"a": b"bytes"})


def _outcome(parse: Any, body: Any) -> Any:
    try:
        return parse(body)
    except Invalid as exc:
        return ("Invalid", exc.field, str(exc))


@pytest.mark.parametrize("body", [
    {"worker_id": "w_1", "max": 3.0, "wait_ms": 0.0}, {"worker_id": "w_1", "max": True},
    {"worker_id": "w_1", "max": 0}, {"worker_id": "w_1", "wait_ms": -1},
    {"worker_id": "w_1", "max": 5000}, {"worker_id": "x_1"}, {"worker_id": "w_" + "a" * 70},
    {"max": 1}, {"worker_id": "w_1", "mx": 1}, {"worker_id": "w_1", "run_id": "nope"},
    {"worker_id": 7}, [], NO_BODY,
])
def test_claim_bodies_off_the_common_shape(body: Any) -> None:
    got = _outcome(parse_claim, body)
    if isinstance(body, dict) and body.get("max") == 3.0:
        assert got == {"worker_id": "w_1", "max": 3, "wait_ms": 0, "run_id": None}
    elif isinstance(body, dict) and body.get("max") == 5000:
        assert got["max"] == 1000
    else:
        assert got[0] == "Invalid", got
    if body == {"worker_id": "w_1", "mx": 1}:
        assert got[1] == "mx"
    if body == {"worker_id": "w_1", "max": True}:
        assert got[1] == "max"


@pytest.mark.parametrize(("body", "field"), [
    ({"output": 1, "started": 1}, "started"), ({"output": 1, "started": None}, "started"),
    ({"output": 1, "state_patch": []}, "state_patch"), ({"output": 1, "spans": None}, "spans"),
    ({"output": 1, "spans": {}}, "spans"), ({"output": 1, "usage": 3}, "usage"),
    ({"output": 1, "extra": 1}, "extra"), ([1], None),
])
def test_complete_bodies_refused_name_their_field(body: Any, field: str | None) -> None:
    got = _outcome(parse_complete, body)
    assert got[0] == "Invalid" and got[1] == field, got


def test_a_complete_body_in_its_common_shape() -> None:
    assert parse_complete({"output": {"x": 1}, "started": True}) == {
        "output": {"x": 1}, "state_patch": None, "usage": None, "spans": [], "started": True}
    assert parse_complete({"output": None, "started": False, "state_patch": {"a": 1},
                           "usage": {"model": "m", "input_tokens": 1}}) == {
        "output": None, "state_patch": {"a": 1}, "usage": {"model": "m", "input_tokens": 1},
        "spans": []}
