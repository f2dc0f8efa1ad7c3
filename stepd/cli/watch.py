"""``stepd run watch RUN`` (and ``run start --watch``): a run's journal, live, with a progress line.

The journal is polled (``GET .../journal?after_seq=N`` and the run's status,
every ``--interval``), not pushed: the daemon has no per-run journal stream,
and one adding a notification to every committed transition would cost the
hot path for a command a person runs now and then. A quarter second is quick
enough to read.

Two renderings of the same events (`stepd.cli.render.journal_line`):

* a terminal gets rich's live display: events scroll above a progress line
  redrawn in place (status, steps done of known, the current for_each's items,
  budgets used of their limits, tokens and cost);
* a pipe or a file gets plain lines, flushed as they come, and a
  ``progress: ...`` line each time the progress changes, so a log or a
  ``grep`` sees the same facts without escape sequences.

``--json`` prints each event as a JSON line, then the outcome.
"""

from __future__ import annotations

import abc
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Self

from stepd.cli.common import EXIT_RUN_FAILED, CliError, json_text, printable

__all__ = ["DEFAULT_INTERVAL_S", "Progress", "watch_run"]

#: How often the journal and the status are read.
DEFAULT_INTERVAL_S: Final = 0.25

_TERMINAL: Final = frozenset({"completed", "failed", "cancelled", "timed_out"})

# Budget limit -> the usage counter it bounds (as `render.budget_table`); for_each
# items are bounded per for_each, before it expands: shown with the items.
_COUNTERS: Final = (
    ("max_transitions", "transitions", "transitions"),
    ("max_cost_units", "cost_units", "cost"),
    ("max_state_bytes", "state_bytes", "state bytes"),
    ("max_started_workflows", "started_workflows", "children"),
)


@dataclass
class Progress:
    """What the progress line says, folded from the events seen and the last status.

    Attributes:
        known: the steps of the run's definition.
        done: the ids of the steps that completed at least once.
        current: the step the run is in (None between steps, or once over).
        items: completed items of the current for_each (None: not a for_each).
    """

    known: int
    done: set[str] = field(default_factory=set)
    current: str | None = None
    current_kind: str | None = None
    items: int | None = None
    status: Mapping[str, Any] = field(default_factory=dict)

    def see(self, e: Mapping[str, Any]) -> None:
        kind = e.get("type")
        if kind == "step_scheduled":
            self.current, self.current_kind = str(e.get("step_id")), str(e.get("kind"))
            self.items = 0 if self.current_kind == "for_each" else None
        elif kind == "step_completed":
            if e.get("item_index") is not None:
                if self.items is not None and e.get("step_id") == self.current:
                    self.items += 1
            else:
                self.done.add(str(e.get("step_id")))
                if e.get("step_id") == self.current:
                    self.current = self.current_kind = None
                    self.items = None

    def line(self) -> str:
        s = self.status
        state = str(s.get("status", "?"))
        parts = [state, f"{len(self.done)}/{self.known} steps done"]
        if self.current is not None and state not in _TERMINAL:
            here = f"at {self.current}"
            if self.items is not None:
                here += f" ({self.items} item{'s' if self.items != 1 else ''} done)"
            parts.append(here)
        budget = _mapping(s.get("budget"))
        limits = _mapping(budget.get("limits"))
        usage = _mapping(budget.get("usage"))
        for limit_name, counter, label in _COUNTERS:
            limit = limits.get(limit_name)
            if limit is not None:
                parts.append(f"{label} {usage.get(counter, 0)}/{limit}")
        spent = _mapping(s.get("usage"))
        tokens = int(spent.get("input_tokens") or 0) + int(spent.get("output_tokens") or 0)
        if tokens:
            parts.append(f"{tokens:,} tokens ${float(spent.get('cost_usd') or 0):.6f}")
        return printable(" · ".join(parts))


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _known_steps(definition: Any) -> int:
    steps = definition.get("steps") if isinstance(definition, Mapping) else None
    return len(steps) if isinstance(steps, list) else 0


