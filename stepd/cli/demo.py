"""``stepd demo``: an embedded daemon, a worker and a real workflow, end to end, in seconds.

The workflow is a compact version of examples/support.py (seed 000's support
workflow): ``classify`` and ``draft`` (model calls recorded as spans with token
usage, a state patch that plans the tasks), a ``for_each`` over the tasks (one
item fails once with ``Retryable`` and is retried), a ``wait`` for the
``approved`` signal (the demo plays the reviewer and sends it), and ``send``
(``at_most_once``). Token usage is priced by a small built-in price book.

The journal is shown live as events are committed; then each run's final
status (result, budget usage, tokens, cost). Exit status 0 when every run
completed with the expected result, 1 otherwise.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Final

import anyio
import click

from stepd.cli.common import EXIT_ERROR, CliError

__all__ = ["demo", "demo_prices", "demo_workflow"]

TIMEOUT_S: Final = 60.0
POLL_S: Final = 0.05

PRICES: Final = {
    "models": {
        "demo-small": {"input_per_million": 0.25, "output_per_million": 1.25},
        "demo-large": {"input_per_million": 3.0, "output_per_million": 15.0},
    }
}

TICKETS: Final[list[dict[str, Any]]] = [
    {"ticket": 101, "customer": "ada@example.com", "text": "I was charged twice for my invoice"},
    {"ticket": 102, "customer": "alan@example.com", "text": "The export button crashes the app"},
    {"ticket": 103, "customer": "grace@example.com", "text": "Please reset my account password"},
    {"ticket": 104, "customer": "edsger@example.com", "text": "Refund for the duplicate charge?"},
    {"ticket": 105, "customer": "barbara@example.com", "text": "Login fails after the update"},
]

PLANS: Final = {
    "billing": ["look up the invoices", "check for a duplicate charge", "prepare the refund"],
    "bug": ["reproduce the crash", "find a workaround"],
    "account": ["verify the identity", "send a reset link"],
}


def _label(text: str) -> str:
    lowered = text.lower()
    if any(w in lowered for w in ("charge", "invoice", "refund")):
        return "billing"
    if any(w in lowered for w in ("crash", "fails", "error")):
        return "bug"
    return "account"


def _tokens(text: str) -> int:
    return max(1, len(text) // 4)


# --------------------------------------------------------------------------- bodies


async def classify(ctx: Any, input: Any) -> dict[str, Any]:
    with ctx.span("llm.call", model="demo-small", purpose="classify") as span:
        await anyio.sleep(0.05)  # the model call
        label = _label(input["text"])
        span.set_usage(model="demo-small", input_tokens=400 + _tokens(input["text"]),
                       output_tokens=3)
    ctx.patch_state(label=label, tasks=PLANS[label])
    return {"label": label}


async def draft(ctx: Any, input: Any) -> dict[str, Any]:
    with ctx.span("draft.reply") as outer:
        outer.set_attribute("label", ctx.state["label"])
        with ctx.span("llm.call", model="demo-large", purpose="draft") as span:
            await anyio.sleep(0.08)
            text = f"Hello, about your {ctx.state['label']} request (ticket {input['ticket']}): ..."
            span.set_usage(model="demo-large", input_tokens=1200, output_tokens=_tokens(text) * 4)
    return {"text": text}


async def execute_task(ctx: Any, task: str) -> dict[str, Any]:
    if ctx.item_index == 1 and ctx.attempt == 1:
        await anyio.sleep(0.02)
        # A transient failure: the step is retried (its retry policy), the run goes on.
        from stepd._errors import Retryable

        raise Retryable("upstream 503 (simulated)")
    with ctx.span("tool.call", tool="crm") as tool:
        await anyio.sleep(0.03)
        with ctx.span("llm.call", model="demo-small", purpose="summarise") as span:
            await anyio.sleep(0.03)
            span.set_usage(model="demo-small", input_tokens=300, output_tokens=40)
        tool.set_attribute("ok", True)
    return {"task": task, "done": True, "attempt": ctx.attempt}


def send(ctx: Any, input: Any, steps: dict[str, Any]) -> dict[str, Any]:
    approval = steps["approved"] or {}
    return {"sent": bool(approval.get("approved")), "to": input["customer"],
            "approved_by": approval.get("by"), "tasks_done": len(steps["execute_task"])}


def demo_workflow() -> Any:
    """The demo's workflow (a builder)."""
    import stepd

    return (
        stepd.Workflow("demo_support", version="demo.v1")
        .then(classify)
        .then(draft, retry=stepd.Retry(max_attempts=5), timeout="2m")
        .for_each("${state.tasks}", execute_task, into="results", max_parallel=4,
                  retry=stepd.Retry(max_attempts=3, initial_backoff="50ms"))
        .wait("approved", timeout="1h", into="approval")
        .then(send, delivery="at_most_once")
        .budget(max_transitions=20, max_cost_units=40)
    )


