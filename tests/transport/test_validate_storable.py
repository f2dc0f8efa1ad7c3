"""What the storage could not hold is refused at the door with a 400, never a failed write later.

Found by schemathesis (docs/reliability.md): a lone surrogate in an output
stopped the daemon (its deferred write could not encode it), `1e400` made a
run unreadable (infinity cannot be written back as JSON), and a deadline of
2**53 ms made the run's status unprintable.
"""

from __future__ import annotations

import pytest

from stepd.sansio.definition import MAX_DURATION_MS, parse_definition
from stepd.sansio.errors import Invalid
from stepd.transport._json import copy_json, decode_json


@pytest.mark.parametrize("body", [
    b'{"output": "\\ud800"}',
    '{"output": {"k\\uDFFF": 1}}',
    b'{"x": 1e400}',
    b'{"x": -1e400}',
    b'{"x": 18446744073709551616}',
    b'{"x": NaN}',
])
def test_unstorable_json_is_invalid(body: bytes | str) -> None:
    with pytest.raises(Invalid):
        decode_json(body)


def test_storable_json_passes_including_surrogate_pairs() -> None:
    assert decode_json(b'{"ok": "\\ud83d\\ude00", "f": 1e300, "i": -9223372036854775808}') == {
        "ok": "\U0001f600", "f": 1e300, "i": -(2**63)}


def test_in_process_copies_refuse_what_http_refuses() -> None:
    with pytest.raises(Invalid):
        copy_json({"a": "\ud800"})
    with pytest.raises(Invalid):
        copy_json({"a": float("inf")})


def test_durations_are_bounded() -> None:
    base = {"name": "d", "steps": [{"id": "s", "kind": "sleep", "duration_ms": MAX_DURATION_MS}]}
    parse_definition(base)
    with pytest.raises(Invalid) as exc:
        parse_definition({**base, "deadline_ms": 2**53})
    assert exc.value.field == "deadline_ms"
    with pytest.raises(Invalid) as exc:
        parse_definition({"name": "d", "steps": [{"id": "s", "kind": "sleep", "duration_ms": MAX_DURATION_MS + 1}]})
    assert exc.value.field == "steps[0].duration_ms"
