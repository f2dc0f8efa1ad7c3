"""``stepd run ...``: start, read, signal and cancel runs (docs/cli.md)."""

from __future__ import annotations

import json
from typing import Any

import click

from stepd._cli_common import (
    EXIT_ERROR,
    CliError,
    client_options,
    connect,
    console,
    json_value,
    sdk_errors,
)

__all__ = ["run"]

_STATUSES = ("running", "waiting", "sleeping", "completed", "failed", "cancelled", "timed_out")


def _dump(value: Any) -> None:
    click.echo(json.dumps(value, indent=2, ensure_ascii=False, default=str))


@click.group()
def run() -> None:
    """Start runs, read them, signal and cancel them."""


@run.command("start")
@click.argument("workflow")
@click.option("--input", "input_", default="null", show_default=True, metavar="JSON",
              help="the run's input: JSON, @FILE, or - for stdin")
@click.option("--idempotency-key", default=None, metavar="K",
              help="a key used before returns the original run instead of starting another")
@click.option("--version", default=None, metavar="V",
              help="the workflow version to start (default: the most recently registered)")
@click.option("--correlation", default=None, metavar="JSON",
              help="any JSON value kept with the run")
@click.option("--wait", is_flag=True, help="wait for the run to end and print its result")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=None,
              metavar="SECONDS", help="with --wait: give up waiting after this long (exit 1)")
@click.option("--json", "as_json", is_flag=True,
              help='print {"run_id", "created"[, "status", "result"]} as JSON')
@client_options
def start(workflow: str, input_: str, idempotency_key: str | None, version: str | None,
          correlation: str | None, wait: bool, timeout: float | None, as_json: bool,
          url: str, key: str | None) -> None:
    """Start a run of WORKFLOW; print its run id (and with --wait, its result).

    With an idempotency key used before, the original run's id is printed
    (and a note on stderr). With --wait, a run that fails, is cancelled or
    times out exits 7 with its error.
    """
    value = json_value(input_, "--input")
    corr = json_value(correlation, "--correlation")
    if timeout is not None and not wait:
        raise click.UsageError("--timeout needs --wait")
    with connect(url, key) as client, sdk_errors(url):
        handle = client.start(workflow, value, idempotency_key=idempotency_key,
                              version=version, correlation=corr)
        if not handle.created:
            click.echo(f"note: idempotency key {idempotency_key!r} was used before: "
                       f"{handle.run_id} is the original run", err=True)
        if not wait:
            if as_json:
                _dump({"run_id": handle.run_id, "created": handle.created})
            else:
                click.echo(handle.run_id)
            return
        if not as_json:
            click.echo(handle.run_id)
        with sdk_errors(url, run_id=handle.run_id):
            try:
                result = handle.result(timeout=timeout)
            except TimeoutError as exc:
                raise CliError(f"run {handle.run_id} is still running after {timeout:g} s "
                               "(it goes on; see 'stepd run status')", EXIT_ERROR) from exc
        if as_json:
            _dump({"run_id": handle.run_id, "created": handle.created, "status": "completed",
                   "result": result})
        else:
            _dump(result)


@run.command("status")
@click.argument("run_id", metavar="RUN")
@click.option("--json", "as_json", is_flag=True, help="print the status as JSON, as the API answers")
@client_options
def status(run_id: str, as_json: bool, url: str, key: str | None) -> None:
    """Show a run: status, version and hash, idempotency key, budgets, tokens and cost."""
    from stepd._cli_render import status_view

    with connect(url, key) as client, sdk_errors(url, run_id=run_id):
        view = client.status(run_id)
    if as_json:
        _dump(dict(view.raw))
        return
    console().print(status_view(view))


@run.command("list")
@click.option("--workflow", default=None, metavar="W", help="only runs of this workflow")
@click.option("--status", default=None, type=click.Choice(_STATUSES), help="only runs in this status")
@click.option("--limit", type=click.IntRange(min=1), default=100, show_default=True, metavar="N",
              help="show at most N runs")
@click.option("--json", "as_json", is_flag=True, help="print the run summaries as JSON")
@client_options
def list_(workflow: str | None, status: str | None, limit: int, as_json: bool, url: str,
          key: str | None) -> None:
    """List runs, oldest first (the API's order), up to --limit."""
    from stepd._cli_render import run_list_table

    with connect(url, key) as client, sdk_errors(url):
        runs = list(client.list_runs(workflow=workflow, status=status, limit=limit))
    if as_json:
        _dump([dict(r.raw) for r in runs])
        return
    out = console()
    if not runs:
        out.print("no runs" + (" match" if workflow or status else ""))
        return
    out.print(run_list_table(runs))
    more = " (--limit shows more)" if len(runs) == limit else ""
    out.print(f"{len(runs)} run{'s' if len(runs) != 1 else ''}, oldest first{more}", style="dim")


@run.command("journal")
@click.argument("run_id", metavar="RUN")
@click.option("--json", "as_json", is_flag=True, help="print the events as JSON")
@client_options
def journal(run_id: str, as_json: bool, url: str, key: str | None) -> None:
    """Show a run's journal as a timeline: which worker ran which attempt, errors, timings."""
    from stepd._cli_render import journal_table

    with connect(url, key) as client, sdk_errors(url, run_id=run_id):
        events = client.journal(run_id)
    if as_json:
        _dump(events)
        return
    console().print(journal_table(events, title=f"journal of {run_id} ({len(events)} events; "
                                                "+ms since the run started)"))


@run.command("export")
@click.argument("run_id", metavar="RUN")
@client_options
def export(run_id: str, url: str, key: str | None) -> None:
    """Print a run's export as JSON: definition, version, hash, budget, state, journal, spans."""
    with connect(url, key) as client, sdk_errors(url, run_id=run_id):
        data = client.export(run_id)
    _dump(data)


@run.command("signal")
@click.argument("run_id", metavar="RUN")
@click.argument("name")
@click.option("--payload", default=None, metavar="JSON",
              help="the signal's payload: JSON, @FILE, or - for stdin")
@client_options
def signal(run_id: str, name: str, payload: str | None, url: str, key: str | None) -> None:
    """Send the signal NAME to a run (a wait step consumes it).

    Refused over budget (exit 4): nothing is recorded and the run keeps waiting.
    """
    value = json_value(payload, "--payload")
    with connect(url, key) as client, sdk_errors(url, run_id=run_id, signal=name):
        client.signal(run_id, name, value)
    click.echo(f"signal {name!r} sent to {run_id}")


@run.command("cancel")
@click.argument("run_id", metavar="RUN")
@client_options
def cancel(run_id: str, url: str, key: str | None) -> None:
    """Cancel a run: its running steps' leases end with run_terminal."""
    with connect(url, key) as client, sdk_errors(url, run_id=run_id):
        client.cancel(run_id)
    click.echo(f"run {run_id} cancelled")
