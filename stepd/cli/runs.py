"""``stepd run ...``: start, read, watch, signal, cancel, retry and fork runs (docs/cli.md)."""

from __future__ import annotations

import datetime
import json
import re
from typing import Any

import click

from stepd.cli.common import (
    EXIT_ERROR,
    EXIT_USAGE,
    CliError,
    client_options,
    connect,
    console,
    json_text,
    json_value,
    printable,
    sdk_errors,
)

__all__ = ["run"]

_STATUSES = ("running", "waiting", "sleeping", "completed", "failed", "cancelled", "timed_out")


def _dump(value: Any) -> None:
    click.echo(json_text(value))


def _json_line(value: Any) -> None:
    """One compact JSON document on one line, flushed at once (JSON Lines)."""
    click.echo(json_text(value, indent=None))


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
@click.option("--watch", is_flag=True,
              help="show the run's journal live until it ends (as 'stepd run watch')")
@click.option("--json", "as_json", is_flag=True,
              help='print {"run_id", "created"} as a JSON line; with --wait, then '
                   '{"run_id", "created", "status", "result"} as a second one; with --watch, '
                   'the events as JSON lines')
@client_options
def start(workflow: str, input_: str, idempotency_key: str | None, version: str | None,
          correlation: str | None, wait: bool, timeout: float | None, watch: bool,
          as_json: bool, url: str, key: str | None) -> None:
    """Start a run of WORKFLOW; print its run id (and with --wait, its result).

    With an idempotency key used before, the original run's id is printed
    (and a note on stderr). The id is printed before --wait waits, so it is
    not lost when waiting fails (e.g. a key that may start runs but not read
    them: exit 6). With --wait, a run that fails, is cancelled or times out
    exits 7 with its error. --watch shows the journal as it grows instead
    (exit 7 likewise).
    """
    value = json_value(input_, "--input")
    corr = json_value(correlation, "--correlation")
    if timeout is not None and not wait:
        raise click.UsageError("--timeout needs --wait")
    if wait and watch:
        raise click.UsageError("--wait and --watch: pick one (--watch waits too)")
    with connect(url, key) as client:
        with sdk_errors(url):
            handle = client.start(workflow, value, idempotency_key=idempotency_key,
                                  version=version, correlation=corr)
        run_id = printable(handle.run_id)
        if not handle.created:
            click.echo(printable(f"note: idempotency key {idempotency_key!r} was used before: "
                                 f"{handle.run_id} is the original run"), err=True)
        # The id first, whatever follows: a script must learn which run it started even
        # when waiting fails (a key without the read scope, the daemon going away).
        if as_json:
            _json_line({"run_id": handle.run_id, "created": handle.created})
        else:
            click.echo(run_id)
        if watch:
            from stepd.cli.watch import watch_run

            with sdk_errors(url, run_id=handle.run_id):
                watch_run(client, handle.run_id, as_json=as_json)
            return
        if not wait:
            return
        try:
            with sdk_errors(url, run_id=handle.run_id):
                try:
                    result = handle.result(timeout=timeout)
                except TimeoutError as exc:
                    raise CliError(f"run {handle.run_id} is still running after {timeout:g} s "
                                   "(it goes on; see 'stepd run status')", EXIT_ERROR) from exc
        except CliError as exc:
            if run_id in exc.message:  # the run's own end (exit 7), a timeout: it names the run
                raise
            # Waiting failed, not the run (exit 6: the key may start runs, not read them):
            # say that the run exists and goes on.
            raise CliError(f"{exc.message} (waiting for run {handle.run_id}, which was started "
                           "and goes on)", exc.exit_code) from exc
    if as_json:
        _json_line({"run_id": handle.run_id, "created": handle.created, "status": "completed",
                    "result": result})
    else:
        _dump(result)


@run.command("status")
@click.argument("run_id", metavar="RUN")
@click.option("--json", "as_json", is_flag=True, help="print the status as JSON, as the API answers")
@client_options
def status(run_id: str, as_json: bool, url: str, key: str | None) -> None:
    """Show a run: status, version and hash, idempotency key, budgets, tokens and cost."""
    from stepd.cli.render import status_view

    with connect(url, key) as client, sdk_errors(url, run_id=run_id):
        view = client.status(run_id)
    if as_json:
        _dump(dict(view.raw))
        return
    console().print(status_view(view))


