"""The schedule and prune calls of `stepd.Client` on an embedded daemon (in process:
the same protocol table, validation and errors as over HTTP)."""

from __future__ import annotations

from pathlib import Path

import pytest

import stepd


def test_client_schedule_calls_in_process(tmp_path: Path) -> None:
    with stepd.embedded(tmp_path / "data") as daemon, stepd.Client(daemon) as client:
        with pytest.raises(stepd.Invalid) as err:
            client.create_schedule("nobody", "* * * * *")
        assert err.value.field == "workflow"
        with pytest.raises(stepd.Invalid) as err:
            client.create_schedule("nobody", "* * * * *", timezone="Nowhere/Land")
        assert err.value.field == "timezone"
        assert client.schedules() == []
        for call in (client.schedule, client.pause_schedule, client.resume_schedule,
                     client.delete_schedule):
            with pytest.raises(stepd.NotFound):
                call("s_01JDV5Z8Q3X4M6N7P8R9S0T1U2")
        assert client.prune_runs("2000-01-01T00:00:00Z") == {"deleted": 0, "more": False}
        with pytest.raises(stepd.Invalid) as err:
            client.prune_runs("soon")
        assert err.value.field == "before"
