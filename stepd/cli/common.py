"""What every client command of the ``stepd`` CLI shares: options, exit codes, errors.

Every command that talks to a daemon takes ``--url`` (``STEPD_URL``, default
``http://127.0.0.1:7707``) and ``--key`` (``STEPD_KEY``). A failure is one line
on stderr, ``error: ...``, and one of the exit codes below (docs/cli.md
"Exit codes"); the SDK's typed errors (`stepd._errors`) decide which.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import unicodedata
from collections.abc import Callable, Iterator
from typing import Any, Final, TypeVar

import click

from stepd._errors import (
    BudgetExceeded,
    Conflict,
    Forbidden,
    Invalid,
    NotFound,
    RunFailed,
    RunTerminal,
    ServerError,
    StepdError,
    TooLarge,
    Unauthorized,
    Unavailable,
    Unprocessable,
)

__all__ = [
    "DEFAULT_URL",
    "EXIT_CONFLICT",
    "EXIT_ERROR",
    "EXIT_NOT_FOUND",
    "EXIT_RUN_FAILED",
    "EXIT_UNAUTHORIZED",
    "EXIT_UNREACHABLE",
    "EXIT_USAGE",
    "CliError",
    "client_options",
    "connect",
    "console",
    "json_text",
    "json_value",
    "one_line",
    "printable",
    "sdk_errors",
]

F = TypeVar("F", bound=Callable[..., Any])

DEFAULT_URL: Final = "http://127.0.0.1:7707"

EXIT_ERROR: Final = 1
"""Anything else: the daemon answered 500, ``--wait`` timed out, an internal error."""
EXIT_USAGE: Final = 2
"""Bad flags or arguments, a value that is not JSON, or a request the daemon refused (400)."""
EXIT_NOT_FOUND: Final = 3
"""No such run, workflow (nobody registered it) or actor."""
EXIT_CONFLICT: Final = 4
"""The run is over (signal, cancel), or a signal refused because it would breach a budget."""
EXIT_UNREACHABLE: Final = 5
"""The daemon cannot be reached, or it is shutting down (503)."""
EXIT_UNAUTHORIZED: Final = 6
"""The daemon refused the key (401) or its scope (403)."""
EXIT_RUN_FAILED: Final = 7
"""``run start --wait``: the run ended without a result (failed, cancelled, timed out)."""


class CliError(click.ClickException):
    """One line on stderr (``error: <message>``) and an exit code.

    The message is made `printable`: it often quotes what a daemon, a worker or
    an argument said, and none of that may drive the terminal.
    """

    def __init__(self, message: str, code: int = EXIT_ERROR) -> None:
        super().__init__(printable(one_line(message)))
        self.exit_code = code  # type: ignore[misc]  # click declares it on the class

    def show(self, file: Any = None) -> None:
        click.echo(f"error: {self.format_message()}", err=True)


def one_line(text: str) -> str:
    """Collapse whitespace (newlines included) so a message stays on one line."""
    return re.sub(r"\s+", " ", str(text)).strip()


# --------------------------------------------------------------------------- terminal safety

# What never reaches the terminal as itself: controls (C0, DEL, C1: ESC starts every
# escape sequence, CR rewrites the line, BEL, ...), format characters (the bidi
# overrides and isolates U+202A-U+202E and U+2066-U+2069 reorder what follows; the
# zero-width ones make two different names look the same), lone surrogates (which
# cannot even be encoded) and the line and paragraph separators.
_UNSAFE_CATEGORIES: Final = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})
_NAMED_ESCAPES: Final = {"\t": "\\t", "\n": "\\n", "\r": "\\r"}


def _unsafe(ch: str) -> bool:
    return unicodedata.category(ch) in _UNSAFE_CATEGORIES


def _escape(ch: str) -> str:
    named = _NAMED_ESCAPES.get(ch)
    if named is not None:
        return named
    code = ord(ch)
    if code <= 0xFF:
        return f"\\x{code:02x}"
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def printable(value: object) -> str:
    """``str(value)`` safe to print: every control or format character escaped, visibly.

    ESC becomes ``\\x1b``, CR ``\\r``, a newline ``\\n``, DEL ``\\x7f``, a C1
    control ``\\x9b``, a bidi override ``\\u202e``; everything else (accents,
    CJK, emoji) is left as it is. Every place the CLI prints data that came from
    a worker, a client or the daemon goes through this (the rich renderers in
    `stepd.cli.render` wrap it in `rich.text.Text`, which rich never reads as
    markup), so a worker named ``\\x1b[2J`` cannot clear the screen and one
    named ``[bold]x[/]`` prints as those characters.
    """
    text = value if isinstance(value, str) else str(value)
    if text.isprintable():  # the common case, at C speed
        return text
    return "".join(_escape(ch) if _unsafe(ch) else ch for ch in text)


def _json_escape(ch: str) -> str:
    code = ord(ch)
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    code -= 0x10000  # JSON spells a character beyond the BMP as a UTF-16 surrogate pair
    return f"\\u{0xD800 + (code >> 10):04x}\\u{0xDC00 + (code & 0x3FF):04x}"


def json_text(value: Any, *, indent: int | None = 2) -> str:
    """``value`` as JSON for stdout: readable (non-ASCII as itself) and terminal-safe.

    ``json.dumps`` escapes the C0 controls inside strings but, with
    ``ensure_ascii=False``, lets DEL, the C1 controls, bidi overrides and lone
    surrogates through; those are written as ``\\uXXXX`` escapes here, which
    every JSON parser reads back as the same characters. They can only occur
    inside strings (JSON's own syntax is ASCII), so the escape is always valid.
    """
    text = json.dumps(value, indent=indent, ensure_ascii=False, default=str)
    lines = text.split("\n")  # the only raw newlines are indentation: strings escape theirs
    for i, line in enumerate(lines):
        if not line.isprintable():
            lines[i] = "".join(_json_escape(ch) if _unsafe(ch) else ch for ch in line)
    return "\n".join(lines)


# --------------------------------------------------------------------------- options


def _check_url(ctx: click.Context, param: click.Parameter, value: str) -> str:
    if not value.startswith(("http://", "https://")):
        raise click.BadParameter(f"must be an http:// or https:// URL, got {value!r}")
    return value.rstrip("/")


def client_options(fn: F) -> F:
    """``--url`` and ``--key``, both readable from the environment."""
    fn = click.option("--key", envvar="STEPD_KEY", default=None, metavar="KEY",
                      show_envvar=True,
                      help="the API key (Authorization: Bearer KEY); none without auth")(fn)
    fn = click.option("--url", envvar="STEPD_URL", default=DEFAULT_URL, show_default=True,
                      show_envvar=True, callback=_check_url, metavar="URL",
                      help="the daemon's URL")(fn)
    return fn


def connect(url: str, key: str | None) -> Any:
    """A `stepd.Client` of the daemon at ``url`` (nothing is sent yet)."""
    from stepd.client import Client

    return Client(url, key=key or None)


def json_value(text: str | None, flag: str) -> Any:
    """Parse the JSON a flag carries: literal JSON, ``@FILE``, or ``-`` for stdin.

    Raises:
        CliError: not JSON (exit 2), or the file cannot be read.
    """
    if text is None:
        return None
    source = text
    if text == "-":
        source = sys.stdin.read()
    elif text.startswith("@"):
        try:
            with open(text[1:], encoding="utf-8") as f:
                source = f.read()
        except OSError as exc:
            raise CliError(f"invalid {flag}: cannot read {text[1:]!r}: {exc.strerror}",
                           EXIT_USAGE) from exc
    try:
        return json.loads(source, parse_constant=_no_constant)
    except ValueError as exc:
        shown = source if len(source) <= 40 else source[:37] + "..."
        raise CliError(f"invalid {flag}: {shown!r} is not JSON ({exc})", EXIT_USAGE) from exc


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def console(*, stderr: bool = False) -> Any:
    """A rich console; 120 columns when the output is not a terminal (pipes, CI logs)."""
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    width = None
    if not stream.isatty() and "COLUMNS" not in os.environ:
        width = 120
    return Console(file=stream, width=width, highlight=False, soft_wrap=False)


# --------------------------------------------------------------------------- errors


def _reach_reason(exc: BaseException) -> str:
    cause = exc.__cause__
    if cause is None:
        return ""
    text = one_line(str(cause)) or type(cause).__name__
    return re.sub(r"^\[Errno -?\d+\]\s*", "", text)


@contextlib.contextmanager
def sdk_errors(url: str, *, run_id: str | None = None, signal: str | None = None) -> Iterator[None]:
    """Turn the SDK's errors into `CliError` (one line, an exit code).

    Args:
        url: the daemon's URL (named when it cannot be reached).
        run_id: the run the command is about (names it in not found / conflicts).
        signal: the signal being sent (names it when refused).
    """
    try:
        yield
    except CliError:
        raise
    except BudgetExceeded as exc:
        raise CliError(
            f"signal {signal!r} refused: the transition it completes would exceed the budget "
            f"{exc.budget}; nothing was recorded and run {run_id} keeps waiting",
            EXIT_CONFLICT) from exc
    except RunTerminal as exc:
        what = f"run {run_id} is already over" if run_id else "the run is already over"
        found = re.search(r"\bis (\w+)\W*$", exc.message or "")
        raise CliError(f"{what} ({found.group(1) if found else exc.message or 'run_terminal'})",
                       EXIT_CONFLICT) from exc
    except Conflict as exc:
        raise CliError(f"conflict: {exc.message or exc.reason}", EXIT_CONFLICT) from exc
    except NotFound as exc:
        message = f"run {run_id} not found" if run_id else str(exc)
        raise CliError(message, EXIT_NOT_FOUND) from exc
    except Unprocessable as exc:
        raise CliError(f"{exc} (no worker has registered it with this daemon)",
                       EXIT_NOT_FOUND) from exc
    except Invalid as exc:
        where = f"field {exc.field!r}: " if exc.field else ""
        raise CliError(f"invalid input: {where}{exc.message}", EXIT_USAGE) from exc
    except TooLarge as exc:
        raise CliError(f"invalid input: too large ({exc})", EXIT_USAGE) from exc
    except Unauthorized as exc:
        raise CliError(f"the daemon at {url} refused the key: {exc.message} "
                       "(pass --key or set STEPD_KEY)", EXIT_UNAUTHORIZED) from exc
    except Forbidden as exc:
        raise CliError(f"the key lacks the scope this command needs: {exc.message}",
                       EXIT_UNAUTHORIZED) from exc
    except Unavailable as exc:
        reason = _reach_reason(exc)
        if reason:
            raise CliError(f"cannot reach the daemon at {url} ({reason}); is 'stepd serve' "
                           "running? (--url or STEPD_URL)", EXIT_UNREACHABLE) from exc
        raise CliError(f"the daemon at {url} is unavailable: {exc}", EXIT_UNREACHABLE) from exc
    except ServerError as exc:
        raise CliError(f"the daemon answered {exc.status}: {exc.message}", EXIT_ERROR) from exc
    except RunFailed as exc:
        where = f" at step {exc.step_id!r}" if exc.step_id else ""
        raise CliError(f"run {exc.run_id} {exc.status}: {exc.reason or exc.status}{where}: "
                       f"{exc.message}", EXIT_RUN_FAILED) from exc
    except StepdError as exc:
        raise CliError(f"{type(exc).__name__}: {exc}", EXIT_ERROR) from exc
