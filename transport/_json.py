"""Strict JSON for every transport: what a request body may hold, and how answers are encoded.

A bad value is refused here, with a 400, never by a failed storage write later:
no ``NaN``/``Infinity``, no integer outside what the storage codec (msgpack)
holds, no number that overflows a double, no lone surrogate. Split out of
`transport._validate` (which checks the shape of each body) so each holds one
thing.
"""

from __future__ import annotations

import json
import json.encoder
import math
import re
from typing import Any, Final

from stepd.sansio.errors import Invalid

__all__ = ["JSON_ENCODER", "JSON_INT_MAX", "JSON_INT_MIN", "check_json", "copy_in", "copy_json",
           "copy_out", "decode_json", "encode_json"]


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


JSON_INT_MIN: Final = -(2**63)
JSON_INT_MAX: Final = 2**64 - 1


def _stored_int(text: str) -> int:
    # The storage codec (msgpack) holds integers from -2**63 to 2**64-1; one
    # outside that range would fail the write that stores it (and a failed
    # deferred write stops the daemon), so it is refused here, with a 400.
    value = int(text)
    if not JSON_INT_MIN <= value <= JSON_INT_MAX:
        shown = text if len(text) <= 24 else text[:24] + "..."
        raise ValueError(f"integer {shown} is out of range (-2**63 to 2**64-1)")
    return value


#: Only an integer of 19 digits or more can fall outside that range (10**18 - 1
#: is below 2**63): a document with no such run of digits anywhere is parsed
#: without the per-integer check (one regex scan instead of a call per number).
_NINETEEN_DIGITS: Final = re.compile(r"[0-9]{19}")
_NINETEEN_DIGITS_B: Final = re.compile(rb"[0-9]{19}")


def _int_hook(text: str | bytes | bytearray) -> Any:
    """`parse_int` for `json.loads`: the range check, or None (plain int) when it cannot fail.

    Bytes holding a NUL may be UTF-16 or UTF-32 (which `json.loads` accepts),
    whose digits are not adjacent bytes: those are always checked.
    """
    if isinstance(text, str):
        long_digits = _NINETEEN_DIGITS.search(text) is not None
    else:
        long_digits = b"\0" in text or _NINETEEN_DIGITS_B.search(text) is not None
    return _stored_int if long_digits else None


def _finite_float(text: str) -> float:
    # `1e400` parses as infinity, which JSON cannot carry back out (the run
    # would become unreadable): refused like the NaN/Infinity literals.
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"number {text[:24]} is out of range for a double")
    return value


def _check_strings(value: Any) -> None:
    """Refuse lone surrogates (``"\\ud800"``): they cannot be stored as UTF-8."""
    if isinstance(value, str):
        value.encode("utf-8")
    elif isinstance(value, dict):
        for k, v in value.items():
            k.encode("utf-8")
            _check_strings(v)
    elif isinstance(value, list):
        for v in value:
            _check_strings(v)


_PLAIN_SCAN: Final[Any] = json.JSONDecoder(  # type: ignore[attr-defined]
    parse_constant=_refuse_constant).scan_once
"""The C scanner with no Python hook but the one for ``NaN``/``Infinity``: for a
document in which no number can fall out of range (`_LONG_RUN`, `_RISKY`)."""

#: An integer out of range has 19 digits in a row (10**18 - 1 is below 2**63): a
#: document with such a run anywhere (in a string too) takes the general path.
_LONG_RUN: Final = re.compile(rb"[0-9]{19}")
#: Either that, or what a double overflowing to infinity needs: an exponent of three
#: digits or more (a mantissa of 309 digits holds 19 in a row). An exponent-like run
#: also matches inside strings (``"w_01KBE1234..."``), so it only asks for a check of
#: the value parsed (`_C_ENCODE` refuses an infinity), not for the general path.
_RISKY: Final = re.compile(rb"[0-9]{19}|[0-9][eE][+-]?[0-9]{3}")