def when_ms(text: str | None, flag: str) -> int | None:
    """``--since``/``--until``: epoch ms, an ISO-8601 time, or a duration ago (``2h``).

    Sent to the daemon as epoch ms, so what the CLI accepts does not depend on
    the daemon's ISO-8601 parser. A time without an offset is UTC, as the CLI
    shows every time in UTC.

    Raises:
        CliError: none of the three (exit 2).
    """
    if text is None:
        return None
    value = text.strip()
    if value.isdigit():
        return int(value)
    if re.fullmatch(r"(\d+(ms|s|m|h|d))+", value):
        from stepd.sansio.durations import parse_duration
        from stepd.sansio.errors import Invalid

        try:
            ago = parse_duration(value, field=flag, allow_zero=True)
        except Invalid as exc:
            raise CliError(f"invalid {flag}: {text!r}: {exc.message}", EXIT_USAGE) from exc
        now = datetime.datetime.now(datetime.UTC)
        return (now - _EPOCH) // datetime.timedelta(milliseconds=1) - ago
    try:
        when = datetime.datetime.fromisoformat(value)
    except ValueError:
        raise CliError(f"invalid {flag}: {text!r} is not epoch ms, an ISO-8601 time "
                       "(2026-12-01T10:00:00Z) or a duration ago (30m, 2h, 7d)",
                       EXIT_USAGE) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.UTC)
    return (when - _EPOCH) // datetime.timedelta(milliseconds=1)


_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)


def _correlation_filter(text: str | None) -> Any:
    """``--correlation``: a JSON value; a text that is not JSON is that string.

    That is the API's rule for its ``correlation`` parameter, so ``--correlation
    T-42`` matches a run started with ``--correlation '"T-42"'``; ``@FILE`` and
    ``-`` must hold JSON, as for every other JSON flag.
    """
    if text is None or text == "-" or text.startswith("@"):
        return json_value(text, "--correlation")
    try:
        return json.loads(text, parse_constant=_not_json)
    except ValueError:
        return text


