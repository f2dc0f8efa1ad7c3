"""A real ``stepd serve`` firing a schedule every second, SIGKILLed (by PID) between and
during fires and restarted on the same data directory: every fire inside the catch-up
window started exactly once (no double, no drop)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx

from tests._waiting import eventually

from ..cli._serve import ServeProcess, serve_process
from ..daemon.helpers import seq_definition

ROUNDS = 2


def fires(http: httpx.Client, sid: str) -> list[int]:
    """The fire time of every run the schedule started, from the listing (all pages)."""
    out: list[int] = []
    cursor = None
    for _ in range(100):
        params: dict[str, Any] = {"correlation": json.dumps({"schedule_id": sid}),
                                  "order": "asc", "limit": 1000}
        if cursor:
            params["cursor"] = cursor
        page = http.get("/v1/api/runs", params=params).json()
        out += [int(r["idempotency_key"].rsplit(":", 1)[1]) for r in page["runs"]]
        cursor = page["next_cursor"]
        if not cursor:
            return out
    raise AssertionError("too many pages")


def wait_for(check: Any, what: str, timeout: float = 30.0) -> Any:
    return eventually(check, timeout=timeout, what=what, interval=0.05)


def sigkill(d: ServeProcess) -> None:
    os.kill(d.pid, signal.SIGKILL)
    d.proc.wait(15)


def test_sigkill_between_fires_neither_doubles_nor_drops(tmp_path: Path) -> None:
    data = tmp_path / "data"
    d = serve_process(data)
    try:
        with httpx.Client(base_url=d.url, trust_env=False, timeout=10.0) as http:
            r = http.post("/v1/api/workers/register",
                          json={"name": "w", "definitions": [seq_definition("tick", 1)]})
            assert r.status_code == 200, r.text
            r = http.post("/v1/api/schedules", json={
                "cron": "* * * * * *", "workflow": "tick", "overlap": "allow",
                "catchup_window_ms": "1h"})
            assert r.status_code == 201, r.text
            sid = r.json()["schedule_id"]
            wait_for(lambda: len(fires(http, sid)) >= 2, "two fires")
    finally:
        sigkill(d)
    for _ in range(ROUNDS):
        killed_at_ms = int(time.time() * 1000)
        d = serve_process(data)
        try:
            with httpx.Client(base_url=d.url, trust_env=False, timeout=10.0) as http:
                # Caught up past the downtime and firing again; then killed mid-stream.
                after = killed_at_ms + 1000
                wait_for(lambda: max(fires(http, sid)) >= after,  # noqa: B023 - called at once
                         "fires after the restart")
        finally:
            sigkill(d)
    d = serve_process(data)
    try:
        with httpx.Client(base_url=d.url, trust_env=False, timeout=10.0) as http:
            restarted_ms = int(time.time() * 1000)
            wait_for(lambda: max(fires(http, sid)) >= restarted_ms, "the last catch-up")
            assert http.post(f"/v1/api/schedules/{sid}/pause").status_code == 200
            found = fires(http, sid)
            view = http.get(f"/v1/api/schedules/{sid}").json()
    finally:
        assert d.stop() == 0, d.stderr()
    assert len(found) == len(set(found)), "a fire started twice"
    assert found == list(range(found[0], found[-1] + 1000, 1000)), "a fire was dropped"
    assert view["fires"]["started"] == len(found)  # a lost cursor write loses its count too
    assert view["fires"]["dropped"] == 0