def demo_prices() -> Any:
    """The demo's price book (USD per million tokens)."""
    from stepd.sansio.pricing import PriceBook

    return PriceBook.from_dict(PRICES)


# --------------------------------------------------------------------------- the command


def _summary_table(rows: list[tuple[int, Any, Any]]) -> Any:
    from rich.table import Table

    from stepd.cli.render import STATUS_STYLE

    table = Table(title="runs", title_justify="left", show_edge=False, pad_edge=False)
    table.add_column("#", justify="right")
    table.add_column("ticket", justify="right")
    table.add_column("run", no_wrap=True)
    table.add_column("status")
    table.add_column("label")
    table.add_column("sent", justify="center")
    table.add_column("steps", justify="right")
    table.add_column("units", justify="right")
    table.add_column("tokens in/out", justify="right", no_wrap=True)
    table.add_column("USD", justify="right")
    for number, ticket, status in rows:
        usage = status.budget.usage
        sent = isinstance(status.result, dict) and status.result.get("sent")
        table.add_row(str(number), str(ticket["ticket"]), status.run_id,
                      f"[{STATUS_STYLE.get(status.status, '')}]{status.status}[/]",
                      str(status.state.get("label", "")), "yes" if sent else "no",
                      str(usage.get("transitions", 0)), str(usage.get("cost_units", 0)),
                      f"{status.usage.input_tokens:,}/{status.usage.output_tokens:,}",
                      f"{status.usage.cost_usd:.6f}")
    return table


@click.command()
@click.option("--data", type=click.Path(file_okay=False), default=None, metavar="DIR",
              help="keep the daemon's data in DIR (default: a temporary directory, removed after)")
@click.option("--runs", type=click.IntRange(1, 50), default=3, show_default=True, metavar="N",
              help="how many support tickets to run")
def demo(data: str | None, runs: int) -> None:
    """Run a real workflow end to end on an embedded daemon, showing its journal live.

    No daemon to start, nothing to configure: an embedded daemon (in a temporary
    directory unless --data), a worker with 8 slots, and N support tickets run
    through classify, draft, a for_each over the planned tasks, an approval
    wait (the demo sends the signal) and send.
    """
    with contextlib.ExitStack() as stack:
        if data is None:
            path = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="stepd-demo-")))
            path = path / "data"
        else:
            path = Path(data)
        ok = _run_demo(path, runs, keep=data is not None)
    if not ok:
        raise CliError("the demo did not complete every run as expected", EXIT_ERROR)