def _not_json(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


@run.command("list")
@click.option("--workflow", default=None, metavar="W", help="only runs of this workflow")
@click.option("--status", default=None, type=click.Choice(_STATUSES), help="only runs in this status")
@click.option("--since", default=None, metavar="WHEN",
              help="only runs created after WHEN: epoch ms, an ISO-8601 time "
                   "(2026-12-01T10:00:00Z; UTC without an offset) or a duration ago (2h, 7d)")
@click.option("--until", default=None, metavar="WHEN",
              help="only runs created before WHEN (as --since)")
@click.option("--correlation", default=None, metavar="JSON",
              help="only runs whose correlation is this JSON value (a text that is not JSON "
                   "is a string); @FILE, or - for stdin")
@click.option("--idempotency-key", default=None, metavar="K",
              help="only the run started with this idempotency key")
@click.option("--order", default=None, type=click.Choice(["desc", "asc"]),
              help="desc: newest first (the default); asc: oldest first")
@click.option("--limit", type=click.IntRange(1, 1000), default=100, show_default=True,
              metavar="N", help="show at most N runs (with --all: fetch N per request)")
@click.option("--cursor", default=None, metavar="CURSOR",
              help="continue after the runs a listing showed (it prints its cursor)")
@click.option("--all", "all_", is_flag=True, help="follow the cursors to the last run")
@click.option("--json", "as_json", is_flag=True,
              help='print {"runs": [summaries], "next_cursor"} as JSON')
@client_options
def list_(workflow: str | None, status: str | None, since: str | None, until: str | None,
          correlation: str | None, idempotency_key: str | None, order: str | None, limit: int,
          cursor: str | None, all_: bool, as_json: bool, url: str, key: str | None) -> None:
    """List runs, newest first, up to --limit (--all: every one).

    A listing that stops before the last run prints the cursor to pass as
    --cursor for the next runs.
    """
    from rich.text import Text

    from stepd.cli.render import run_list_table

    filters: dict[str, Any] = {
        "workflow": workflow, "status": status,
        "created_after": when_ms(since, "--since"), "created_before": when_ms(until, "--until"),
        "correlation": _correlation_filter(correlation), "idempotency_key": idempotency_key,
        "order": order, "cursor": cursor,
    }
    with connect(url, key) as client, sdk_errors(url):
        listing = client.list_runs(limit=None if all_ else limit, page_size=limit, **filters)
        runs = list(listing)
    if as_json:
        _dump({"runs": [dict(r.raw) for r in runs], "next_cursor": listing.next_cursor})
        return
    out = console()
    filtered = any(v is not None for k, v in filters.items() if k not in ("order", "cursor"))
    if not runs:
        out.print("no runs" + (" match" if filtered else ""))
        return
    out.print(run_list_table(runs))
    footer = (f"{len(runs)} run{'s' if len(runs) != 1 else ''}, "
              f"{'oldest' if order == 'asc' else 'newest'} first")
    if listing.next_cursor:
        footer += f"; more: --cursor {listing.next_cursor} (or --all)"
    out.print(Text(printable(footer), style="dim"), soft_wrap=True)  # the cursor stays whole


@run.command("journal")
@click.argument("run_id", metavar="RUN")
@click.option("--json", "as_json", is_flag=True, help="print the events as JSON")
@client_options
def journal(run_id: str, as_json: bool, url: str, key: str | None) -> None:
    """Show a run's journal as a timeline: which worker ran which attempt, errors, timings."""
    from stepd.cli.render import journal_table

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
    """Print a run's export as JSON: definition, version, hash, budget, input, state, result
    or error, fork links, journal, spans."""
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
    click.echo(printable(f"signal {name!r} sent to {run_id}"))


@run.command("cancel")
@click.argument("run_id", metavar="RUN")
@click.option("--reason", default=None, metavar="TEXT",
              help="why (journaled, and the run's error message in its status)")
@client_options
def cancel(run_id: str, reason: str | None, url: str, key: str | None) -> None:
    """Cancel a run: its running steps' leases end with run_terminal."""
    with connect(url, key) as client, sdk_errors(url, run_id=run_id):
        client.cancel(run_id, reason)
    click.echo(printable(f"run {run_id} cancelled" + (f": {reason}" if reason else "")))


@run.command("retry")
@click.argument("run_id", metavar="RUN")
@click.option("--watch", is_flag=True, help="then show the journal live until the run ends")
@click.option("--json", "as_json", is_flag=True,
              help='print {"run_id", "status", "step_id"} as JSON')
@client_options
def retry(run_id: str, watch: bool, as_json: bool, url: str, key: str | None) -> None:
    """Resume a failed run at the step it failed on, with a fresh retry budget.

    Refused (exit 4) for a run that is not failed, one that failed on a
    budget (budgets still apply: it would breach it again) and one whose
    deadline has passed.
    """
    with connect(url, key) as client, sdk_errors(url, run_id=run_id):
        answer = client.retry(run_id)
        if as_json:
            _json_line(answer)
        else:
            click.echo(printable(f"run {run_id} resumed at step {answer['step_id']!r}: "
                                 f"{answer['status']}"))
        if watch:
            from stepd.cli.watch import watch_run

            watch_run(client, run_id, as_json=as_json)


@run.command("fork")
@click.argument("run_id", metavar="RUN")
@click.option("--from-step", "from_step", required=True, metavar="S",
              help="a completed step: the fork keeps the history up to its last completion "
                   "and goes on with the step after it")
@click.option("--idempotency-key", default=None, metavar="K",
              help="a key used before returns that fork instead of making another")
@click.option("--watch", is_flag=True, help="then show the fork's journal live until it ends")
@click.option("--json", "as_json", is_flag=True,
              help='print {"run_id", "created", "forked_from"} as JSON')
@client_options
def fork(run_id: str, from_step: str, idempotency_key: str | None, watch: bool, as_json: bool,
         url: str, key: str | None) -> None:
    """Start a new run from a completed step of RUN; print the new run's id.

    The new run has RUN's journal up to that step, its state, step outputs and
    budget usage as they were then; the two are linked (forked_from / forks
    in 'stepd run status' and 'stepd run export').
    """
    with connect(url, key) as client, sdk_errors(url, run_id=run_id):
        handle = client.fork(run_id, from_step, idempotency_key=idempotency_key)
        if as_json:
            _json_line({"run_id": handle.run_id, "created": handle.created,
                        "forked_from": {"run_id": run_id, "step_id": from_step}})
        else:
            if not handle.created:
                click.echo(printable(f"note: idempotency key {idempotency_key!r} was used "
                                     f"before: {handle.run_id} is that fork"), err=True)
            click.echo(printable(handle.run_id))
    if watch:
        from stepd.cli.watch import watch_run

        with connect(url, key) as client, sdk_errors(url, run_id=handle.run_id):
            watch_run(client, handle.run_id, as_json=as_json)


@run.command("watch")
@click.argument("run_id", metavar="RUN")
@click.option("--json", "as_json", is_flag=True, help="print the events as JSON lines")
@click.option("--interval", type=click.FloatRange(min=0.05), default=0.25, show_default=True,
              metavar="SECONDS", help="how often the journal is read")
@client_options
def watch(run_id: str, as_json: bool, interval: float, url: str, key: str | None) -> None:
    """Show a run's journal live, with a progress line, until the run ends.

    A progress line (status, steps done of known, budgets used of their
    limits, tokens) stays at the bottom of a terminal; to a pipe, plain lines
    (and a 'progress:' line when it changes). Exit 0 when the run completes,
    7 when it fails, is cancelled or times out.
    """
    from stepd.cli.watch import watch_run

    with connect(url, key) as client, sdk_errors(url, run_id=run_id):
        watch_run(client, run_id, as_json=as_json, interval=interval)
