"""`stepd serve --commit-on-loop` reaches the daemon's storage; a bad value names its field."""

from __future__ import annotations

from pathlib import Path

import pytest

from stepd.actors.daemon import Daemon
from stepd.daemon import ServeConfig
from stepd.sansio.errors import Invalid


def test_auto_is_the_default_and_never_turns_it_off(tmp_path: Path) -> None:
    assert ServeConfig(data=str(tmp_path)).daemon_config().commit_on_loop is True
    assert ServeConfig(data=str(tmp_path), commit_on_loop="never").daemon_config().commit_on_loop \
        is False


def test_another_value_is_refused_naming_the_field(tmp_path: Path) -> None:
    with pytest.raises(Invalid) as info:
        ServeConfig(data=str(tmp_path), commit_on_loop="sometimes").daemon_config()
    assert info.value.field == "commit_on_loop"
    assert "sometimes" in str(info.value)


async def test_the_daemon_opens_its_storage_with_it(tmp_path: Path) -> None:
    for value, expected in (("never", False), ("auto", True)):
        config = ServeConfig(data=str(tmp_path), commit_on_loop=value).daemon_config()
        async with Daemon.open(str(tmp_path / value), config=config) as daemon:
            assert daemon.storage.commit_on_loop is expected
