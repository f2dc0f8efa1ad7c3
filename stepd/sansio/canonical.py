"""Canonical JSON, the definition hash and the size of a run's state.

WORKFLOWS.md "version and definition_hash": the hash is the SHA-256 (hex) of the
canonical JSON of the definition without ``version``, keys sorted, no
insignificant whitespace, UTF-8, defaults filled in. WORKFLOWS.md "Budgets":
``max_state_bytes`` bounds the public state "encoded as canonical JSON". Both
use `canonical_json`, so one byte sequence means one value everywhere.

The encoding:

* object keys sorted by Unicode code point (Python's ``str`` order; this differs
  from RFC 8785's UTF-16 order only for keys mixing astral and high-BMP
  characters);
* separators ``,`` and ``:``, no other whitespace;
* UTF-8 text, non-ASCII characters written as themselves, not ``\\u`` escapes;
* integers as integers; floats in Python's shortest round-tripping ``repr``
  (``2.0`` stays ``2.0``: an integer-valued float is not an integer);
* only JSON values: ``dict`` with ``str`` keys, ``list``/``tuple``, ``str``, ``int``,
  ``float``, ``bool``, ``None``. NaN, infinities, non-``str`` keys, lone surrogates
  and every other type raise `Invalid`.

`canonical_json` runs on every state change, so it is ``json.dumps`` (the C
encoder) plus one pass over the containers to refuse non-``str`` keys, which
``json.dumps`` would otherwise turn into strings silently (``{1: x}`` would be
stored as an int key but measured and hashed as ``"1"``). That pass costs about
as much as the encoder; ``check_keys=False`` skips it for values whose keys are
already known to be strings.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from stepd.sansio.errors import Invalid

__all__ = [
    "canonical_json",
    "filled_definition_hash",
    "state_bytes",
]

_encode = json.JSONEncoder(
    skipkeys=False,
    ensure_ascii=False,
    check_circular=True,
    allow_nan=False,
    sort_keys=True,
    separators=(",", ":"),
).encode


def canonical_json(value: Any, *, check_keys: bool = True) -> bytes:
    """The canonical JSON encoding of a JSON value (see the module docstring).

    Args:
        value: a JSON value built from dict (str keys), list, tuple, str, int,
            float, bool and None.
        check_keys: walk the containers to refuse non-``str`` keys. The walk
            costs about as much as the encoding itself; pass False only for a
            value known to have string keys (decoded from JSON, or from msgpack
            with ``strict_map_key=True``, whose ``bytes`` keys the encoder refuses
            anyway). Everything else is checked either way.

    Returns:
        UTF-8 bytes.

    Raises:
        Invalid: the value holds something JSON cannot carry or that would not
            round-trip (NaN, infinity, a non-``str`` key, a lone surrogate, a
            ``set``, ``bytes``, any other object). ``field`` is None: the caller
            knows what the value was.
    """
    try:
        encoded = _encode(value)
    except ValueError as exc:  # NaN/Infinity with allow_nan=False, or a cycle
        raise Invalid(f"not canonical JSON: {exc}") from exc
    except TypeError as exc:  # a set, bytes, an object...
        raise Invalid(f"not canonical JSON: {exc}") from exc
    if check_keys:
        # After the encoder, which has refused cycles, so this walk terminates.
        _check_keys(value)
    try:
        return encoded.encode("utf-8")
    except UnicodeEncodeError as exc:  # a lone surrogate in a string
        raise Invalid("not canonical JSON: a string holds a lone surrogate") from exc


_CONTAINERS = (dict, list, tuple)


def _check_keys(value: Any) -> None:
    """Refuse dict keys that are not ``str`` (json.dumps would stringify them).

    Only containers are pushed: scalars were type-checked by the C encoder.
    """
    if not isinstance(value, _CONTAINERS):
        return
    stack = [value]
    pop = stack.pop
    push = stack.append
    while stack:
        item = pop()
        if isinstance(item, dict):
            for key in item:
                if key.__class__ is not str and not isinstance(key, str):
                    raise Invalid(f"not canonical JSON: object key {key!r} is not a string")
            for child in item.values():
                if isinstance(child, _CONTAINERS):
                    push(child)
        else:
            for child in item:
                if isinstance(child, _CONTAINERS):
                    push(child)


def state_bytes(state: Any, *, check_keys: bool = True) -> int:
    """The size of a run's public state: its canonical JSON byte length.

    WORKFLOWS.md "Budgets", ``max_state_bytes``: "size of the run's public state,
    encoded as canonical JSON". ``check_keys`` as in `canonical_json`.

    Raises:
        Invalid: the state is not a JSON value (see `canonical_json`).
    """
    return len(canonical_json(state, check_keys=check_keys))


def filled_definition_hash(filled: Mapping[str, Any]) -> str:
    """The hash of a definition already in filled wire form (`Definition.to_json`).

    Drops ``version`` and hashes the rest as is. Use it only on the output of
    `Definition.to_json`; for anything else use `definition.definition_hash`, which parses
    and fills defaults first so omitted defaults and int/float spellings of
    ``backoff_factor`` cannot change the hash.

    Raises:
        Invalid: the mapping is not a JSON value.
    """
    body = {key: value for key, value in filled.items() if key != "version"}
    return hashlib.sha256(canonical_json(body)).hexdigest()
