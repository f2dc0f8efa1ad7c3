"""The web console in a real browser, against a real daemon with real workers.

One ``stepd serve`` with keys (one per scope) and one chromium for the whole
module; two `stepd.Worker`\\ s in threads, over the WebSocket: a well-behaved
one (a workflow with model-call spans, a ``for_each`` and budgets, and one
whose step waits on a gate the test opens), and a hostile one whose name,
workflow name, version, outputs, state, span names and attributes, failure
class and message are markup and script (``<img src=x onerror=...>``,
``<script>``, ``javascript:`` URLs). The tests sign in with a read key and
an admin key, filter the runs, open a run and its waterfall, look at the
workers and definitions, kill an actor and watch its run finish, and check
that nothing a worker or a client wrote ever ran or became an element.

Screenshots of every page go to ``$STEPD_CONSOLE_SCREENSHOTS`` when it is
set (``STEPD_CONSOLE_SCREENSHOTS=docs/console``: the pictures in
docs/console.md), else to a temporary folder.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

import stepd

from ._pages import TIMEOUT_MS, assert_clean, goto, open_page, shoot, sign_in
from .conftest import KEYS, DaemonProcess

HOSTILE = '<img src=x onerror="window.__pwned=1;alert(1)">'
HOSTILE_WORKFLOW = "<svg onload=alert(2)>wf"
HOSTILE_VERSION = "<script>alert(3)</script>"
HOSTILE_OUTPUT = {"html": HOSTILE, "script": "<script>window.__pwned=4;alert(4)</script>",
                  "url": "javascript:alert(5)", "nested": [{"a": "<a href=javascript:alert(6)>x</a>"}]}
HOSTILE_SPAN = "<script>alert(7)</script>span"
HOSTILE_CLASS = "<img src=x onerror=alert(8)>"
HOSTILE_MESSAGE = "</pre></td><script>window.__pwned=9;alert(9)</script><b>bold</b>"


# --------------------------------------------------------------------------- the world


def classify(ctx: stepd.StepContext, ticket: dict[str, Any]) -> dict[str, Any]:
    with ctx.span("llm.call", model="fast-1") as span:
        time.sleep(0.01)
        span.set_usage(model="fast-1", input_tokens=212 + ticket["n"], output_tokens=4)
    ctx.patch_state(label="billing", tasks=["find the invoice", "check the charge", "refund"])
    return {"label": "billing"}


def work(ctx: stepd.StepContext, task: str) -> str:
    with ctx.span("tool.call", tool="crm", task=task), ctx.span("llm.call", model="smart-1") as span:
        time.sleep(0.015)
        span.set_usage(model="smart-1", input_tokens=120, output_tokens=30)
    return f"{task}: done"


def finish(ctx: stepd.StepContext, ticket: dict[str, Any], steps: dict[str, Any]) -> dict[str, Any]:
    return {"sent": True, "tasks": steps["work"]}


GATE = threading.Event()


def hold(ctx: stepd.StepContext, value: Any) -> str:
    deadline = time.monotonic() + 60
    while not GATE.wait(0.05):
        if ctx.cancelled or time.monotonic() > deadline:
            raise stepd.Retryable("the gate stayed shut")
    return "opened"


def after_hold(ctx: stepd.StepContext, value: Any) -> dict[str, Any]:
    return {"after": "the kill"}


def evil(ctx: stepd.StepContext, value: Any) -> dict[str, Any]:
    with ctx.span(HOSTILE_SPAN, **{HOSTILE: "javascript:alert(10)", "href": "javascript:alert(11)"}) as span:
        span.set_usage(model=HOSTILE, input_tokens=5, output_tokens=7)
    ctx.patch_state({HOSTILE: HOSTILE_OUTPUT["script"], "link": "javascript:alert(12)"})
    return HOSTILE_OUTPUT


def evil_end(ctx: stepd.StepContext, value: Any) -> dict[str, Any]:
    if value.get("fail"):
        raise stepd.StepFailure(HOSTILE_CLASS, HOSTILE_MESSAGE)
    return HOSTILE_OUTPUT


DEMO = (
    stepd.Workflow("console-demo", version="demo.v1")
    .then(classify)
    .for_each("${state.tasks}", work, into="results", max_parallel=2)
    .then(finish)
    .budget(max_transitions=10, max_cost_units=12, max_state_bytes=4096)
)
GATED = stepd.Workflow("console-gated", version="gated.v1").then(hold).then(after_hold)
EVIL = (
    stepd.Workflow(HOSTILE_WORKFLOW, version=HOSTILE_VERSION)
    .then(evil)
    .then(evil_end, retry=stepd.Retry(max_attempts=1))
)


@dataclass
class World:
    daemon: DaemonProcess
    demo_runs: list[str]
    gated_run: str
    evil_failed: str
    evil_completed: str
    shots: Path
    workers: list[stepd.Worker] = field(default_factory=list)


def _serve(worker: stepd.Worker) -> threading.Thread:
    thread = threading.Thread(target=worker.serve, kwargs={"handle_signals": False}, daemon=True)
    thread.start()
    assert worker.wait_ready(15), "the worker did not register"
    return thread


@pytest.fixture(scope="module")
def world(keyed: DaemonProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    GATE.clear()
    wclient = stepd.Client(keyed.url, key=KEYS["worker"])
    good = stepd.Worker(wclient, concurrency=4, name="console-worker").register(DEMO, GATED)
    bad = stepd.Worker(wclient, concurrency=2, name=HOSTILE).register(EVIL)
    threads = [_serve(good), _serve(bad)]
    client = stepd.Client(keyed.url, key=KEYS["execute"])
    reader = stepd.Client(keyed.url, key=KEYS["read"])
    try:
        demo = [client.start(DEMO, {"n": i}, idempotency_key=f"ticket:{i}",
                             correlation={"ticket": i}) for i in range(4)]
        failed = client.start(EVIL, {"fail": True}, idempotency_key=HOSTILE,
                              correlation={HOSTILE: HOSTILE_OUTPUT["url"]})
        completed = client.start(EVIL, {"fail": False, "x": HOSTILE_OUTPUT["script"]})
        for handle in [*demo, completed]:
            assert reader.result(handle.run_id, timeout=30) is not None
        with pytest.raises(stepd.RunFailed):
            reader.result(failed.run_id, timeout=30)
        gated = client.start(GATED, {"gate": 1})
        deadline = time.monotonic() + 15
        while reader.status(gated.run_id).current_steps != ("hold",) or not _holding(keyed):
            assert time.monotonic() < deadline, "the gated step never started"
            time.sleep(0.05)
        target = os.environ.get("STEPD_CONSOLE_SCREENSHOTS")
        shots = Path(target) if target else tmp_path_factory.mktemp("shots")
        shots.mkdir(parents=True, exist_ok=True)
        yield World(keyed, [h.run_id for h in demo], gated.run_id, failed.run_id,
                    completed.run_id, shots, [good, bad])
    finally:
        GATE.set()
        for worker in (good, bad):
            worker.stop(grace=5)
        for thread in threads:
            thread.join(10)
        for c in (wclient, client, reader):
            c.close()


def _holding(d: DaemonProcess) -> bool:
    with d.client(KEYS["read"]) as c:
        return any(lease["step_id"] == "hold" and lease.get("status") == "started"
                   for w in c.get("/v1/api/workers").json()["workers"] for lease in w["leases"])


# --------------------------------------------------------------------------- pages


def rows(page: Any) -> list[str]:
    """The run ids of the runs table, in order."""
    page.locator("table.grid tbody tr").first.wait_for()
    return list(page.locator("table.grid tbody tr[data-run]").evaluate_all(
        "trs => trs.map(tr => tr.dataset.run)"))


def cleared_form(page: Any) -> None:
    """Wait until the runs page shows its unfiltered form. A filter submits the form it
    sits in, whole: acting on the page before the old form is replaced would carry
    its filters (a workflow, an idempotency key) into the new query."""
    page.wait_for_function(
        "() => location.hash === '#/runs' && [...document.querySelectorAll("
        "'form input[name], form select[name]')].every(e => e.value === '')",
        timeout=TIMEOUT_MS)


def wait_rows(page: Any, predicate: Any, what: str) -> list[str]:
    deadline = time.monotonic() + TIMEOUT_MS / 1000
    while True:
        got = rows(page)
        if predicate(got):
            return got
        assert time.monotonic() < deadline, f"{what}: {got}"
        page.wait_for_timeout(100)


# --------------------------------------------------------------------------- tests


def test_a_read_key_signs_in_and_sees_no_action(browser: Any, world: World) -> None:
    page, watch = open_page(browser, world.daemon.url)
    page.locator("#key").wait_for()
    shoot(page, world, "signin")
    sign_in(page, "not-a-key-of-this-daemon", refused=True)
    sign_in(page, KEYS["read"])
    assert page.locator("#who").inner_text() == "read key"
    assert page.evaluate("sessionStorage.getItem('stepd.console.key')") == KEYS["read"]
    wait_rows(page, lambda r: set(world.demo_runs) <= set(r), "every run listed")
    for route in ("#/runs", f"#/runs/{world.demo_runs[0]}", "#/workers", "#/definitions",
                  "#/actors"):
        goto(page, route)
        page.locator("main h1").first.wait_for()
        page.wait_for_timeout(300)
        assert page.locator("main button.danger").count() == 0, route
    page.get_by_text("The actor tree needs an admin key").wait_for()
    page.locator("#signout").click()
    page.locator("#key").wait_for()
    assert page.evaluate("sessionStorage.getItem('stepd.console.key')") is None
    assert_clean(page, watch)
    page.close()


def test_runs_newest_first_with_filters_and_live_counts(browser: Any, world: World) -> None:
    page, watch = open_page(browser, world.daemon.url)
    sign_in(page, KEYS["read"])
    listed = wait_rows(page, lambda r: len(r) >= 7, "all runs")
    with world.daemon.client(KEYS["read"]) as c:
        api = [r["run_id"] for r in c.get("/v1/api/runs").json()["runs"]]
        stats = c.get("/v1/api/stats").json()
    assert listed == api  # newest first, as the API orders them
    for status in ("completed", "failed", "running"):
        chip = page.locator(f".chips .chip.s-{status} b")
        assert chip.inner_text() == str(stats["runs_by_status"][status]), status
    shoot(page, world, "runs")

    # Workflow (typed, applied with the button) ...
    page.locator("input[name=workflow]").fill("console-demo")
    page.get_by_role("button", name="Apply").click()
    wait_rows(page, lambda r: sorted(r) == sorted(world.demo_runs), "workflow filter")
    assert "workflow=console-demo" in page.url
    # ... status (a select applies at once) ...
    page.locator("a[href='#/runs']", has_text="Clear").click()
    cleared_form(page)
    page.locator("select[name=status]").select_option("failed")
    wait_rows(page, lambda r: r == [world.evil_failed], "status filter")
    # ... idempotency key, correlation (JSON), time range.
    goto(page, "#/runs?key=ticket%3A2")
    wait_rows(page, lambda r: r == [world.demo_runs[2]], "idempotency key filter")
    goto(page, "#/runs")
    cleared_form(page)
    page.locator("input[name=correlation]").fill('{"ticket": 1}')
    page.get_by_role("button", name="Apply").click()
    wait_rows(page, lambda r: r == [world.demo_runs[1]], "correlation filter")
    goto(page, "#/runs?since=15m&workflow=console-demo")
    wait_rows(page, lambda r: sorted(r) == sorted(world.demo_runs), "since 15 minutes")
    assert page.locator("select[name=since]").input_value() == "15m"
    goto(page, "#/runs?after=2001-01-01T00%3A00&before=2001-01-02T00%3A00")
    page.get_by_text("No run matches these filters.").wait_for()
    assert page.locator("select[name=since]").input_value() == "range"
    goto(page, "#/runs?order=asc&workflow=console-demo")
    wait_rows(page, lambda r: r == world.demo_runs, "oldest first")
    # A short page with a cursor: "More" follows it.
    goto(page, "#/runs?limit=2")
    first = wait_rows(page, lambda r: len(r) == 2, "a page of two")
    page.get_by_role("button", name="More").click()
    more = wait_rows(page, lambda r: len(r) == 4, "two more")
    assert more[:2] == first and more == api[:4]
    # A refused filter says which field.
    goto(page, "#/runs?key=" + "k" * 300)
    page.locator("p.error", has_text="idempotency_key").wait_for()
    assert_clean(page, watch)
    page.close()


def test_a_run_with_its_budgets_journal_and_waterfall(browser: Any, world: World) -> None:
    run_id = world.demo_runs[0]
    with world.daemon.client(KEYS["read"]) as c:
        export = c.get(f"/v1/api/runs/{run_id}/export").json()
    page, watch = open_page(browser, world.daemon.url)
    sign_in(page, KEYS["read"])
    wait_rows(page, lambda r: run_id in r, "the run listed")
    page.locator(f"tr[data-run='{run_id}'] a", has_text=run_id).click()
    page.locator(".run-head .badge", has_text="completed").wait_for()
    body = page.locator("main").inner_text()
    status = export["status"]
    for text in (run_id, "demo.v1", status["definition_hash"], "ticket:0", '{"ticket":0}'):
        assert text in body, text
    # Budgets: usage against limits.
    assert page.locator(".budget[data-budget=max_transitions] .value").inner_text() == \
        f"{status['budget']['usage']['transitions']} / 10"
    assert page.locator(".budget[data-budget=max_cost_units] .value").inner_text() == \
        f"{status['budget']['usage']['cost_units']} / 12"
    width = page.locator(".budget[data-budget=max_transitions] .fill").evaluate(
        "el => el.style.width")
    assert float(width.rstrip("%")) == status["budget"]["usage"]["transitions"] * 10
    assert page.locator(".budget[data-budget=max_started_workflows] .value").inner_text() == \
        "0 · no limit"
    tokens = f"{status['usage']['input_tokens']:,}"
    assert page.locator(".tile b").first.inner_text() == tokens
    assert status["usage"]["cost_usd"] > 0  # priced by the daemon's price book
    assert page.locator(".tile b").nth(2).inner_text().startswith("$0.00")
    # The journal: one row per event.
    assert page.locator("table.journal tbody tr").count() == len(export["journal"])
    # The waterfall: one row per attempt, one per span, nested under their attempt.
    offered = [e for e in export["journal"] if e["type"] == "step_offered"]
    assert page.locator(".wf-row.attempt").count() == len(offered) == 5
    assert page.locator(".wf-row.span").count() == len(export["spans"]) == 7
    assert page.locator(".wf-row.step").count() == 1  # the for_each
    first_span = page.locator(".wf-row.span").first
    assert "llm.call" in first_span.inner_text()
    assert "212 in · 4 out" in first_span.inner_text()  # classify of {"n": 0}
    assert page.locator(".wf-row.span .wf-meta .cost").count() == 4  # the llm.calls, priced
    bars = page.locator(".wf-row.attempt .bar.run.o-completed")
    assert bars.count() == 5
    left = [float(v.rstrip("%")) for v in page.locator(".wf-row.attempt .bar.run").evaluate_all(
        "bs => bs.map(b => b.style.left)")]
    assert left[0] < left[-1]  # later attempts start further right
    page.locator(".wf-row.span").first.click()
    page.locator(".wf-detail:visible pre", has_text='"model": "fast-1"').wait_for()
    shoot(page, world, "run")
    assert_clean(page, watch)
    page.close()


def test_workers_connected_first_with_definitions_and_live_leases(browser: Any,
                                                                  world: World) -> None:
    page, watch = open_page(browser, world.daemon.url)
    sign_in(page, KEYS["read"])
    goto(page, "#/workers")
    good = page.locator("tr", has_text="console-worker")
    good.locator("a", has_text=world.gated_run).wait_for()  # its live lease, linked to its run
    assert "hold" in good.inner_text() and "started" in good.inner_text()
    assert good.locator(".conn.on").count() == 1
    assert "console-demo" in good.inner_text() and "console-gated" in good.inner_text()
    ids = page.locator("tr[data-worker]").evaluate_all("trs => trs.map(t => t.dataset.worker)")
    with world.daemon.client(KEYS["read"]) as c:
        assert ids == [w["worker_id"] for w in c.get("/v1/api/workers").json()["workers"]]
    shoot(page, world, "workers")
    goto(page, "#/definitions")
    page.locator("tr", has_text="console-demo").first.wait_for()
    with world.daemon.client(KEYS["read"]) as c:
        defs = c.get("/v1/api/definitions").json()["definitions"]
    for d in defs:
        row = page.locator(f"tr[data-hash='{d['definition_hash']}']")
        assert d["definition_hash"][:12] in row.inner_text()
    demo = page.locator("tr", has_text="demo.v1")
    assert "max_transitions 10" in demo.inner_text()
    demo.locator("summary").click()
    demo.locator("pre", has_text='"for_each"').wait_for()
    shoot(page, world, "definitions")
    assert_clean(page, watch)
    page.close()


def test_an_admin_kills_a_run_actor_and_watches_the_run_finish(browser: Any,
                                                               world: World) -> None:
    run_id = world.gated_run
    path = f"/runs/{run_id}"
    page, watch = open_page(browser, world.daemon.url)
    sign_in(page, KEYS["admin"])
    assert page.locator("#who").inner_text() == "admin key"
    goto(page, "#/actors")
    page.locator("tr[data-path='/registry'] button", has_text="Kill").wait_for()
    page.locator("input[type=search]").fill(run_id)
    row = page.locator(f"tr[data-path='{path}']")
    row.wait_for()
    page.locator("input[type=search]").fill("")  # the whole tree, for the picture
    page.locator("tr[data-path='/leases']").wait_for()
    shoot(page, world, "actors")
    page.locator("input[type=search]").fill(run_id)
    row.locator("button", has_text="Kill").click()
    row.locator("button", has_text="Confirm kill").click()
    page.locator(".banner.ok", has_text=f"Killed {path}").wait_for()
    with world.daemon.client(KEYS["admin"]) as c:
        deadline = time.monotonic() + 5
        while True:
            entries = c.get("/v1/api/audit", params={"limit": 50}).json()["entries"]
            if any(e["action"] == "actors.kill" and e["target"] == path and e["status"] == 200
                   for e in entries):
                break
            assert time.monotonic() < deadline, entries
            time.sleep(0.05)
    # The run page, live: the gate opens and the run finishes, without a reload.
    goto(page, f"#/runs/{run_id}")
    page.locator(".run-head .badge", has_text="running").wait_for()
    page.evaluate("window.__stillHere = 1")
    GATE.set()
    page.locator(".run-head .badge", has_text="completed").wait_for(timeout=20_000)
    assert page.evaluate("window.__stillHere") == 1  # updated in place, not reloaded
    assert '"after": "the kill"' in page.locator(".card.data", has_text="Result").inner_text()
    assert page.locator(".wf-row.attempt.o-completed").count() == 2
    assert_clean(page, watch)
    page.close()


def test_nothing_a_worker_or_client_wrote_ever_runs(browser: Any, world: World) -> None:
    page, watch = open_page(browser, world.daemon.url)
    sign_in(page, KEYS["admin"])
    wait_rows(page, lambda r: world.evil_failed in r, "the hostile runs listed")
    assert page.get_by_text(HOSTILE_WORKFLOW, exact=True).count() >= 2
    assert_clean(page, watch)

    goto(page, f"#/runs/{world.evil_failed}")
    page.locator(".run-head .badge", has_text="failed").wait_for()
    main = page.locator("main")
    text = main.inner_text()
    for hostile in (HOSTILE, HOSTILE_VERSION, HOSTILE_SPAN, HOSTILE_CLASS, HOSTILE_MESSAGE,
                    HOSTILE_OUTPUT["url"]):
        assert hostile in text, hostile  # shown, as text
    page.locator(".wf-row.span").first.click()
    page.locator(".wf-detail:visible pre", has_text="javascript:alert(10)").wait_for()
    shoot(page, world, "hostile")
    assert_clean(page, watch)

    # Trusted Types (the CSP): a string assigned to an HTML sink throws instead of being parsed.
    assert page.evaluate("""() => {
        try { document.createElement('div').innerHTML = '<b>x</b>'; return 'parsed'; }
        catch (e) { return e.name; } }""") == "TypeError"
    watch.console.clear()  # the refusal just provoked (the page's own were checked above)

    goto(page, f"#/runs/{world.evil_completed}")
    page.locator(".run-head .badge", has_text="completed").wait_for()
    assert HOSTILE_OUTPUT["script"] in page.locator(".card.data", has_text="Result").inner_text()
    assert_clean(page, watch)

    for route, marker in (("#/workers", HOSTILE), ("#/definitions", HOSTILE_WORKFLOW),
                          ("#/actors", "registry")):
        goto(page, route)
        page.get_by_text(marker, exact=True).first.wait_for()
        assert_clean(page, watch)
    # A run id, a route and a filter from the URL are data too.
    goto(page, "#/runs/" + "%3Cimg%20src%3Dx%20onerror%3Dalert(13)%3E")
    page.get_by_text("No such run").wait_for()
    goto(page, "#/runs?workflow=%3Cimg%20src%3Dx%20onerror%3Dalert(14)%3E")
    page.get_by_text("No run matches these filters.").wait_for()
    assert_clean(page, watch)
    page.close()


def test_a_keyless_daemon_serves_its_console_on_loopback(browser: Any,
                                                         keyless: DaemonProcess) -> None:
    page, watch = open_page(browser, keyless.url)
    page.locator("#who", has_text="no keys").wait_for()
    assert page.locator("#key").count() == 0
    goto(page, "#/actors")
    page.locator("tr[data-path='/timers'] button", has_text="Kill").click()
    page.locator("tr[data-path='/timers'] button", has_text="Confirm kill").click()
    page.locator(".banner.ok", has_text="Killed /timers").wait_for()  # a same-origin POST
    assert_clean(page, watch)
    page.close()


def test_the_screenshots_are_pictures(browser: Any, world: World) -> None:
    """Runs last in this module: every page was photographed (docs/console.md shows them).
    Without a browser (``browser`` skips) nothing was photographed, so it skips too."""
    for name in ("signin", "runs", "run", "workers", "actors", "definitions", "hostile"):
        shot = world.shots / f"{name}.png"
        assert shot.is_file() and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    if os.environ.get("STEPD_CONSOLE_SCREENSHOTS") is None:
        shutil.rmtree(world.shots, ignore_errors=True)

