"""Golden journals: recorded inputs replayed through the machine give the same journal and status.

A failure here means the machine's behaviour changed. If the change is
intended, re-record with `python -m tests.sansio.golden_scenarios` and review
the diff of `tests/sansio/golden/` like any other behaviour change.
"""

from __future__ import annotations

import json

import pytest

from stepd.sansio.definition import parse_definition

from .golden_scenarios import GOLDEN, SCENARIOS, decode_event, start_machine

FILES = sorted(GOLDEN.glob("*.json"))


def test_every_scenario_has_a_golden_file() -> None:
    assert {f.stem for f in FILES} == {s().name for s in SCENARIOS}


@pytest.mark.parametrize("path", FILES, ids=[f.stem for f in FILES])
def test_replay_reproduces_the_recorded_journal_and_status(path) -> None:  # type: ignore[no-untyped-def]
    doc = json.loads(path.read_text())
    defs = {d.name: d for d in map(parse_definition, doc["definitions"])}
    machine, tr = start_machine(defs, doc["start"])
    journal = list(tr.journal)
    for item in doc["inputs"]:
        event, now = decode_event(item)
        journal.extend(machine.handle(event, now).journal)
    assert json.loads(json.dumps(journal)) == doc["journal"]
    assert json.loads(json.dumps(machine.status_view())) == doc["status"]