def watch_run(client: Any, run_id: str, *, as_json: bool = False,
              interval: float = DEFAULT_INTERVAL_S, tty: bool | None = None,
              sleep: Callable[[float], None] = time.sleep) -> dict[str, Any]:
    """Show `run_id`'s journal until the run is over; return its last status.

    Args:
        client: a `stepd.Client`.
        as_json: JSON lines instead of text.
        interval: seconds between two reads.
        tty: force the terminal (True) or the plain (False) rendering; None:
            whether stdout is a terminal.
        sleep: waits between reads (a test passes its own).

    Raises:
        CliError: the run did not complete (exit 7, its error in the message).
        StepdError: from the client (the caller's `sdk_errors` maps them).
    """
    export = client.export(run_id)
    progress = Progress(known=_known_steps(export.get("definition")), status=export["status"])
    events: list[dict[str, Any]] = list(export.get("journal") or [])
    view: Mapping[str, Any] = export["status"]
    out: _Output
    if as_json:
        out = _JsonOutput()
    elif tty if tty is not None else sys.stdout.isatty():
        out = _LiveOutput()
    else:
        out = _PlainOutput()
    with out:
        seq = 0
        while True:
            for e in events:
                seq = max(seq, int(e.get("seq", 0)))
                progress.see(e)
            progress.status = view
            out.events(events, progress)
            if view.get("status") in _TERMINAL:
                break
            sleep(interval)
            # The status first: a terminal status read before the journal means
            # the journal read after it holds the run's last entries.
            view = client.status(run_id).raw
            events = client.journal(run_id, after_seq=seq)
    out.done(view)
    if view.get("status") != "completed":
        error = _mapping(view.get("error"))
        where = f" at step {error.get('step_id')!r}" if error.get("step_id") else ""
        raise CliError(printable(f"run {run_id} {view.get('status')}: "
                                 f"{error.get('reason') or view.get('status')}{where}: "
                                 f"{error.get('message', '')}"), EXIT_RUN_FAILED)
    return dict(view)


# --------------------------------------------------------------------------- renderings


class _Output(abc.ABC):
    """Where the events go; a context manager around the whole watch."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    @abc.abstractmethod
    def events(self, events: Sequence[Mapping[str, Any]], progress: Progress) -> None:
        """Show `events` and the progress line after them."""

    def done(self, view: Mapping[str, Any]) -> None:
        return None


class _TextOutput(_Output):
    def __init__(self) -> None:
        self.names: dict[str, str] = {}
        self.origin: int | None = None

    def lines(self, events: Sequence[Mapping[str, Any]]) -> list[Any]:
        from stepd.cli.render import journal_line

        out = []
        for e in events:
            if e.get("worker_id") and e.get("worker_name"):
                self.names[str(e["worker_id"])] = str(e["worker_name"])
            if self.origin is None and isinstance(e.get("at"), int):
                self.origin = int(e["at"])
            out.append(journal_line(e, names=self.names, origin_ms=self.origin))
        return out


class _PlainOutput(_TextOutput):
    """Plain lines for a pipe: every event, and the progress line when it changes."""

    def __init__(self) -> None:
        super().__init__()
        self.last = ""

    def events(self, events: Sequence[Mapping[str, Any]], progress: Progress) -> None:
        for line in self.lines(events):
            sys.stdout.write(line.plain.rstrip() + "\n")
        now = progress.line()
        if now != self.last:
            sys.stdout.write(f"progress: {now}\n")
            self.last = now
        sys.stdout.flush()


class _LiveOutput(_TextOutput):
    """rich's live display for a terminal: events above, the progress line redrawn below."""

    def __enter__(self) -> Self:
        from rich.live import Live
        from rich.text import Text

        from stepd.cli.common import console

        self.console = console()
        self.live = Live(Text(""), console=self.console, auto_refresh=False, transient=False)
        self.live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.live.__exit__(None, None, None)

    def events(self, events: Sequence[Mapping[str, Any]], progress: Progress) -> None:
        from rich.text import Text

        from stepd.cli.render import STATUS_STYLE

        for line in self.lines(events):
            line.truncate(self.console.width, overflow="ellipsis")
            self.live.console.print(line)
        status = str(progress.status.get("status", ""))
        self.live.update(Text(progress.line(), style=f"bold {STATUS_STYLE.get(status, '')}"),
                         refresh=True)


class _JsonOutput(_Output):
    def events(self, events: Sequence[Mapping[str, Any]], progress: Progress) -> None:
        for e in events:
            sys.stdout.write(json_text(e, indent=None) + "\n")
        sys.stdout.flush()

    def done(self, view: Mapping[str, Any]) -> None:
        sys.stdout.write(json_text({k: view.get(k) for k in ("run_id", "status", "result",
                                                             "error")}, indent=None) + "\n")
        sys.stdout.flush()
