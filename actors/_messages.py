"""The immutability check every message passes on its way into a mailbox.

Messages cross from one actor's task to another's; a mutable one would let two
actors share state behind the runtime's back. The check is deliberately
*shallow and per type*: a type's verdict is computed once and cached, so the
hot path is one dict lookup. It accepts

* immutable scalars: None, bool, int, float, complex, str, bytes, frozenset,
  range, Decimal, Fraction, UUID, the datetime types, Ellipsis;
* Enum members;
* tuples and tuple subclasses without an instance ``__dict__`` (so
  NamedTuples, but not a plain subclass that allows extra attributes);
* frozen dataclasses (declared ``frozen=True`` on the class itself), and
  dataclasses that declare ``__immutable__ = True`` on the class itself (frozen
  by a type checker's contract rather than by a run-time guard:
  `stepd.sansio.frozen`);
* types registered with `register_immutable` (attrs or msgspec frozen classes,
  for instance).

It does not look inside: a tuple holding a list passes. Deep checks would cost
time proportional to the message on every send.
"""

from __future__ import annotations

import dataclasses
import datetime
import decimal
import enum
import fractions
import uuid

from ._errors import MutableMessageError

__all__ = ["check_message", "is_immutable_type", "register_immutable"]

_VERDICTS: dict[type, bool] = {
    t: True
    for t in (
        type(None),
        bool,
        int,
        float,
        complex,
        str,
        bytes,
        frozenset,
        range,
        type(Ellipsis),
        decimal.Decimal,
        fractions.Fraction,
        uuid.UUID,
        datetime.date,
        datetime.datetime,
        datetime.time,
        datetime.timedelta,
        datetime.timezone,
    )
}
_VERDICTS.update({t: False for t in (list, dict, set, bytearray, memoryview)})
#: The types judged immutable so far: what the hot paths test (``type(m) in
#: _IMMUTABLE`` is no call at all; `check_message` handles the rest).
_IMMUTABLE: set[type] = {t for t, ok in _VERDICTS.items() if ok}


def _judge(t: type) -> bool:
    if issubclass(t, enum.Enum):
        return True
    if issubclass(t, tuple):
        # NamedTuples declare __slots__ = (); a plain subclass has a __dict__.
        return t.__dictoffset__ == 0
    params = t.__dict__.get("__dataclass_params__")
    if params is not None and dataclasses.is_dataclass(t):
        return bool(params.frozen) or t.__dict__.get("__immutable__") is True
    return False


def is_immutable_type(t: type) -> bool:
    """Return whether messages of type `t` pass the check (and cache the verdict)."""
    verdict = _VERDICTS.get(t)
    if verdict is None:
        verdict = _VERDICTS[t] = _judge(t)
        if verdict:
            _IMMUTABLE.add(t)
    return verdict


def register_immutable(t: type) -> type:
    """Declare that instances of `t` are immutable, so they may be sent.

    For types the built-in rules cannot recognise (attrs ``frozen=True``
    classes, msgspec frozen Structs, your own slotted value types). Usable as a
    class decorator.

    Returns:
        `t`, unchanged.

    Raises:
        TypeError: if `t` is not a class.
    """
    if not isinstance(t, type):
        raise TypeError(f"register_immutable() takes a class, got {t!r}")
    _VERDICTS[t] = True
    _IMMUTABLE.add(t)
    return t


def check_message(message: object) -> None:
    """Reject a message whose type is not known to be immutable.

    Raises:
        MutableMessageError: the message's type is mutable (a dict, a list, a
            non-frozen dataclass, an ordinary class instance, ...).
    """
    if not is_immutable_type(type(message)):
        raise MutableMessageError(type(message))
