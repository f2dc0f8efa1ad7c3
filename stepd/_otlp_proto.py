"""OTLP trace requests encoded straight from `SpanData`: protobuf bytes, no SDK objects.

The export's child process (`stepd._otel_child`) sends what this makes.
Going through the SDK (a ``ReadableSpan`` per span, then the exporter's
encoder building a protobuf message object per span, attribute and value)
cost the child about three quarters of its CPU per span (docs/otel.md, "What
export costs"); writing the wire format directly is a handful of byte
concatenations per field. The bytes decode to the same
``ExportTraceServiceRequest`` the SDK's encoder makes from the same spans
(``tests/otel/test_otlp_proto.py`` compares them field by field): span kind
INTERNAL, ``flags`` saying the parent is local, an always-present status.

Field numbers are those of opentelemetry-proto's ``trace/v1/trace.proto`` and
``common/v1/common.proto``. Pure: no OpenTelemetry import.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from stepd.sansio.trace import SpanData

__all__ = ["encode_attributes", "encode_request", "encode_scope", "encode_span"]

_NS_PER_MS = 1_000_000
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
_fixed64 = struct.Struct("<Q").pack
_double = struct.Struct("<d").pack
#: ``SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE_MASK``: the parent (or link) is known not to be remote.
_LOCAL_FLAGS = struct.pack("<I", 0x100)
_KIND_INTERNAL = b"\x30\x01"  # Span.kind (6, varint) = SPAN_KIND_INTERNAL


def _varint(n: int) -> bytes:
    if n < 0x80:
        return bytes((n,))
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


#: Varints of the lengths most fields have: a list index instead of a loop.
_LENGTHS = [_varint(n) for n in range(4096)]


def _field(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field: its tag, the payload's length, the payload."""
    n = len(payload)
    return tag + (_LENGTHS[n] if n < 4096 else _varint(n)) + payload


def _text(value: str) -> bytes:
    return value.encode("utf-8", "replace")


_MEMO_MAX = 4096
#: Attribute keys (few, repeated on every span), as their encoded ``KeyValue.key`` field.
_KEYS: dict[str, bytes] = {}
#: Short string values, many repeated (outcomes, step ids, worker names), as ``AnyValue``.
_STRINGS: dict[str, bytes] = {}


def _string_value(value: str) -> bytes:
    found = _STRINGS.get(value)
    if found is None:
        found = _field(b"\x0a", _text(value))
        if len(value) <= 64:
            if len(_STRINGS) >= _MEMO_MAX:
                _STRINGS.clear()
            _STRINGS[value] = found
    return found


def _any_value(value: Any) -> bytes:
    """An ``AnyValue`` (the types `stepd.sansio.trace.span_attributes` leaves, and maps)."""
    kind = type(value)
    if kind is str:
        return _string_value(value)
    if kind is int:
        if _INT64_MIN <= value <= _INT64_MAX:
            return b"\x18" + _varint(value & 0xFFFF_FFFF_FFFF_FFFF)
        return _string_value(str(value))  # past int64: its digits, not lost
    if kind is bool:
        return b"\x10\x01" if value else b"\x10\x00"
    if kind is float:
        return b"\x21" + _double(value)
    if value is None:
        return b""
    if isinstance(value, str):  # a str subclass (an enum): its text, as the SDK sends it
        return _field(b"\x0a", _text(value))
    if isinstance(value, bool):
        return b"\x10\x01" if value else b"\x10\x00"
    if isinstance(value, int):
        return _any_value(int(value))
    if isinstance(value, float):
        return b"\x21" + _double(value)
    if isinstance(value, bytes):
        return _field(b"\x3a", value)
    if isinstance(value, Mapping):
        return _field(b"\x32", b"".join(
            _field(b"\x0a", _key_value(str(k), v)) for k, v in value.items()))
    if isinstance(value, Sequence):
        return _field(b"\x2a", b"".join(_field(b"\x0a", _any_value(v)) for v in value))
    return _string_value(str(value))


def _key_value(key: str, value: Any) -> bytes:
    head = _KEYS.get(key)
    if head is None:
        head = _field(b"\x0a", _text(key))
        if len(_KEYS) >= _MEMO_MAX:
            _KEYS.clear()
        _KEYS[key] = head
    return head + _field(b"\x12", _any_value(value))


def encode_attributes(tag: bytes, attributes: Mapping[str, Any]) -> bytes:
    """Repeated ``KeyValue`` under field ``tag``."""
    return b"".join([_field(tag, _key_value(k, v)) for k, v in attributes.items()])


def encode_span(s: SpanData) -> bytes:
    """One ``Span`` message (without its field header)."""
    parts = [b"\x0a\x10", bytes.fromhex(s.trace_id), b"\x12\x08", bytes.fromhex(s.span_id)]
    if s.parent_span_id is not None:
        parts += (b"\x22\x08", bytes.fromhex(s.parent_span_id))
    parts += (
        _field(b"\x2a", _text(s.name)), _KIND_INTERNAL,
        b"\x39", _fixed64(s.start_ms * _NS_PER_MS), b"\x41", _fixed64(s.end_ms * _NS_PER_MS),
        encode_attributes(b"\x4a", s.attributes),
    )
    for name, at, attrs in s.events:
        parts.append(_field(b"\x5a", b"\x09" + _fixed64(at * _NS_PER_MS)
                            + _field(b"\x12", _text(name)) + encode_attributes(b"\x1a", attrs)))
    for trace_id, span_id in s.links:
        parts.append(_field(b"\x6a", b"\x0a\x10" + bytes.fromhex(trace_id) + b"\x12\x08"
                            + bytes.fromhex(span_id) + b"\x35" + _LOCAL_FLAGS))
    if s.error is None:
        parts.append(b"\x7a\x00")  # a status, UNSET
    else:
        parts.append(_field(b"\x7a", _field(b"\x12", _text(s.error)) + b"\x18\x02"))  # ERROR
    parts += (b"\x85\x01", _LOCAL_FLAGS)  # Span.flags (16, fixed32)
    return b"".join(parts)


def encode_scope(name: str, version: str | None) -> bytes:
    """An ``InstrumentationScope`` message."""
    return _field(b"\x0a", _text(name)) + (b"" if version is None
                                           else _field(b"\x12", _text(version)))


def encode_request(resource_attributes: Mapping[str, Any], scope: bytes,
                   spans: Iterable[SpanData], resource_schema_url: str = "") -> bytes:
    """An ``ExportTraceServiceRequest``: one resource, one scope, these spans."""
    scope_spans = _field(b"\x0a", scope) + b"".join(
        _field(b"\x12", encode_span(s)) for s in spans)
    resource = encode_attributes(b"\x0a", resource_attributes)
    resource_spans = (_field(b"\x0a", resource) + _field(b"\x12", scope_spans)
                      + (_field(b"\x1a", _text(resource_schema_url)) if resource_schema_url
                         else b""))
    return _field(b"\x0a", resource_spans)
