"""The console's views of schedules, retry, fork, cancel and the daemon's status, in a real
browser against a real daemon with a real worker.

One ``stepd serve`` for the module, with keys, ``--retention 30d`` and
``--otlp-endpoint`` pointing at `bench._otlp_sink` (a real OTLP/HTTP receiver
on 127.0.0.1), one chromium (the `browser` fixture), and one `stepd.Worker` in
a thread serving: a workflow a schedule fires every second, one whose first
step fails the first time it runs (a marker file), one that fails on a budget
(a retry is refused), three steps to fork from, one that waits until it is
cancelled, and one whose name is markup. The tests create a schedule from the
page and watch it fire, pause and delete it; retry a failed run from its page
and watch it complete; fork a completed run after a step and follow the links
both ways; cancel a run with a reason that is markup and script, and see it
shown as text; read the daemon page's export counts and retention, and prune
every finished run from it.

Screenshots go to ``$STEPD_CONSOLE_SCREENSHOTS`` when it is set (as in
test_browser.py), else to a temporary folder.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import stepd
from tests._waiting import eventually

from ._pages import TIMEOUT_MS, assert_clean, goto, open_page, shoot, sign_in
from .conftest import KEYS, DaemonProcess, keyed_args, start_daemon

HOSTILE_REASON = '<script>window.__pwned=21;alert(21)</script><img src=x onerror="window.__pwned=22">'
HOSTILE_NAME = "<img src=x onerror=alert(23)>tick"


# --------------------------------------------------------------------------- the world


def tick(ctx: stepd.StepContext, value: Any) -> dict[str, Any]:
    return {"fired": True}


def flaky(ctx: stepd.StepContext, value: dict[str, Any]) -> str:
    marker = Path(value["marker"])
    if not marker.exists():
        marker.write_text("failed once")
        raise stepd.StepFailure("flaky", "fails the first time it runs")
    return "second time lucky"


def settle(ctx: stepd.StepContext, value: Any) -> str:
    return "settled"


def a(ctx: stepd.StepContext, value: Any) -> int:
    ctx.patch_state(at="a")
    return 1


def b(ctx: stepd.StepContext, value: Any) -> int:
    return 2


def c(ctx: stepd.StepContext, value: Any, steps: dict[str, Any]) -> dict[str, Any]:
    return {"a": steps["a"], "b": steps["b"]}


def wait_for_cancel(ctx: stepd.StepContext, value: Any) -> str:
    ctx.cancel_event.wait(60)  # the test cancels the run from the page
    raise stepd.Retryable("cancelled or tired of waiting")


TICK = stepd.Workflow("ops-tick", version="tick.v1").then(tick)
FLAKY = (stepd.Workflow("ops-flaky", version="flaky.v1")
         .then(flaky, retry=stepd.Retry(max_attempts=1)).then(settle))
OVER = stepd.Workflow("ops-over-budget").then(a).then(b).then(c).budget(max_transitions=1)
FORKABLE = stepd.Workflow("ops-forkable", version="fork.v1").then(a).then(b).then(c)
HELD = stepd.Workflow("ops-held").then(wait_for_cancel)
EVIL = stepd.Workflow(HOSTILE_NAME).then(tick)


@dataclass
class World:
    daemon: DaemonProcess
    flaky: str
    over_budget: str
    forkable: str
    held: str
    evil_held: str
    shots: Path


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    sink_module = pytest.importorskip("bench._otlp_sink", reason="needs opentelemetry-proto")
    base = tmp_path_factory.mktemp("ops")
    with sink_module.otlp_sink() as sink:
        daemon = start_daemon(base / "data", *keyed_args(), "--retention", "30d",
                              "--otlp-endpoint", sink.url)
        wclient = stepd.Client(daemon.url, key=KEYS["worker"])
        client = stepd.Client(daemon.url, key=KEYS["admin"])
        worker = stepd.Worker(wclient, concurrency=6, name="ops-worker").register(
            TICK, FLAKY, OVER, FORKABLE, HELD, EVIL)
        thread = threading.Thread(target=worker.serve, kwargs={"handle_signals": False},
                                  daemon=True)
        thread.start()
        try:
            assert worker.wait_ready(15), "the worker did not register"
            failed = client.start(FLAKY, {"marker": str(base / "flaky.marker")})
            over = client.start(OVER, {})
            forkable = client.start(FORKABLE, {"n": 7})
            held = client.start(HELD, {})
            evil_held = client.start(HELD, {"hostile": True})
            for run in (failed, over):
                with pytest.raises(stepd.RunFailed):
                    client.result(run.run_id, timeout=30)
            assert client.result(forkable.run_id, timeout=30) == {"a": 1, "b": 2}
            target = os.environ.get("STEPD_CONSOLE_SCREENSHOTS")
            shots = Path(target) if target else base / "shots"
            shots.mkdir(parents=True, exist_ok=True)
            yield World(daemon, failed.run_id, over.run_id, forkable.run_id, held.run_id,
                        evil_held.run_id, shots)
        finally:
            worker.stop(grace=5)
            thread.join(10)
            wclient.close()
            client.close()
            assert daemon.stop() == 0, daemon.stderr()


# --------------------------------------------------------------------------- tests


def test_an_admin_creates_a_schedule_watches_it_fire_pauses_and_deletes_it(
        browser: Any, world: World) -> None:
    d = world.daemon
    with d.client(KEYS["admin"]) as api:  # one that never fires during the test (Feb 29 only)
        nightly = api.post("/v1/api/schedules", json={
            "workflow": "ops-forkable", "cron": "0 2 29 2 *", "timezone": "Europe/Paris",
            "overlap": "buffer_one", "catchup_window_ms": "6h", "input": {"n": 1}}).json()
    page, watch = open_page(browser, d.url)
    sign_in(page, KEYS["admin"])
    goto(page, "#/schedules")
    page.locator(f"tr[data-schedule='{nightly['schedule_id']}']").wait_for()
    page.locator("details.create summary").click()
    form = page.locator("form.schedule-form")
    form.locator("input[name=workflow]").fill("ops-tick")
    form.locator("input[name=cron]").fill("* * * * * *")  # every second
    form.locator("input[name=timezone]").fill("UTC")
    form.locator("input[name=input]").fill("{\"n\": 1")  # not JSON: refused before any call
    form.get_by_role("button", name="Create").click()
    form.locator("p.error", has_text="input: not JSON").wait_for()
    form.locator("input[name=input]").fill("{\"n\": 1}")
    form.locator("input[name=cron]").fill("0 25 * * *")  # refused by the daemon, naming the field
    form.get_by_role("button", name="Create").click()
    form.locator("p.error", has_text="cron:").wait_for()
    form.locator("input[name=cron]").fill("* * * * * *")
    form.locator("input[name=catchup]").fill("1h")
    form.get_by_role("button", name="Create").click()
    page.locator(".banner.ok", has_text="Created s_").wait_for()
    sid = page.locator(".banner.ok .mono").inner_text()
    with d.client(KEYS["read"]) as api:
        made = api.get(f"/v1/api/schedules/{sid}").json()
    assert (made["workflow"], made["cron"], made["timezone"], made["input"],
            made["catchup_window_ms"], made["overlap"]) == \
        ("ops-tick", "* * * * * *", "UTC", {"n": 1}, 3_600_000, "skip")
    row = page.locator(f"tr[data-schedule='{sid}']")
    assert "ops-tick" in row.inner_text() and "* * * * * *" in row.inner_text()
    # It fires: the run it started shows in its row, linked, and completes.
    row.locator(".sched-runs .badge", has_text="completed").first.wait_for(timeout=20_000)
    run_id = row.locator(".sched-runs li[data-run]").first.get_attribute("data-run")
    with d.client(KEYS["read"]) as api:
        run = api.get(f"/v1/api/runs/{run_id}").json()
    assert run["workflow"] == "ops-tick" and run["correlation"] == {"schedule_id": sid}
    # Pause: the row says so and the daemon agrees.
    row.locator("button[data-action=pause]").click()
    page.locator(".banner.ok", has_text=f"Paused {sid}").wait_for()
    row.locator(".badge", has_text="paused").wait_for()
    with d.client(KEYS["read"]) as api:
        paused = api.get(f"/v1/api/schedules/{sid}").json()
    assert paused["paused"] is True and paused["next_fire_at"] is None
    started = paused["fires"]["started"]
    assert started >= 1
    shoot(page, world, "schedules")
    # The run link opens the run it started.
    row.locator(f".sched-runs a[href='#/runs/{run_id}']").click()
    page.locator(".run-head .badge", has_text="completed").wait_for()
    goto(page, "#/schedules")
    row.locator("button[data-action=resume]").click()
    page.locator(".banner.ok", has_text=f"Resumed {sid}").wait_for()
    row.locator("button", has_text="Delete").click()
    row.locator("button", has_text="Confirm delete").click()
    page.locator(".banner.ok", has_text=f"Deleted {sid}").wait_for()
    row.wait_for(state="detached")
    with d.client(KEYS["read"]) as api:
        assert api.get(f"/v1/api/schedules/{sid}").status_code == 404
        assert api.get(f"/v1/api/runs/{run_id}").status_code == 200  # its runs stay
    assert_clean(page, watch)
    page.close()


def test_retry_a_failed_run_from_its_page_and_watch_it_complete(browser: Any,
                                                                 world: World) -> None:
    page, watch = open_page(browser, world.daemon.url)
    sign_in(page, KEYS["admin"])
    # A budget failure may not be retried: the daemon's refusal is shown.
    goto(page, f"#/runs/{world.over_budget}")
    page.locator(".run-head .badge", has_text="failed").wait_for()
    page.locator("button[data-action=retry]").click()
    page.locator(".banner.bad", has_text="Retry refused").wait_for()
    assert "budget" in page.locator(".banner.bad").inner_text()
    # The flaky run failed once; the retry runs its step again, and it completes.
    goto(page, f"#/runs/{world.flaky}")
    page.locator(".run-head .badge", has_text="failed").wait_for()
    assert page.locator("button[data-action=cancel]").count() == 0  # not running
    shoot(page, world, "run-failed")
    page.evaluate("window.__stillHere = 1")
    page.locator("button[data-action=retry]").click()
    page.locator(".banner.ok", has_text="Retried at step flaky").wait_for()
    page.locator(".run-head .badge", has_text="completed").wait_for(timeout=20_000)
    assert page.evaluate("window.__stillHere") == 1  # updated in place
    assert page.locator("button[data-action=retry]").count() == 0
    retries = page.locator("[data-link=retries]")
    assert "at step flaky" in retries.inner_text()
    assert "fails the first time it runs" in retries.inner_text()
    assert '"settled"' in page.locator(".card.data", has_text="Result").inner_text()
    with world.daemon.client(KEYS["read"]) as api:
        status = api.get(f"/v1/api/runs/{world.flaky}").json()
    assert status["status"] == "completed" and status["result"] == "settled"
    assert_clean(page, watch)
    page.close()


def test_fork_a_completed_run_after_a_step_and_follow_the_links(browser: Any,
                                                                 world: World) -> None:
    source = world.forkable
    page, watch = open_page(browser, world.daemon.url)
    sign_in(page, KEYS["admin"])
    goto(page, f"#/runs/{source}")
    page.locator(".run-head .badge", has_text="completed").wait_for()
    pick = page.locator("select[name=from_step]")
    assert pick.locator("option").all_inner_texts() == ["a", "b", "c"]
    pick.select_option("a")
    page.locator("button[data-action=fork]").click()
    page.wait_for_function("src => !location.hash.endsWith(src)", arg=source)
    fork = page.evaluate("location.hash").rsplit("/", 1)[1]
    page.locator(".run-head h1", has_text=fork).wait_for()
    page.locator(".run-head .badge", has_text="completed").wait_for(timeout=20_000)
    came = page.locator("[data-link=forked-from]")
    came.wait_for()
    assert came.inner_text() == f"{source} after step a"
    with world.daemon.client(KEYS["read"]) as api:
        status = api.get(f"/v1/api/runs/{fork}").json()
    assert status["forked_from"] == {"run_id": source, "step_id": "a"}
    assert status["result"] == {"a": 1, "b": 2}
    shoot(page, world, "run-fork")
    came.locator("a").click()  # back to the source: it lists its fork
    page.locator(f"[data-link=forks] a[href='#/runs/{fork}']").wait_for()
    assert_clean(page, watch)
    page.close()


def test_cancel_with_a_hostile_reason_and_a_hostile_schedule_never_run(browser: Any,
                                                                      world: World) -> None:
    page, watch = open_page(browser, world.daemon.url)
    sign_in(page, KEYS["admin"])
    # Cancel with a reason: a plain one, then (another run) markup and script.
    for run_id, reason in ((world.held, "the customer withdrew"),
                           (world.evil_held, HOSTILE_REASON)):
        goto(page, f"#/runs/{run_id}")
        page.locator(".run-head .badge", has_text="running").wait_for()
        page.locator("input[name=reason]").fill(reason)
        page.locator("button[data-action=cancel]").click()
        page.locator("button[data-action=cancel]", has_text="Confirm cancel").click()
        page.locator(".run-head .badge", has_text="cancelled").wait_for()
        assert page.locator(".cancel-reason").inner_text() == reason
        page.locator(".banner.ok", has_text="Cancelled").wait_for()
        with world.daemon.client(KEYS["read"]) as api:
            error = api.get(f"/v1/api/runs/{run_id}").json()["error"]
        assert error["reason"] == "cancelled" and error["message"] == reason
        if reason == HOSTILE_REASON:
            assert HOSTILE_REASON in page.locator("table.journal").inner_text()
            shoot(page, world, "run-cancelled")
        assert_clean(page, watch)
    # A schedule of a workflow whose name is markup, created from the page.
    goto(page, "#/schedules")
    page.locator("details.create summary").click()
    form = page.locator("form.schedule-form")
    form.locator("input[name=workflow]").fill(HOSTILE_NAME)
    form.locator("input[name=cron]").fill("0 3 29 2 *")  # never during the test
    form.locator("input[name=input]").fill(json.dumps({"x": HOSTILE_REASON}))
    form.get_by_role("button", name="Create").click()
    page.locator(".banner.ok", has_text=HOSTILE_NAME).wait_for()
    page.locator("tr[data-schedule]", has_text=HOSTILE_NAME).wait_for()
    assert_clean(page, watch)
    page.close()


def test_the_daemon_page_shows_export_counts_and_retention_and_an_admin_prunes(
        browser: Any, world: World) -> None:
    d = world.daemon
    page, watch = open_page(browser, d.url)
    sign_in(page, KEYS["read"])
    # A read key sees no action anywhere the new views offer them.
    for route, ready in (("#/schedules", "main table"), (f"#/runs/{world.flaky}", ".run-head"),
                         (f"#/runs/{world.held}", ".run-head")):
        goto(page, route)
        page.locator(ready).first.wait_for()
        page.wait_for_timeout(300)
        assert page.locator("main button").count() == 0, route
        assert page.locator("details.create").count() == 0, route
    goto(page, "#/daemon")
    page.locator("[data-otel=on]").wait_for()

    def shown() -> int:
        return int(page.locator("[data-what=exported] b").inner_text().replace(",", ""))

    exported = eventually(lambda: shown() > 0 and shown(), timeout=TIMEOUT_MS / 1000,
                          what="spans exported, on the page", interval=0.05)
    with d.client() as c:  # /metrics: the same counter, a moment later
        metrics = c.get("/metrics").text
    line = next(x for x in metrics.splitlines() if x.startswith('stepd_otel_export{what="exported"}'))
    assert exported <= float(line.split()[1])
    for what in ("failed", "dropped"):
        assert page.locator(f"[data-what={what}] b").inner_text() == "0"
    assert page.locator("[data-what=retention]").inner_text() == \
        "finished runs are deleted 30 days after they ended"
    size = page.locator("[data-what=data_dir_bytes]")
    assert int(size.get_attribute("title").split()[0].replace(",", "")) > 0
    assert size.inner_text().endswith(("KiB", "MiB", "GiB"))
    assert "0 since the daemon started" in page.locator("[data-what=runs_pruned]").inner_text()
    assert page.locator("form.prune").count() == 0  # a read key may not prune
    # An admin prunes every finished run (this module's last use of them).
    page.locator("#signout").click()
    sign_in(page, KEYS["admin"])
    goto(page, "#/daemon")
    page.locator("[data-otel=on]").wait_for()
    shoot(page, world, "daemon")
    with d.client(KEYS["read"]) as api:
        by = api.get("/v1/api/stats").json()["runs_by_status"]
    finished = sum(by[s] for s in ("completed", "failed", "cancelled", "timed_out"))
    assert by["running"] == by["waiting"] == by["sleeping"] == 0 and finished >= 6
    page.locator("form.prune input[name=before]").fill(
        page.evaluate("() => { const d = new Date(Date.now() + 86400000);"
                      " d.setMinutes(d.getMinutes() - d.getTimezoneOffset());"
                      " return d.toISOString().slice(0, 16); }"))
    page.locator("button[data-action=prune]").click()
    page.locator("button[data-action=prune]", has_text="Confirm prune").click()
    page.locator(".banner.ok", has_text=f"Deleted {finished} finished runs.").wait_for()
    page.locator("[data-what=runs_pruned]", has_text=f"{finished} since").wait_for()
    with d.client(KEYS["read"]) as api:
        assert api.get(f"/v1/api/runs/{world.forkable}").status_code == 404
        assert api.get("/v1/api/runs").json()["runs"] == []
    assert_clean(page, watch)
    page.close()


def test_the_new_screenshots_are_pictures(browser: Any, world: World) -> None:
    """Runs last in this module: every new view was photographed (docs/console.md).
    Without a browser (``browser`` skips) nothing was photographed, so it skips too."""
    for name in ("schedules", "run-failed", "run-fork", "run-cancelled", "daemon"):
        shot = world.shots / f"{name}.png"
        assert shot.is_file() and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    if os.environ.get("STEPD_CONSOLE_SCREENSHOTS") is None:
        shutil.rmtree(world.shots, ignore_errors=True)
