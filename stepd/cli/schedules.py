"""``stepd schedule create|list|show|pause|resume|delete`` and ``stepd run prune``
(docs/cli.md, docs/schedules.md, docs/storage.md "Retention")."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import click

from stepd.cli.common import (
    client_options,
    connect,
    console,
    json_text,
    json_value,
    printable,
    sdk_errors,
)

__all__ = ["prune", "schedule"]

_OVERLAPS = ("skip", "buffer_one", "allow")


def _table(schedules: Sequence[Mapping[str, Any]]) -> Any:
    from rich.table import Table

    from stepd.cli.render import safe

    table = Table(show_edge=False, pad_edge=False)
    for name in ("schedule", "workflow", "cron", "zone", "overlap", "next fire (UTC)",
                 "last run", "started", "skipped"):
        table.add_column(name, no_wrap=name not in ("workflow", "cron"))
    for s in schedules:
        fires = s.get("fires") or {}
        nxt = "paused" if s.get("paused") else str(s.get("next_fire_at") or "—")[:19]
        table.add_row(*(safe(cell) for cell in (
            s["schedule_id"], s["workflow"], s["cron"], s["timezone"], s["overlap"], nxt,
            s.get("last_run_id") or "—", fires.get("started", 0), fires.get("skipped", 0))))
    return table


def _show(s: Mapping[str, Any], as_json: bool, verb: str) -> None:
    if as_json:
        click.echo(json_text(s))
        return
    when = "paused" if s.get("paused") else f"next fire {s.get('next_fire_at')}"
    click.echo(printable(f"{verb} {s['schedule_id']} ({s['workflow']}, {s['cron']!r} "
                         f"{s['timezone']}): {when}"))


@click.group()
def schedule() -> None:
    """Cron schedules: each fire starts a run of a workflow (docs/schedules.md)."""


@schedule.command("create")
@click.argument("workflow")
@click.option("--cron", required=True, metavar="EXPR",
              help="5 fields (minute hour day month weekday), or 6 with seconds first")
@click.option("--tz", "timezone", default="UTC", show_default=True, metavar="ZONE",
              help="the IANA time zone the expression is read in")
@click.option("--input", "input_", default="null", show_default=True, metavar="JSON",
              help="every run's input: JSON, @FILE, or - for stdin")
@click.option("--overlap", type=click.Choice(_OVERLAPS), default="skip", show_default=True,
              help="while the previous fire's run still runs: skip, hold one, or start anyway")
@click.option("--catchup", default="0", show_default=True, metavar="DURATION",
              help="after downtime, start the fires missed within this (e.g. 1h; at most 7d)")
@click.option("--version", default=None, metavar="V", help="the workflow version (default: latest)")
@click.option("--json", "as_json", is_flag=True, help="print the schedule as JSON")
@client_options
def create(workflow: str, cron: str, timezone: str, input_: str, overlap: str, catchup: str,
           version: str | None, as_json: bool, url: str, key: str | None) -> None:
    """Create a schedule starting WORKFLOW at each time --cron names."""
    value = json_value(input_, "--input")
    window: int | str = int(catchup) if catchup.isdigit() else catchup
    with connect(url, key) as client, sdk_errors(url):
        created = client.create_schedule(workflow, cron, input=value, timezone=timezone,
                                         overlap=overlap, catchup_window=window, version=version)
    _show(created, as_json, "created")


@schedule.command("list")
@click.option("--json", "as_json", is_flag=True, help="print the schedules as JSON")
@client_options
def list_(as_json: bool, url: str, key: str | None) -> None:
    """List the schedules, oldest first."""
    with connect(url, key) as client, sdk_errors(url):
        found = client.schedules()
    if as_json:
        click.echo(json_text(found))
        return
    out = console()
    if not found:
        out.print("no schedules")
        return
    out.print(_table(found))
    out.print(f"{len(found)} schedule{'s' if len(found) != 1 else ''}", style="dim")


@schedule.command("show")
@click.argument("schedule_id", metavar="SCHEDULE")
@client_options
def show(schedule_id: str, url: str, key: str | None) -> None:
    """Print one schedule as JSON."""
    with connect(url, key) as client, sdk_errors(url):
        click.echo(json_text(client.schedule(schedule_id)))


def _action(name: str, doc: str) -> None:
    @schedule.command(name, help=doc)
    @click.argument("schedule_id", metavar="SCHEDULE")
    @click.option("--json", "as_json", is_flag=True, help="print the schedule as JSON")
    @client_options
    def command(schedule_id: str, as_json: bool, url: str, key: str | None) -> None:
        with connect(url, key) as client, sdk_errors(url):
            answer = getattr(client, f"{name}_schedule")(schedule_id)
        _show(answer, as_json, {"pause": "paused", "resume": "resumed"}[name])


_action("pause", "Stop SCHEDULE firing until it is resumed.")
_action("resume", "Fire SCHEDULE again, from its next fire after now (no catch-up).")


@schedule.command("delete")
@click.argument("schedule_id", metavar="SCHEDULE")
@client_options
def delete(schedule_id: str, url: str, key: str | None) -> None:
    """Delete SCHEDULE (the runs it started stay)."""
    with connect(url, key) as client, sdk_errors(url):
        client.delete_schedule(schedule_id)
    click.echo(printable(f"deleted {schedule_id}"))


@click.command("prune")
@click.option("--before", required=True, metavar="WHEN",
              help="delete finished runs that ended before this: epoch ms, an ISO-8601 time, "
                   "or a duration ago (30d)")
@click.option("--keys-before", default=None, metavar="WHEN",
              help="drop their idempotency keys only if taken before this (default: --before)")
@client_options
def prune(before: str, keys_before: str | None, url: str, key: str | None) -> None:
    """Delete finished runs (journal, leases, indexes) now; needs an admin key.

    Goes on, a call at a time, until nothing that old is left; prints how many.
    """
    from stepd.cli.runs import when_ms

    before_ms = when_ms(before, "--before")
    keys_ms = when_ms(keys_before, "--keys-before")
    assert before_ms is not None
    total = 0
    with connect(url, key) as client, sdk_errors(url):
        while True:
            answer = client.prune_runs(before_ms, idempotency_keys_before=keys_ms)
            total += int(answer["deleted"])
            if not answer["more"]:
                break
    click.echo(f"pruned {total} run{'s' if total != 1 else ''}")
