"""`frozen`: a frozen dataclass to the type checker, a plain slotted one at run time.

Why: a frozen dataclass's generated ``__init__`` sets each field through
``object.__setattr__`` (the guard that makes assignment raise), ~90 ns a field
on CPython 3.11 against ~15 for a plain one: an eight-field message costs
~850 ns to build instead of ~150. The daemon builds ~17 frozen messages a
step (events into the machines, actions out, actor messages, replies), ~100
fields in all (bench/README.md, "Frozen messages, checked by mypy").

What stays: immutability is a contract between the machines and the actors
that `mypy --strict` checks, and it sees these classes frozen
(`dataclass_transform(frozen_default=True)`): an assignment to a field is a
type error, as before. Equality and hashing are the frozen dataclass's
(``unsafe_hash=True`` makes the same ``__hash__`` over the fields). What goes:
only the run-time guard, which no code path of ours relies on. The actors'
message check (`stepd.actors._messages`) takes the class's ``__immutable__``
mark for the guard.
"""

from __future__ import annotations

import dataclasses
from typing import TypeVar, dataclass_transform

__all__ = ["frozen"]

T = TypeVar("T")


@dataclass_transform(frozen_default=True)
def frozen(cls: type[T]) -> type[T]:
    """``@dataclass(frozen=True, slots=True)`` as mypy sees it; at run time without
    the assignment guard (the module docstring says why)."""
    made = dataclasses.dataclass(slots=True, unsafe_hash=True)(cls)
    made.__immutable__ = True  # type: ignore[attr-defined]  # read by the actors' message check
    return made