def _scan_plain(data: bytes) -> Any:
    """`decode_json`'s common case in C calls only: a UTF-8 object or array, no number
    that could be out of range, no ``\\u`` escape of a surrogate. Returns `_NOT_PLAIN`
    for anything else (or any error: the general path says exactly what is wrong)."""
    if not data or data[0] not in b"{[" or b"\\ud" in data or b"\\uD" in data:
        return _NOT_PLAIN
    risky = _RISKY.search(data) is not None  # one scan for both, in the common case
    if risky and _LONG_RUN.search(data) is not None:
        return _NOT_PLAIN
    try:
        text = data.decode()
        value, end = _PLAIN_SCAN(text, 0)
    except (UnicodeDecodeError, ValueError, StopIteration, RecursionError):
        return _NOT_PLAIN
    if end != len(text) and text[end:].strip(" \t\n\r"):
        return _NOT_PLAIN  # JSON's whitespace only; anything else is the general path's error
    if risky and _C_ENCODE is not None:
        try:
            _C_ENCODE(value, 0)
        except (ValueError, RecursionError):
            return _NOT_PLAIN  # 1e400: infinity, which the general path refuses by name
    return value


_NOT_PLAIN: Final[Any] = object()


def decode_json(data: bytes | str) -> Any:
    """Parse a JSON document strictly: no ``NaN``/``Infinity``, no number or
    string the storage could not hold (so a bad value is a 400 here, never a
    failed write later).

    Raises:
        Invalid: not UTF-8, not JSON (``field`` None; the message says where).
    """
    if type(data) is bytes:
        value = _scan_plain(data)
        if value is not _NOT_PLAIN:
            return value
    try:
        value = json.loads(data, parse_constant=_refuse_constant, parse_int=_int_hook(data),
                           parse_float=_finite_float)
        # A lone surrogate can only come from a \u escape: look only then.
        if ("\\ud" in data or "\\uD" in data) if isinstance(data, str) else (
                b"\\ud" in data or b"\\uD" in data):
            _check_strings(value)
        return value
    except UnicodeEncodeError:
        raise Invalid("the body is not valid JSON: a string holds a lone surrogate "
                      "(\\ud800-\\udfff without its pair)") from None
    except UnicodeDecodeError as exc:
        raise Invalid(f"the body is not UTF-8: {exc.reason} at byte {exc.start}") from None
    except ValueError as exc:  # json.JSONDecodeError is a ValueError
        raise Invalid(f"the body is not valid JSON: {exc}") from None
    except RecursionError:
        raise Invalid("the body is not valid JSON: nested too deeply") from None


JSON_ENCODER: Final = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def _not_json(value: Any) -> Any:
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


_c_make_encoder: Any = getattr(json.encoder, "c_make_encoder", None)
_C_ENCODE: Final[Any] = None if _c_make_encoder is None else _c_make_encoder(
    None, _not_json, getattr(json.encoder, "c_encode_basestring", None), None, ":", ",",
    False, False, False)
"""`JSON_ENCODER` without its Python layers (``encode`` -> ``iterencode`` -> the C
encoder): one C call per answer. Without the cycle check: an answer is a fresh tree
the daemon built (a cycle would be a bug; it surfaces as a RecursionError)."""


def encode_json(value: Any) -> bytes:
    """Encode an answer as compact UTF-8 JSON (``NaN`` and infinities refused)."""
    if _C_ENCODE is None:  # pragma: no cover - CPython ships the C encoder
        return JSON_ENCODER.encode(value).encode("utf-8")
    return "".join(_C_ENCODE(value, 0)).encode("utf-8")


def copy_json(value: Any) -> Any:
    """A deep copy through JSON: what crosses a transport never shares a dict.

    Raises:
        Invalid: ``value`` is not JSON (bytes, NaN, a non-string key...).
    """
    try:
        text = JSON_ENCODER.encode(value)
        text.encode("utf-8")  # a lone surrogate cannot be stored
        return json.loads(text, parse_int=_int_hook(text))
    except UnicodeEncodeError:
        raise Invalid("not JSON: a string holds a lone surrogate") from None
    except (TypeError, ValueError) as exc:
        raise Invalid(f"not JSON: {exc}") from None


