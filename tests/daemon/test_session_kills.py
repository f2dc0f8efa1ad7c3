"""A killed session actor loses no push connection and no slot.

A session's mailbox dies with its incarnation. examples/chaos.py found two ways
that stranded work: an `Attach` still in the mailbox (the successor had no
outbox to close, so the connection stayed open with its credit ignored: runs
never offered again), and slots the registry had handed the dead incarnation
(their runs still counted them as queued). The first test kills the session
with its `Attach` still in the mailbox (it fails without the fix). The second
kills it while runs are being offered to it and checks that every run's slot
reaches a connection; whether a slot is caught in the mailbox at that moment
depends on scheduling, so it is a regression net for the property rather than
a proof of the `ResyncAll` fix (examples/chaos.py and the campaign's session
kills are).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio

from stepd.actors.daemon import Daemon, DaemonConfig

FLOW = {"name": "flow", "steps": [{"id": "a", "kind": "task", "body": "a"}]}


class _Outbox:
    """A push connection that takes whatever it is given (the session's `Outbox`)."""

    def __init__(self) -> None:
        self.leases: list[dict[str, Any]] = []
        self.closed: list[str] = []

    def lease(self, lease: dict[str, Any]) -> bool:
        self.leases.append(lease)
        return True

    def cancel(self, lease_id: str, reason: str) -> None:
        pass

    def close(self, reason: str) -> None:
        self.closed.append(reason)


async def _until(check: Any, what: str) -> None:
    for _ in range(500):  # bounded: 5 s at most
        if check():
            return
        await anyio.sleep(0.01)
    raise AssertionError(f"never happened: {what}")


async def test_credit_after_an_attach_lost_with_a_killed_session_still_brings_leases(
        tmp_path: Path) -> None:
    async with Daemon.open(str(tmp_path / "data"), config=DaemonConfig()) as daemon:
        wid = (await daemon.register_worker(name="w", definitions=[FLOW]))["worker_id"]
        outbox = _Outbox()
        conn = await daemon.attach(wid, outbox)  # the Attach is queued, not handled yet
        await daemon.kill(f"/sessions/{wid}")  # ... and dies in the mailbox
        await _until(lambda: _session_attached(daemon, wid), "the session restarted")
        conn.grant(4)
        run_id, _ = await daemon.start_run("flow")
        await _until(lambda: outbox.leases, "a lease pushed to the connection")
        assert outbox.leases[0]["run_id"] == run_id
        conn.detach()


async def test_slots_handed_to_a_killed_session_are_offered_again(tmp_path: Path) -> None:
    async with Daemon.open(str(tmp_path / "data"), config=DaemonConfig()) as daemon:
        wid = (await daemon.register_worker(name="w", definitions=[FLOW]))["worker_id"]
        first = _Outbox()
        conn = await daemon.attach(wid, first)
        await _until(lambda: _session_attached(daemon, wid), "the session attached")
        conn.grant(8)
        await anyio.sleep(0.05)  # the session subscribes with its credit
        runs = [(await daemon.start_run("flow"))[0] for _ in range(8)]
        # Kill the session while slots are on their way to it or in its hand.
        await daemon.kill(f"/sessions/{wid}")
        await _until(lambda: first.closed, "the successor closes the connection it had")
        conn.detach()
        second = _Outbox()
        again = await daemon.attach(wid, second)
        again.grant(8)
        await _until(lambda: {lease["run_id"] for lease in first.leases + second.leases}
                     >= set(runs), "every run's slot offered to a connection")
        again.detach()


def _walk(node: dict[str, Any]) -> list[dict[str, Any]]:
    out = [node]
    for child in node.get("children") or []:
        out += _walk(child)
    return out


def _session_attached(daemon: Daemon, wid: str) -> bool:
    return any(n["path"] == f"/sessions/{wid}" and n["state"] == "running"
               for n in _walk(daemon.actors()))
