"""Schedules, prune and the data directory's size over HTTP against a real ``stepd serve``
(uvicorn on 127.0.0.1, real LMDB): validation names the field, scopes, audit, metrics; and
`stepd.AsyncClient`'s schedule and prune calls over HTTP."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import stepd

from ..cli._serve import ServeProcess, serve_process
from ..daemon.helpers import seq_definition

ADMIN, EXECUTE, READ, WORKER = ("sched-admin-key-0123456789", "sched-exec-key-0123456789",
                                "sched-read-key-0123456789", "sched-worker-key-0123456789")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    d = serve_process(tmp_path_factory.mktemp("sched") / "data", "--admin-key", ADMIN,
                      "--execute-key", EXECUTE, "--read-key", READ, "--worker-key", WORKER,
                      "--retention", "30d")
    try:
        with client(d, WORKER) as http:
            r = http.post("/v1/api/workers/register",
                          json={"name": "w", "definitions": [seq_definition("seq", 1)]})
        assert r.status_code == 200, r.text
        yield d
    finally:
        assert d.stop() == 0, d.stderr()


_open: list[httpx.Client] = []


def client(d: ServeProcess, key: str) -> httpx.Client:
    c = httpx.Client(base_url=d.url, headers={"authorization": f"Bearer {key}"},
                     trust_env=False, timeout=10.0)
    _open.append(c)
    return c


@pytest.fixture(autouse=True)
def _close_clients() -> Iterator[None]:
    yield
    while _open:
        _open.pop().close()


BODY: dict[str, Any] = {"cron": "0 9 * * MON-FRI", "timezone": "Europe/Paris",
                        "workflow": "seq", "input": {"n": 1}, "overlap": "buffer_one",
                        "catchup_window_ms": "1h"}


@pytest.mark.parametrize(("change", "field"), [
    ({"cron": "0 25 * * *"}, "cron"),
    ({"cron": ""}, "cron"),
    ({"timezone": "Europe/Atlantis"}, "timezone"),
    ({"workflow": "nobody-registered-it"}, "workflow"),
    ({"overlap": "queue_all"}, "overlap"),
    ({"catchup_window_ms": "8d"}, "catchup_window_ms"),
    ({"colour": "blue"}, "colour"),
])
def test_bad_input_is_a_400_naming_the_field(daemon: ServeProcess, change: dict[str, Any],
                                             field: str) -> None:
    http = client(daemon, EXECUTE)
    before = http.get("/v1/api/schedules", headers={"authorization": f"Bearer {READ}"}).json()
    r = http.post("/v1/api/schedules", json={**BODY, **change})
    assert r.status_code == 400, r.text
    assert r.json()["error"] == "invalid" and r.json()["field"] == field
    after = http.get("/v1/api/schedules", headers={"authorization": f"Bearer {READ}"}).json()
    assert after == before  # nothing half-applied


def test_create_get_pause_resume_delete_with_scopes_and_audit(daemon: ServeProcess) -> None:
    execute, read, admin = client(daemon, EXECUTE), client(daemon, READ), client(daemon, ADMIN)
    assert read.post("/v1/api/schedules", json=BODY).status_code == 403
    r = execute.post("/v1/api/schedules", json=BODY)
    assert r.status_code == 201, r.text
    created = r.json()
    sid = created["schedule_id"]
    assert created["timezone"] == "Europe/Paris" and created["catchup_window_ms"] == 3_600_000
    assert created["next_fire_at"] is not None and created["paused"] is False
    assert read.get(f"/v1/api/schedules/{sid}").json() == created
    listed = read.get("/v1/api/schedules", params={"limit": 1000}).json()
    assert sid in [s["schedule_id"] for s in listed["schedules"]]
    assert read.post(f"/v1/api/schedules/{sid}/pause").status_code == 403
    paused = execute.post(f"/v1/api/schedules/{sid}/pause")
    assert paused.status_code == 200 and paused.json()["paused"] is True
    resumed = execute.post(f"/v1/api/schedules/{sid}/resume", json={})
    assert resumed.status_code == 200 and resumed.json()["paused"] is False
    # Its actor is in the tree, and killable (its supervisor restarts it from storage).
    tree = admin.get("/v1/api/actors").json()["tree"]
    group = next(c for c in tree["children"] if c["path"] == "/schedules")
    assert f"/schedules/{sid}" in [c["path"] for c in group["children"]]
    kill = admin.post("/v1/api/actors/kill", json={"path": f"/schedules/{sid}"})
    assert kill.status_code == 200 and kill.json()["restarted"] == [f"/schedules/{sid}"]
    assert execute.delete(f"/v1/api/schedules/{sid}").status_code == 200
    assert read.get(f"/v1/api/schedules/{sid}").status_code == 404
    assert execute.delete(f"/v1/api/schedules/{sid}").status_code == 404
    assert read.get("/v1/api/schedules/not-an-id").status_code == 404
    actions = [(e["action"], e["status"]) for e in admin.get(
        "/v1/api/audit", params={"limit": 1000}).json()["entries"] if e["target"] == sid]
    for action in ("schedules.create", "schedules.pause", "schedules.resume",
                   "schedules.delete", "schedules.read"):
        assert action in {a for a, _ in actions}, actions
    assert ("schedules.create", 201) in actions


def test_prune_needs_admin_and_metrics_show_the_data_directory(daemon: ServeProcess) -> None:
    execute, admin = client(daemon, EXECUTE), client(daemon, ADMIN)
    assert execute.post("/v1/api/runs/prune", json={"before": 0}).status_code == 403
    r = admin.post("/v1/api/runs/prune", json={"before": "2000-01-01T00:00:00Z"})
    assert r.status_code == 200 and r.json() == {"deleted": 0, "more": False}
    bad = admin.post("/v1/api/runs/prune", json={"before": "yesterday"})
    assert bad.status_code == 400 and bad.json()["field"] == "before"
    missing = admin.post("/v1/api/runs/prune", json={})
    assert missing.status_code == 400 and missing.json()["field"] == "before"
    metrics = admin.get("/metrics").text
    size = next(line for line in metrics.splitlines() if line.startswith("stepd_data_dir_bytes "))
    assert float(size.split()[1]) > 0
    assert "stepd_runs_pruned_total" in metrics
    data = Path(daemon.stderr_path).parent / "data"
    on_disk = sum(p.stat().st_size for p in data.iterdir() if p.is_file())
    assert abs(float(size.split()[1]) - on_disk) <= on_disk  # same files, a moment apart


async def test_async_client_schedules_and_prune_over_http(daemon: ServeProcess) -> None:
    """`stepd.AsyncClient`'s schedule and prune calls against the real daemon, with its scopes."""
    async with stepd.AsyncClient(daemon.url, key=EXECUTE, trust_env=False) as execute, \
            stepd.AsyncClient(daemon.url, key=READ, trust_env=False) as read, \
            stepd.AsyncClient(daemon.url, key=ADMIN, trust_env=False) as admin:
        with pytest.raises(stepd.Forbidden):
            await read.create_schedule("seq", "0 9 * * *")
        with pytest.raises(stepd.Invalid) as err:
            await execute.create_schedule("seq", "0 9 * * *", overlap="queue_all")
        assert err.value.field == "overlap"
        made = await execute.create_schedule("seq", "*/5 * * * *", input={"n": 2},
                                             timezone="Asia/Tokyo", overlap="buffer_one")
        sid = made["schedule_id"]
        assert made["timezone"] == "Asia/Tokyo" and made["paused"] is False
        assert await read.schedule(sid) == made
        assert sid in [s["schedule_id"] for s in await read.schedules(limit=1)]  # pages of one
        with pytest.raises(stepd.Forbidden):
            await read.pause_schedule(sid)
        assert (await execute.pause_schedule(sid))["paused"] is True
        assert (await execute.resume_schedule(sid))["paused"] is False
        await execute.delete_schedule(sid)
        with pytest.raises(stepd.NotFound):
            await read.schedule(sid)
        with pytest.raises(stepd.Forbidden):
            await execute.prune_runs("2000-01-01T00:00:00Z")
        assert await admin.prune_runs(0, limit=5) == {"deleted": 0, "more": False}
