"""The immutability check: cheap (a cached per-type verdict), shallow, clear."""

from __future__ import annotations

import dataclasses
import datetime
import decimal
import enum
import uuid
from typing import NamedTuple

import pytest

from stepd.actors import (
    ActorDead,
    ActorSystem,
    ChildSpec,
    ManualClock,
    MutableMessageError,
    check_message,
    is_immutable_type,
    register_immutable,
)
from stepd.actors._messages import _VERDICTS

from ._helpers import rec


@dataclasses.dataclass(frozen=True)
class Frozen:
    x: int


@dataclasses.dataclass
class Mutable:
    x: int


class Point(NamedTuple):
    x: int
    y: int


class Color(enum.Enum):
    RED = "red"


class LooseTuple(tuple):  # type: ignore[type-arg]
    """A tuple subclass whose instances take arbitrary attributes."""


class Plain:
    pass


@pytest.mark.parametrize(
    "message",
    [
        None,
        True,
        3,
        2.5,
        1j,
        "s",
        b"b",
        frozenset({1}),
        range(3),
        (1, "a"),
        (),
        Point(1, 2),
        Frozen(1),
        Color.RED,
        decimal.Decimal("1.5"),
        uuid.uuid4(),
        datetime.datetime(2024, 1, 1),
        datetime.timedelta(seconds=1),
        ...,
    ],
)
def test_immutable_messages_pass(message: object) -> None:
    check_message(message)


@pytest.mark.parametrize(
    "message",
    [{"a": 1}, [1], {1}, bytearray(b"x"), Mutable(1), Plain(), LooseTuple((1,)), lambda: None],
)
def test_mutable_messages_are_rejected_with_a_clear_type_error(message: object) -> None:
    with pytest.raises(MutableMessageError) as excinfo:
        check_message(message)
    assert isinstance(excinfo.value, TypeError)
    assert excinfo.value.message_type is type(message)
    assert type(message).__qualname__ in str(excinfo.value)
    assert "immutable" in str(excinfo.value)


def test_a_non_dataclass_subclass_of_a_frozen_dataclass_is_rejected() -> None:
    class Sub(Frozen):
        pass

    with pytest.raises(MutableMessageError):
        check_message(Sub(1))


def test_the_verdict_is_cached_per_type() -> None:
    @dataclasses.dataclass(frozen=True)
    class Fresh:
        x: int

    assert Fresh not in _VERDICTS
    check_message(Fresh(1))
    assert _VERDICTS[Fresh] is True
    assert is_immutable_type(Mutable) is False
    assert _VERDICTS[Mutable] is False


def test_register_immutable_admits_a_type() -> None:
    @register_immutable
    class Token:
        __slots__ = ("value",)

    check_message(Token())
    with pytest.raises(TypeError, match="class"):
        register_immutable(Token())  # type: ignore[arg-type]


async def test_every_way_in_checks_the_message() -> None:
    log: list[str] = []
    async with ActorSystem(clock=ManualClock()) as system:
        ref = await system.spawn(ChildSpec("a", rec("a", log)))
        with pytest.raises(MutableMessageError):
            await ref.tell({"k": "v"})
        with pytest.raises(MutableMessageError):
            ref.tell_nowait([1, 2])
        with pytest.raises(MutableMessageError):
            await ref.ask(Mutable(1))
        assert ref.statistics().mailbox_depth == 0
        # The check is shallow: a tuple holding a dict gets in, but arm_timer
        # checks the timer's message too, and the handler crashes on it.
        with pytest.raises(ActorDead) as excinfo:
            await ref.ask(("arm", "k", 1.0, {"mutable": True}))
        assert isinstance(excinfo.value.__cause__, MutableMessageError)


def test_a_dataclass_marked_immutable_passes_and_the_mark_alone_does_not() -> None:
    # `stepd.sansio.frozen`'s classes: frozen to the type checker, no run-time guard.
    @dataclasses.dataclass
    class Marked:
        __immutable__ = True
        x: int

    class MarkedPlain:
        __immutable__ = True

    @dataclasses.dataclass
    class Inherits(Marked):  # the mark is read off the class itself, not its bases
        y: int = 0

    check_message(Marked(1))
    for message in (MarkedPlain(), Inherits(1)):
        with pytest.raises(MutableMessageError):
            check_message(message)