# -- in-process copies without the text (the embedded daemon, `transport.inprocess`) ------------
#
# `copy_json` costs ~20 calls per value (an encoder, a decoder, a parse hook, a
# regex scan); the embedded daemon copies three values per step (the complete's
# body in, its answer out, the next lease out). The walks below give the same
# value for the JSON a body holds in practice (exact dicts with string keys,
# lists, tuples, strings, ints, floats, bools, None) at one call per container
# and one per string: anything else (a subclass, a key that is not a string, a
# non-finite float, an integer out of range, a lone surrogate, a cycle) takes
# `copy_json`'s path, so a value is copied, converted or refused exactly as before.


class _Unusual(Exception):
    """Internal: the walk met what only `copy_json` converts or refuses the right way."""


def copy_in(value: Any) -> Any:
    """`copy_json` of a value entering the daemon in process (a request body), without encoding.

    Raises:
        Invalid: ``value`` is not JSON (as `copy_json` says).
    """
    try:
        return _walk(value, True)
    except (_Unusual, UnicodeEncodeError, RecursionError):
        return copy_json(value)


def copy_out(value: Any) -> Any:
    """`copy_json` of a value leaving the daemon in process (an answer, a pushed lease).

    Its strings are not re-checked for lone surrogates: every string the daemon
    holds came in through `copy_in`/`decode_json`, or out of storage, as UTF-8.
    """
    try:
        return _walk(value, False)
    except (_Unusual, RecursionError):
        return copy_json(value)


def check_json(value: Any) -> None:
    """Raise what ``JSON_ENCODER.encode(value)`` raises (TypeError, ValueError), and
    nothing else: a decoded msgpack frame holds only JSON values (the WebSocket).

    The walk takes a call per container where the encoder takes ~5 per value;
    what it does not handle alone is encoded, as before. Strings are not
    looked at (the encoder does not either).
    """
    try:
        _walk(value, False)
    except (_Unusual, RecursionError):
        JSON_ENCODER.encode(value)


def _walk(value: Any, strings: bool) -> Any:
    """A container rebuilt (a tuple as a list), its scalars kept; `_Unusual` for the rest.

    The checks are written out in both loops: a call per scalar would cost what
    the walk saves.
    """
    t = type(value)
    if t is dict:
        out: dict[str, Any] = {}
        for k, x in value.items():
            if type(k) is not str or (strings and not k.isascii()):
                raise _Unusual  # JSON turns 1 into "1"; a non-ASCII key is checked there
            tx = type(x)
            if tx is str:
                if strings and not x.isascii():
                    x.encode("utf-8")  # a lone surrogate: UnicodeEncodeError
            elif tx is int:
                if not JSON_INT_MIN <= x <= JSON_INT_MAX:
                    raise _Unusual
            elif tx is float:
                if x - x != 0.0:  # NaN or an infinity
                    raise _Unusual
            elif x is not None and tx is not bool:
                x = _walk(x, strings)
            out[k] = x
        return out
    if t is list or t is tuple:
        items = list(value)
        for i, x in enumerate(items):
            tx = type(x)
            if tx is str:
                if strings and not x.isascii():
                    x.encode("utf-8")
            elif tx is int:
                if not JSON_INT_MIN <= x <= JSON_INT_MAX:
                    raise _Unusual
            elif tx is float:
                if x - x != 0.0:
                    raise _Unusual
            elif x is not None and tx is not bool:
                items[i] = _walk(x, strings)
        return items
    if t is str:
        if strings and not value.isascii():
            value.encode("utf-8")
        return value
    if t is int:
        if JSON_INT_MIN <= value <= JSON_INT_MAX:
            return value
        raise _Unusual
    if t is float:
        if value - value == 0.0:
            return value
        raise _Unusual
    if value is None or t is bool:
        return value
    raise _Unusual
