"""Seed 000's support workflow: classify, draft, a for_each over tasks, an approval, send.

    python examples/support.py                     # on an embedded daemon (a temporary directory)
    python examples/support.py --tickets 6
    python examples/support.py --url http://127.0.0.1:7707 [--key KEY]   # on `stepd serve`

A `stepd.Worker` with concurrency 8 serves the bodies. Each body records its
model calls as spans with token usage (the daemon sums and prices them), one
patches the run's state (the label and the planned tasks), the `for_each` runs
the tasks four at a time, the run then waits for an `approved` signal (sent
below, as a reviewer would: one ticket is rejected), and `send` runs
`at_most_once`. It prints each ticket's result, tokens and cost.

The "model" is a deterministic stand-in (`call_model`): replace it with your
client; the span around it is all stepd needs. Embedded, the price book below
prices the tokens; against `stepd serve`, the daemon's own (`--prices FILE`)
does, and models it does not list cost 0.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from typing import Any

import stepd
from stepd.sansio.pricing import PriceBook

PRICES = PriceBook.from_dict({"models": {
    "fast-1": {"input_per_million": 0.25, "output_per_million": 1.25},
    "smart-1": {"input_per_million": 3.0, "output_per_million": 15.0},
}})

TICKETS = [
    {"ticket": 42, "customer": "ada@example.com", "text": "I was charged twice for invoice 1001"},
    {"ticket": 43, "customer": "alan@example.com", "text": "The app crashes when I export a report"},
    {"ticket": 44, "customer": "grace@example.com", "text": "How do I change my account email?"},
    {"ticket": 45, "customer": "edsger@example.com", "text": "Refund please: duplicate charge"},
]


def call_model(model: str, prompt: str, answer: str) -> str:
    """A stand-in for a model call, recorded as a span of the running step.

    `stepd.current_context()` finds the step this code runs in, however deep in
    the call stack: a model-client wrapper needs no `ctx` argument.
    """
    ctx = stepd.current_context()
    with ctx.span("llm.call", model=model) as span:
        time.sleep(0.01)  # the network round trip
        span.set_usage(model=model, input_tokens=len(prompt) // 4 + 200,
                       output_tokens=len(answer) // 4 + 1)
    return answer


# --------------------------------------------------------------------------- bodies


def classify(ctx: stepd.StepContext, input: dict[str, Any]) -> dict[str, Any]:
    text = input["text"].lower()
    label = ("billing" if any(w in text for w in ("charge", "invoice", "refund"))
             else "bug" if "crash" in text else "account")
    call_model("fast-1", f"Classify this ticket: {input['text']}", label)
    ctx.patch_state(label=label)                       # merged into the run's state on complete
    return {"label": label}


def draft(ctx: stepd.StepContext, input: dict[str, Any]) -> dict[str, Any]:
    label = ctx.state["label"]                         # the state, with classify's patch
    plan = {"billing": ["find the invoices", "check for a duplicate charge"],
            "bug": ["reproduce the crash", "look for a known issue", "suggest a workaround"],
            "account": ["explain the settings page"]}[label]
    with ctx.span("draft.reply", label=label):         # a span with child spans
        with ctx.span("kb.search", query=label):
            time.sleep(0.005)
        reply = call_model("smart-1", f"Draft a reply about {label}: {input['text']}",
                           f"Dear customer, about your {label} question: we are on it.")
    ctx.patch_state(tasks=plan)                        # the for_each below expands this list
    return {"reply": reply}


def execute_task(ctx: stepd.StepContext, task: str) -> dict[str, Any]:
    # One item of the for_each; `ctx.idempotency_key` is stable across its retries.
    with ctx.span("tool.call", tool="crm", task=task):
        note = call_model("fast-1", f"Do: {task}", f"{task}: done")
    return {"task": task, "note": note, "key": ctx.idempotency_key}


def send(ctx: stepd.StepContext, input: dict[str, Any], steps: dict[str, Any]) -> dict[str, Any]:
    approval = steps["approved"]                       # the signal's payload
    if not approval.get("approved"):
        return {"sent": False, "escalated_to": approval.get("by")}
    return {"sent": True, "to": input["customer"], "reply": steps["draft"]["reply"],
            "tasks_done": len(steps["execute_task"])}


support = (
    stepd.Workflow("support", version="support.v2")
    .then(classify)
    .then(draft, retry=stepd.Retry(max_attempts=5), timeout="2m")
    .for_each("${state.tasks}", execute_task, into="results", max_parallel=4)
    .wait("approved", timeout="1h", into="approval")
    .then(send, delivery="at_most_once")
    .budget(max_transitions=20, max_cost_units=40)
)


# --------------------------------------------------------------------------- driving it


def wait_for(client: stepd.Client, run: stepd.RunHandle, timeout: float = 30.0) -> stepd.RunStatus:
    """Poll until the run waits for a signal or is over."""
    deadline = time.monotonic() + timeout
    while True:
        status = client.status(run)
        if status.waiting_for or status.done:
            return status
        if time.monotonic() > deadline:
            raise TimeoutError(f"run {run} is still {status.status}")
        time.sleep(0.02)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", help="a running daemon (default: an embedded one)")
    parser.add_argument("--key", help="its API key")
    parser.add_argument("--tickets", type=int, default=4, help="how many tickets (default 4)")
    parser.add_argument("--data", help="the embedded daemon's data directory (default: temporary)")
    args = parser.parse_args()

    with ExitStack() as stack:
        if args.url:
            target: Any = args.url
            print(f"daemon: {args.url} (its price book prices the tokens)")
        else:
            data = args.data or stack.enter_context(tempfile.TemporaryDirectory()) + "/data"
            target = stack.enter_context(stepd.embedded(data, prices=PRICES))
            print(f"daemon: embedded, data in {data}")
        client = stack.enter_context(stepd.Client(target, key=args.key))
        worker = stepd.Worker(client, concurrency=8, name="support-worker").register(support)
        thread = threading.Thread(target=worker.serve, kwargs={"handle_signals": False})
        thread.start()
        stack.callback(thread.join, 30)
        stack.callback(worker.stop)
        if not worker.wait_ready(10):
            print("the worker did not register", file=sys.stderr)
            return 1
        print(f"worker {worker.worker_id} serves {support.name} {support.version} "
              f"(hash {support.definition_hash[:12]}) over {worker.transport}, concurrency 8")

        tickets = [{**TICKETS[i % len(TICKETS)],
                    "ticket": TICKETS[i % len(TICKETS)]["ticket"] + 100 * (i // len(TICKETS))}
                   for i in range(args.tickets)]
        runs = []
        for t in tickets:
            run = client.start(support, t, idempotency_key=f"ticket:{t['ticket']}",
                               correlation={"ticket": t["ticket"]})
            runs.append(run)
            print(f"ticket {t['ticket']}: run {run}" + ("" if run.created else " (existing run)"))

        # The reviewer: approve every ticket but the last one.
        for i, run in enumerate(runs):
            status = wait_for(client, run)
            if status.waiting_for == "approved":
                approved = i < len(runs) - 1
                run.signal("approved", {"approved": approved, "by": "lead@example.com"})
                print(f"ticket {tickets[i]['ticket']}: waited for 'approved' with "
                      f"{len(status.state['results'])} task(s) done; sent approved={approved}")

        print()
        print(f"{'ticket':>6}  {'run':<28}  {'label':<8}  {'result':<40}  {'tokens in/out':>13}  "
              f"{'cost USD':>9}")
        total_in = total_out = 0
        total_cost = 0.0
        failed = 0
        for t, run in zip(tickets, runs):
            try:
                result = run.result(timeout=30)
            except stepd.RunFailed as exc:
                failed += 1
                result = f"{exc.status}: {exc.reason}: {exc.message}"
            s = client.status(run)
            total_in += s.usage.input_tokens
            total_out += s.usage.output_tokens
            total_cost += s.usage.cost_usd
            shown = (f"sent to {result['to']}, {result['tasks_done']} task(s)"
                     if isinstance(result, dict) and result.get("sent")
                     else f"not sent, escalated to {result['escalated_to']}"
                     if isinstance(result, dict) else str(result))
            print(f"{t['ticket']:>6}  {run.run_id:<28}  {s.state.get('label', ''):<8}  "
                  f"{shown:<40}  {s.usage.input_tokens:>6}/{s.usage.output_tokens:<6}  "
                  f"{s.usage.cost_usd:>9.6f}")
        print(f"total: {len(runs)} runs, {len(runs) - failed} completed, "
              f"{total_in} input and {total_out} output tokens, ${total_cost:.6f}")
        first = client.status(runs[0])
        limits = {k: v for k, v in first.budget.limits.items() if v is not None}
        print(f"run {first.run_id}: version {first.definition_version}, hash "
              f"{first.definition_hash[:12]}, budget used {dict(first.budget.usage)}, "
              f"limits {limits}")
        spans = client.export(runs[0])["spans"]
        print(f"its spans: {', '.join(sorted({s['name'] for s in spans}))} ({len(spans)} in all)")
        return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