def _run_demo(path: Path, n: int, *, keep: bool) -> bool:
    import stepd
    from stepd.cli.common import console
    from stepd.cli.render import journal_line, status_view

    out = console()
    wf = demo_workflow()
    t0 = time.monotonic()
    out.print(f"[bold]stepd demo[/]: {n} support ticket{'s' if n != 1 else ''}, one worker "
              f"(8 slots), an embedded daemon on {path}")
    out.print(f"workflow [bold]{wf.name}[/] {wf.version} (hash {wf.definition_hash[:12]}): "
              "classify, draft, for_each execute_task, wait 'approved', send\n")
    session = f"{time.time_ns():x}"
    tickets: list[dict[str, Any]] = []
    for i in range(n):
        base = TICKETS[i % len(TICKETS)]
        tickets.append({**base, "ticket": base["ticket"] + 100 * (i // len(TICKETS))})
    with stepd.embedded(path, prices=demo_prices()) as daemon:
        client = stepd.Client(daemon)
        worker = stepd.Worker(client, concurrency=8, name="demo-worker").register(wf)
        errors: list[BaseException] = []

        def serve() -> None:
            try:
                worker.serve(handle_signals=False)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        thread = threading.Thread(target=serve, name="stepd-demo-worker", daemon=True)
        thread.start()
        try:
            if not worker.wait_ready(10):
                raise CliError(f"the worker did not register: {errors}", EXIT_ERROR)
            handles = []
            for ticket in tickets:
                handles.append(client.start(wf, ticket,
                                            idempotency_key=f"demo:{session}:{ticket['ticket']}"))
            again = client.start(wf, tickets[0],
                                 idempotency_key=f"demo:{session}:{tickets[0]['ticket']}")
            labels = {h.run_id: f"#{i + 1}" for i, h in enumerate(handles)}
            same = again == handles[0] and not again.created
            out.print(f"started {n} run{'s' if n != 1 else ''}; ticket {tickets[0]['ticket']} "
                      f"started again with its idempotency key: "
                      f"{'the same run' if same else 'ANOTHER run'} ({again.run_id})\n")
            _watch(client, handles, labels, out, journal_line)
        finally:
            worker.stop()
            thread.join(30)
        finals = [(i + 1, tickets[i], client.status(h)) for i, h in enumerate(handles)]
        first_journal = client.journal(handles[0])
    out.print()
    out.print(_summary_table(finals))
    total_in = sum(s.usage.input_tokens for _, _, s in finals)
    total_out = sum(s.usage.output_tokens for _, _, s in finals)
    total_cost = sum(s.usage.cost_usd for _, _, s in finals)
    out.print("steps: transitions (max_transitions); units: cost units (max_cost_units)",
              style="dim")
    out.print(f"\ntotal: {total_in:,} input and {total_out:,} output tokens, ${total_cost:.6f}\n"
              "(built-in price book, USD per million tokens in/out: demo-small 0.25/1.25, "
              "demo-large 3/15)")
    out.print("\n[bold]status of run #1[/] (what 'stepd run status' shows):")
    out.print(status_view(finals[0][2], full=False))
    workers_seen = sorted({str(e.get("worker_name")) for e in first_journal
                           if e.get("type") == "step_offered"})
    out.print(f"\nrun #1: {len(first_journal)} journal events, steps offered to "
              f"{', '.join(workers_seen)}")
    ok = all(s.status == "completed" and isinstance(s.result, dict) and s.result.get("sent")
             for _, _, s in finals)
    elapsed = time.monotonic() - t0
    verdict = "[green]every run completed[/]" if ok else "[red]some runs did not complete[/]"
    out.print(f"{verdict} in {elapsed:.2f} s")
    if keep:
        out.print(f"\nThe data stays in {path}. Inspect it with a daemon:\n"
                  f"  stepd serve --data {path} &\n"
                  f"  stepd run list\n  stepd run journal {finals[0][2].run_id}")
    if errors:
        raise CliError(f"the worker stopped with {errors[0]!r}", EXIT_ERROR)
    return ok


def _watch(client: Any, handles: list[Any], labels: dict[str, str], out: Any,
           journal_line: Any) -> None:
    """Print each run's journal events as they are committed; approve waiting runs."""
    seen: dict[str, int] = {h.run_id: 0 for h in handles}
    names: dict[str, str] = {}
    approved: set[str] = set()
    done: set[str] = set()
    origin: int | None = None
    deadline = time.monotonic() + TIMEOUT_S
    terminal = {"run_completed", "run_failed", "run_cancelled", "run_timed_out"}
    while len(done) < len(handles):
        if time.monotonic() > deadline:
            raise CliError(f"the demo's runs did not finish within {TIMEOUT_S:g} s", EXIT_ERROR)
        fresh: list[tuple[int, str, dict[str, Any]]] = []
        for h in handles:
            if h.run_id in done:
                continue
            for e in client.journal(h):
                if e["seq"] > seen[h.run_id]:
                    fresh.append((e["at"], h.run_id, e))
                    seen[h.run_id] = e["seq"]
        fresh.sort(key=lambda x: (x[0], x[1], x[2]["seq"]))
        for _, run_id, e in fresh:
            if e.get("worker_id") and e.get("worker_name"):
                names[e["worker_id"]] = e["worker_name"]
            if origin is None:
                origin = e["at"]
            line = journal_line(e, run=labels[run_id], names=names, origin_ms=origin)
            line.rstrip()
            line.truncate(out.width, overflow="ellipsis")
            out.print(line)
            if e["type"] == "step_scheduled" and e.get("kind") == "wait" and run_id not in approved:
                approved.add(run_id)
                payload = {"approved": True, "by": "lead@example.com"}
                client.signal(run_id, "approved", payload)
                out.print(f"[bold yellow]{' ' * 8}  {labels[run_id]:<3}  the reviewer approves: "
                          f"signal 'approved', payload {json.dumps(payload)}[/]")
            if e["type"] in terminal:
                done.add(run_id)
        if len(done) < len(handles):
            time.sleep(POLL_S)
