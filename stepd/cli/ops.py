"""``stepd workers`` and ``stepd actors [kill PATH]``: what the daemon is running (docs/cli.md)."""

from __future__ import annotations

from typing import Any

import click

from stepd.cli.common import client_options, connect, console, json_text, sdk_errors

__all__ = ["actors", "workers"]


def _kill(client: Any, path: str) -> dict[str, Any]:
    """The kill answer: ``{"path", "restarted"}`` (`stepd.Client.kill_actor`)."""
    return {"path": path, "restarted": client.kill_actor(path)}


@click.command()
@click.option("--json", "as_json", is_flag=True, help="print the workers as JSON")
@client_options
def workers(as_json: bool, url: str, key: str | None) -> None:
    """List the workers the daemon knows: connected or not, their leases, last heartbeat."""
    from stepd.cli.render import workers_table

    with connect(url, key) as client, sdk_errors(url):
        found = client.workers()
    if as_json:
        click.echo(json_text(found))
        return
    out = console()
    if not found:
        out.print("no workers have registered")
        return
    out.print(workers_table(found))
    connected = sum(1 for w in found if w.get("connected"))
    out.print(f"{len(found)} worker{'s' if len(found) != 1 else ''}, {connected} connected",
              style="dim")


@click.group(invoke_without_command=True)
@click.option("--json", "as_json", is_flag=True, help="print the tree as JSON")
@click.option("--all", "show_all", is_flag=True,
              help="show every child (by default a supervisor shows its first 50)")
@client_options
@click.pass_context
def actors(ctx: click.Context, as_json: bool, show_all: bool, url: str, key: str | None) -> None:
    """Show the daemon's supervision tree (needs an admin key).

    Each actor shows its path, kind, state, restarts and mailbox depth.
    """
    ctx.obj = {"url": url, "key": key}
    if ctx.invoked_subcommand is not None:
        return
    from stepd.cli.render import actor_tree, count_actors

    with connect(url, key) as client, sdk_errors(url):
        tree = client.actors()
    if as_json:
        click.echo(json_text(tree))
        return
    out = console()
    out.print(actor_tree(tree, max_children=None if show_all else 50))
    total, restarts = count_actors(tree)
    out.print(f"{total} actors, {restarts} restarts", style="dim")


@actors.command("kill")
@click.argument("path")
@click.option("--url", envvar="STEPD_URL", default=None, metavar="URL",
              help="the daemon's URL (default: as for 'stepd actors')")
@click.option("--key", envvar="STEPD_KEY", default=None, metavar="KEY",
              help="the API key (an admin key)")
@click.pass_obj
def kill(obj: dict[str, Any], path: str, url: str | None, key: str | None) -> None:
    """Kill the actor at PATH (fault injection, needs an admin key).

    Its supervisor restarts it from storage, as after a crash, with the
    siblings its strategy restarts along with it (rest_for_one: the ones
    started after it); the output names them. E.g. ``stepd actors kill
    /runs/r_01J...``. A run that is not loaded (passivated) has no actor:
    the daemon's 404 message says so.
    """
    url = (url or obj["url"]).rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise click.BadParameter(f"must be an http:// or https:// URL, got {url!r}",
                                 param_hint="'--url'")
    key = key or obj["key"]
    from stepd.cli.render import kill_message

    with connect(url, key) as client, sdk_errors(url):
        answer = _kill(client, path)
    click.echo(kill_message(path, answer))
