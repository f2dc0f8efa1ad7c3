"""`stepd.sansio.frozen`: what a frozen dataclass is to mypy and to the actors, without
the run-time guard that makes it slow to build (bench/README.md, "Frozen messages")."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from stepd.actors import check_message
from stepd.sansio.events import AttemptSpec, AttemptStarted
from stepd.sansio.frozen import frozen


@frozen
class Pair:
    a: int
    b: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class FrozenPair:
    a: int
    b: tuple[str, ...] = ()


def test_equality_hashing_and_slots_are_a_frozen_dataclass_s() -> None:
    assert Pair(1, ("x",)) == Pair(1, ("x",)) != Pair(2)
    assert hash(Pair(1, ("x",))) == hash(Pair(1, ("x",))) == hash(FrozenPair(1, ("x",)))
    assert {Pair(1), Pair(1)} == {Pair(1)}
    assert vars(Pair)["__slots__"] == vars(FrozenPair)["__slots__"] == ("a", "b")
    assert not hasattr(Pair(1), "__dict__")
    assert dataclasses.replace(Pair(1), b=("y",)) == Pair(1, ("y",))
    assert [f.name for f in dataclasses.fields(Pair)] == ["a", "b"]


def test_the_actors_take_it_as_immutable() -> None:
    check_message(Pair(1))
    check_message(AttemptStarted(step_id="s", item_index=None, fence=1))


def test_the_run_time_guard_is_gone_on_purpose() -> None:
    # What was bought: no `object.__setattr__` per field in `__init__`. The price:
    # an assignment is not refused at run time; mypy refuses it (next test).
    p = Pair(1)
    p.a = 2  # type: ignore[misc]
    assert p.a == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        FrozenPair(1).a = 2  # type: ignore[misc]


def test_mypy_sees_the_messages_frozen(tmp_path: Path) -> None:
    # The contract the run-time guard gave, now checked statically: an assignment to
    # a field of a message is a type error, and so is one to a `@frozen` class of
    # one's own.
    snippet = tmp_path / "assign.py"
    snippet.write_text(textwrap.dedent("""
        from stepd.sansio.events import AttemptSpec
        from stepd.sansio.frozen import frozen

        @frozen
        class Mine:
            x: int

        def f(spec: AttemptSpec, mine: Mine) -> None:
            spec.attempt = 2
            mine.x = 3
    """))
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-incremental", "--cache-dir=/dev/null",
         str(snippet)],
        cwd=root, capture_output=True, text=True, timeout=300, check=False,
    )
    assert out.returncode == 1, out.stdout + out.stderr
    assert 'Property "attempt" defined in "AttemptSpec" is read-only' in out.stdout
    assert 'Property "x" defined in "Mine" is read-only' in out.stdout
    assert out.stdout.count("error:") == 2, out.stdout
    assert AttemptSpec.__immutable__ is True  # type: ignore[attr-defined]
