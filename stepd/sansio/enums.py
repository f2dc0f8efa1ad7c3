"""`IdentityEnum`: the base of stepd's enums that sit on the hot path.

An Enum member is a singleton compared by identity, but `enum.Enum.__hash__`
hashes its name in a Python-level method. Enum members are dict keys and set
members on every step (operation specs, statuses, lease states): the daemon's
cProfile under bench B counted ~55 such hash calls per step. Hashing by
identity is consistent with Enum's identity equality and runs in C.

Likewise `Enum.value` is a property (two Python calls per read), and records,
leases and attempt specs store their statuses by value on every step: each
member also holds its value as a plain attribute, `text` (all of stepd's
enums have string values).
"""

from __future__ import annotations

import enum

__all__ = ["IdentityEnum"]


class IdentityEnum(enum.Enum):
    """An `enum.Enum` hashed by identity (same equality, a C-level hash)."""

    __hash__ = object.__hash__

    #: The member's value, read as a plain attribute (not `Enum.value`'s property).
    text: str

    def __init__(self, *args: object) -> None:
        self.text = self._value_
