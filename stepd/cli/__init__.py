"""The ``stepd`` command line: a click group, ``main`` (docs/cli.md).

Commands: ``serve`` (the daemon; docs/serve.md), ``run start|status|list|
journal|export|signal|cancel|prune`` (also as ``runs``), ``schedule
create|list|show|pause|resume|delete``, ``workers``, ``actors [kill PATH]``
(the client commands, in ``stepd.cli.runs``, ``stepd.cli.schedules`` and
``stepd.cli.ops``) and ``demo`` (``stepd.cli.demo``).

Every ``serve`` flag can also be set from the environment as
``STEPD_<FLAG>`` (``--lease-ttl-ms`` is ``STEPD_LEASE_TTL_MS``); a repeatable
key flag takes a comma-separated list there (``STEPD_WORKER_KEY=key1,key2``).
A flag given on the command line wins over the environment. The client
commands take ``--url`` (``STEPD_URL``) and ``--key`` (``STEPD_KEY``).

Errors are one line on stderr, ``error: ...``, with the exit codes of
``stepd.cli.common`` (1 error, 2 usage, 3 not found, 4 conflict, 5 daemon
unreachable, 6 key refused, 7 run failed under ``--wait``).
"""

from __future__ import annotations

import errno
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import click

__all__ = ["main"]

F = TypeVar("F", bound=Callable[..., Any])


class _Key(click.ParamType):  # type: ignore[type-arg]
    """An API key: one per flag, comma-separated in the environment."""

    name = "KEY"
    envvar_list_splitter = ","

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        return value.strip() if isinstance(value, str) else value


KEY = _Key()


def _env(flag: str) -> str:
    return "STEPD_" + flag.upper().replace("-", "_")


def _option(flag: str, *names: str, **kwargs: Any) -> Callable[[F], F]:
    return click.option(f"--{flag}", *names, envvar=_env(flag), show_envvar=True, **kwargs)


def _key_option(scope: str) -> Callable[[F], F]:
    return _option(f"{scope}-key", f"{scope}_keys", type=KEY, multiple=True, metavar="KEY",
                   help=f"an API key of scope '{scope}' (repeatable)")


class _Main(click.Group):
    """The top-level group: every failure is one line on stderr and a documented exit code.

    click's own usage errors (a missing argument, a bad flag) print as one line
    too, ``error: <what> (see 'stepd run start --help')``, with exit status 2.
    """

    def main(self, args: Sequence[str] | None = None, prog_name: str | None = None,
             complete_var: str | None = None, standalone_mode: bool = True,
             **extra: Any) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.UsageError as exc:
            hint = f" (see '{exc.ctx.command_path} --help')" if exc.ctx is not None else ""
            click.echo(f"error: {_printable(_one_line(exc.format_message()))}{hint}", err=True)
            sys.exit(exc.exit_code)
        except click.ClickException as exc:
            exc.show()
            sys.exit(exc.exit_code)
        except click.Abort:
            click.echo("error: interrupted", err=True)
            sys.exit(130)
        except OSError as exc:
            if exc.errno != errno.EPIPE:  # `stepd run export R | head`: not an error
                raise
            sys.exit(0)
        except Exception as exc:  # a bug: one line, the traceback on request
            if os.environ.get("STEPD_DEBUG"):
                raise
            leaf = _leaf(exc)
            click.echo(f"error: {type(leaf).__name__}: {_printable(_one_line(str(leaf)))} "
                       "(unexpected; set STEPD_DEBUG=1 for the traceback)", err=True)
            sys.exit(1)
        sys.exit(rv if isinstance(rv, int) else 0)


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _printable(text: str) -> str:
    """`stepd.cli.common.printable`: an argument or an error echoed must not drive the terminal."""
    from stepd.cli.common import printable

    return printable(text)


def _leaf(exc: BaseException) -> BaseException:
    """The one exception inside nested single-member exception groups (or ``exc`` itself)."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


@click.group(cls=_Main)
def main() -> None:
    """stepd: a durable step orchestrator.

    Start with 'stepd demo'. The client commands reach the daemon at --url
    (STEPD_URL, default http://127.0.0.1:7707) with --key (STEPD_KEY).
    """


@main.command()
@_option("data", type=click.Path(file_okay=False), required=True, metavar="DIR",
         help="the data directory (created if missing)")
@_option("host", default="127.0.0.1", show_default=True,
         help="the address to listen on; without keys, only a loopback address is allowed")
@_option("port", type=click.IntRange(0, 65535), default=7707, show_default=True,
         help="the port (0: any free port; the listening line says which)")
@_key_option("admin")
@_key_option("write")
@_key_option("worker")
@_key_option("execute")
@_key_option("read")
@_option("lease-ttl-ms", type=click.IntRange(min=1), default=30_000, show_default=True,
         help="a lease expires this long after its last heartbeat")
@_option("heartbeat-ms", type=click.IntRange(min=1), default=10_000, show_default=True,
         help="how often workers heartbeat (told to them at register)")
@_option("recovery-window-ms", type=click.IntRange(min=0), default=5_000, show_default=True,
         help="after expiry, how long a late heartbeat or complete still revives a lease")
@_option("max-request-ms", type=click.IntRange(min=1), default=30_000, show_default=True,
         help="the longest any HTTP request is held (claims hold 4/5 of it)")
@_option("max-body-bytes", type=click.IntRange(min=1), default=8 << 20, show_default=True,
         help="the largest request body and WebSocket message")
@_option("prices", type=click.Path(exists=True, dir_okay=False), metavar="FILE", default=None,
         help="a TOML price book (model -> price per million input/output tokens)")
@_option("shutdown-grace-ms", type=click.IntRange(min=0), default=10_000, show_default=True,
         help="on SIGTERM, how long to wait for calls in flight")
@_option("ws-ping-interval-ms", type=click.IntRange(min=1), default=20_000, show_default=True,
         help="WebSocket keepalive ping interval")
@_option("ws-ping-timeout-ms", type=click.IntRange(min=1), default=20_000, show_default=True,
         help="close a WebSocket whose peer does not answer a ping within this")
@_option("ws-max-queue-bytes", type=click.IntRange(min=1), default=16 << 20, show_default=True,
         help="bytes of frames waiting to be sent on one WebSocket before it is closed (1013)")
@_option("log-level", type=click.Choice(["debug", "info", "warning", "error"]),
         default="warning", show_default=True, help="log level (stderr)")
@_option("gc", type=click.Choice(["tuned", "default"]), default="tuned", show_default=True,
         help="the garbage collector: tuned for a daemon (docs/serve.md), or CPython's defaults")
@_option("max-child-depth", type=click.IntRange(0, 64), default=10, show_default=True,
         help="how deep child runs may nest (start_workflows); deeper fails the run "
              "(budget_exceeded, max_child_depth)")
@_option("worker-expiry-ms", type=click.IntRange(min=0), default=600_000, show_default=True,
         help="forget a worker with no connection, claim or live lease for this long (0: never)")
@_option("otlp-endpoint", metavar="URL", default=None,
         help="export runs, step attempts and body spans over OTLP/HTTP to this collector "
              "(http://host:4318; OTEL_EXPORTER_OTLP_* variables apply; needs "
              "pip install 'stepd[otel]')")
@_option("retention", default=None, metavar="DURATION",
         help="delete finished runs this long after they ended (e.g. 30d; default: keep them)")
@_option("idempotency-retention", default=None, metavar="DURATION",
         help="keep a deleted run's idempotency key this long after it was taken "
              "(default: as --retention)")
@_option("commit-on-loop", type=click.Choice(["auto", "never"]), default="auto",
         show_default=True,
         help="auto: a storage batch runs on the event loop while the writer thread is idle "
              "and commits are quick (lower latency at light load); never: always on the "
              "writer thread (docs/storage.md)")
@_option("sync-mode", type=click.Choice(["log", "lmdb"]), default="log", show_default=True,
         help="log: a commit is durable after one synced append to the storage's write-ahead "
              "log (one device flush); lmdb: LMDB syncs each commit itself (two flushes; "
              "docs/storage.md)")
@_option("unsafe-no-sync", is_flag=True, default=False, hidden=True,
         help="commit without fsync: loses acknowledged work on power loss (tests only)")
def serve(**options: Any) -> None:
    """Run the daemon: the engine, the HTTP API and the worker WebSocket on one port.

    SIGTERM shuts down in stages (503, no new leases, WebSockets closed with
    1001, calls in flight finished, storage closed); a second SIGTERM cuts the
    grace period short.
    """
    from stepd.daemon import ServeConfig, StartupError, run
    from stepd.sansio.errors import Invalid

    for scope in ("admin", "write", "worker", "execute", "read"):
        options[f"{scope}_keys"] = tuple(k for k in options[f"{scope}_keys"] if k)
    config = ServeConfig(**options)
    try:
        try:
            code = run(config)
        except BaseExceptionGroup as group:
            # The daemon raises from inside its task group: report the one error it holds.
            leaf = _leaf(group)
            if not isinstance(leaf, (Invalid, StartupError)):
                raise
            raise leaf from leaf.__cause__
    except Invalid as exc:
        click.echo(f"stepd serve: {exc}", err=True)
        sys.exit(2)
    except StartupError as exc:
        cause = f": {exc.__cause__}" if exc.__cause__ and str(exc.__cause__) else ""
        click.echo(f"stepd serve: {exc}{cause}", err=True)
        sys.exit(1)
    sys.exit(code)


def _add_commands() -> None:
    from stepd.cli.demo import demo
    from stepd.cli.ops import actors, workers
    from stepd.cli.runs import run as run_group
    from stepd.cli.schedules import prune, schedule

    run_group.add_command(prune)
    for command in (run_group, workers, actors, demo, schedule):
        main.add_command(command)
    main.add_command(run_group, name="runs")  # `stepd runs prune` reads as the issue wrote it


_add_commands()
