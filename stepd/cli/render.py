"""How the ``stepd`` CLI shows runs, journals, workers and actors (rich renderables).

Pure functions from the SDK's values (`RunStatus`, journal events as dicts,
the actor tree as a dict) to rich objects or strings: no I/O, so the demo and
the ``run`` commands share them and tests can call them directly.

Everything shown here came from a worker, a client or the daemon, so none of
it is trusted: every piece of data becomes a `rich.text.Text` through `safe`
(`stepd.cli.common.printable` inside), never a plain ``str``, because rich
reads a ``str`` cell or title as markup (``[bold red]x[/]`` would be styled,
``[/]`` alone would raise) and passes escape sequences to the terminal as they
are. Fixed labels are the only plain strings.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final

from rich.console import Group
from rich.table import Table
from rich.text import Text
from rich.tree import Tree

from stepd._runs import RunStatus, RunSummary
from stepd.cli.common import printable

__all__ = [
    "STATUS_STYLE",
    "actor_tree",
    "budget_table",
    "event_detail",
    "journal_line",
    "journal_table",
    "kill_message",
    "run_list_table",
    "safe",
    "short_json",
    "status_view",
    "workers_table",
]

STATUS_STYLE: Final = {
    "running": "cyan", "waiting": "yellow", "sleeping": "yellow", "completed": "green",
    "failed": "red", "cancelled": "magenta", "timed_out": "red",
}

# Budget limit -> the run-level usage counter it bounds (WORKFLOWS.md "Budgets").
_BUDGET_USAGE: Final = {
    "max_transitions": "transitions",
    "max_for_each_items": None,          # checked per for_each, before it expands
    "max_state_bytes": "state_bytes",
    "max_cost_units": "cost_units",
    "max_started_workflows": "started_workflows",
}

_EVENT_STYLE: Final = {
    "run_started": "bold", "run_completed": "bold green", "run_failed": "bold red",
    "run_retried": "bold cyan", "run_forked": "bold cyan",
    "run_cancelled": "bold magenta", "run_timed_out": "bold red", "step_failed": "red",
    "budget_exceeded": "bold red", "signal_rejected": "red", "step_orphaned": "yellow",
    "step_recovered": "yellow", "step_revived": "yellow", "step_unservable": "yellow",
    "step_completed": "green", "signal_received": "cyan", "timer_fired": "cyan",
}


def safe(value: Any, style: str = "") -> Text:
    """``value`` as terminal-safe text that rich never reads as markup (see the module doc)."""
    if isinstance(value, Text):  # built here, from safe pieces
        return value
    return Text(printable(value), style=style)


def _row(table: Table, *cells: Any, style: str = "") -> None:
    table.add_row(*(safe(cell) for cell in cells), style=style)


def short_json(value: Any, limit: int = 120) -> str:
    """Compact JSON, cut at ``limit`` characters."""
    text = json.dumps(value, separators=(",", ":"), ensure_ascii=False, default=str)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _when(value: datetime.datetime | None, *, short: bool = False) -> str:
    if value is None:
        return "—"
    utc = value.astimezone(datetime.UTC)
    if short:
        return utc.strftime("%Y-%m-%d %H:%M:%S")
    return utc.strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + " UTC"


def _ms(at: int | None) -> str:
    if at is None:
        return "—"
    when = datetime.datetime.fromtimestamp(at / 1000, tz=datetime.UTC)
    return when.strftime("%H:%M:%S.%f")[:-3]


def _status_text(status: str) -> Text:
    return safe(status, style=STATUS_STYLE.get(status, ""))


def _tokens(usage: Mapping[str, Any] | Any) -> str:
    get = usage.get if isinstance(usage, Mapping) else (lambda k, d=None: getattr(usage, k, d))
    tokens_in = int(get("input_tokens", 0) or 0)
    tokens_out = int(get("output_tokens", 0) or 0)
    cost = float(get("cost_usd", 0.0) or 0.0)
    return f"{tokens_in:,} in / {tokens_out:,} out, ${cost:.6f}"


# --------------------------------------------------------------------------- run status


def budget_table(status: RunStatus) -> Table:
    """The five budgets: limit (— for none) and what the run has used."""
    table = Table(title="budget", title_justify="left", show_edge=False, pad_edge=False)
    table.add_column("budget")
    table.add_column("limit", justify="right")
    table.add_column("used", justify="right")
    limits = dict(status.budget.limits)
    usage = dict(status.budget.usage)
    names = list(_BUDGET_USAGE) + [n for n in limits if n not in _BUDGET_USAGE]
    for name in names:
        limit = limits.get(name)
        counter = _BUDGET_USAGE.get(name)
        used = "(per for_each)" if counter is None else str(usage.get(counter, 0))
        style = ""
        if limit is not None and counter is not None and usage.get(counter, 0) > limit:
            style = "red"
        _row(table, name, "—" if limit is None else limit, used, style=style)
    return table


def status_view(status: RunStatus, *, full: bool = True) -> Group:
    """A run's status: identity, pins, timing, error, state and result, budget, tokens."""
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column(overflow="fold")
    _row(grid, "run", status.run_id)
    _row(grid, "workflow", status.workflow)
    _row(grid, "status", _status_text(status.status))
    _row(grid, "version", status.definition_version or "—")
    _row(grid, "hash", status.definition_hash or "—")
    _row(grid, "idempotency key", status.idempotency_key or "—")
    if status.correlation is not None:
        _row(grid, "correlation", short_json(status.correlation))
    if status.parent_run_id:
        _row(grid, "parent run", status.parent_run_id)
    if status.forked_from is not None:
        _row(grid, "forked from", f"{status.forked_from.get('run_id')} after step "
                                  f"{status.forked_from.get('step_id')!r}")
    if status.forks:
        _row(grid, "forks", ", ".join(f"{f.get('run_id')} (after {f.get('step_id')!r})"
                                      for f in status.forks))
    _row(grid, "created", _when(status.created_at))
    _row(grid, "updated", _when(status.updated_at))
    if status.deadline_at is not None:
        _row(grid, "deadline", _when(status.deadline_at))
    if status.current_steps:
        _row(grid, "current steps", ", ".join(str(s) for s in status.current_steps))
    if status.waiting_for:
        _row(grid, "waiting for", safe(f"signal {status.waiting_for!r}", style="yellow"))
    if status.error is not None:
        where = f" at step {status.error.step_id!r}" if status.error.step_id else ""
        _row(grid, "error", safe(f"{status.error.reason}{where}: {status.error.message}",
                                 style="red"))
    limit = 400 if full else 160
    if full:
        _row(grid, "input", short_json(status.input, limit))
        _row(grid, "state", short_json(dict(status.state), limit))
    if status.done or status.result is not None:
        label = "result" if status.status == "completed" else "last output"
        _row(grid, label, short_json(status.result, limit))
    _row(grid, "tokens", _tokens(status.usage))
    return Group(grid, Text(""), budget_table(status))


# --------------------------------------------------------------------------- journal


def _worker_names(events: Iterable[Mapping[str, Any]]) -> dict[str, str]:
    names: dict[str, str] = {}
    for e in events:
        if e.get("worker_id") and e.get("worker_name"):
            names[str(e["worker_id"])] = str(e["worker_name"])
    return names


def _step(e: Mapping[str, Any]) -> str:
    step = e.get("step_id")
    if step is None:
        return ""
    index = e.get("item_index")
    return f"{step}[{index}]" if index is not None else str(step)


_SHOWN: Final = frozenset({"seq", "type", "at", "step_id", "item_index", "attempt", "worker_id",
                           "worker_name", "fence", "lease_id", "visit"})


def event_detail(e: Mapping[str, Any]) -> str:
    """The part of a journal event the fixed columns do not show, readably."""
    kind = e.get("type")
    if kind == "run_started":
        parts = [f"{e.get('workflow')}"]
        if e.get("version"):
            parts.append(f"version {e['version']}")
        parts.append(f"hash {str(e.get('definition_hash', ''))[:12]}")
        if e.get("idempotency_key"):
            parts.append(f"key {e['idempotency_key']!r}")
        return ", ".join(parts)
    if kind == "step_scheduled":
        return f"{e.get('kind')}" + (f" (visit {e['visit']})" if e.get("visit", 1) != 1 else "")
    if kind == "step_offered":
        return f"lease {e.get('lease_id')} fence {e.get('fence')} to worker {e.get('worker_id')}"
    if kind == "step_completed":
        parts = []
        if e.get("usage"):
            parts.append(_tokens(e["usage"]))
        if e.get("spans"):
            n = len(e["spans"])
            parts.append(f"{n} span{'s' if n != 1 else ''}")
        return ", ".join(parts)
    if kind == "step_failed":
        return f"{e.get('error_class')}: {e.get('message', '')}".rstrip(": ")
    if kind == "state_patched":
        return "keys " + ", ".join(str(k) for k in e.get("keys") or [])
    if kind in ("signal_received", "signal_rejected"):
        text = f"signal {e.get('name')!r}"
        if e.get("buffered"):
            text += " (kept until a wait consumes it)"
        elif kind == "signal_received" and e.get("step_id"):
            text += " completes the wait"
        if e.get("budget"):
            text += f" refused: would exceed {e['budget']}"
        return text
    if kind == "run_retried":
        err = e.get("error") or {}
        was = (f" (was {err.get('reason')}: {err.get('message', '')})"
               if isinstance(err, Mapping) and err.get("reason") else "")
        return f"resumed at {e.get('step_id')}{was}"
    if kind == "run_forked":
        return (f"forked from {e.get('from_run_id')} after step {e.get('from_step')!r} "
                f"(seq {e.get('from_seq')})")
    if kind == "budget_exceeded":
        return f"{e.get('budget')}: {e.get('value')} > limit {e.get('limit')}"
    if kind == "timer_fired":
        return str(e.get("timer"))
    if kind == "child_started":
        return f"child {e.get('child_run_id')} ({e.get('workflow')})"
    if kind == "run_completed":
        return "result " + short_json(e.get("result"), 80)
    if kind in ("run_failed", "run_cancelled", "run_timed_out"):
        err = e.get("error") or {}
        if isinstance(err, Mapping):
            where = f" at {err['step_id']}" if err.get("step_id") else ""
            return f"{err.get('reason')}{where}: {err.get('message', '')}".rstrip(": ")
        return short_json(err, 80)
    rest = {k: v for k, v in e.items() if k not in _SHOWN}
    return " ".join(f"{k}={short_json(v, 40)}" for k, v in rest.items())


def _worker(e: Mapping[str, Any], names: Mapping[str, str], *, with_id: bool = True) -> str:
    wid = e.get("worker_id")
    if not wid:
        return ""
    name = e.get("worker_name") or names.get(str(wid))
    if not name:
        return str(wid)
    return f"{name} ({wid})" if with_id else str(name)


def journal_table(events: Sequence[Mapping[str, Any]], *, title: str | None = None) -> Table:
    """The journal as a timeline: time since the run started, event, step, attempt, worker."""
    names = _worker_names(events)
    start = events[0].get("at") if events else None
    table = Table(title=None if title is None else safe(title), title_justify="left",
                  show_edge=False, pad_edge=False)
    table.add_column("seq", justify="right")
    table.add_column("+ms", justify="right")
    table.add_column("event", no_wrap=True)
    table.add_column("step", no_wrap=True)
    table.add_column("try", justify="right")
    table.add_column("worker", no_wrap=True)
    table.add_column("detail", overflow="fold", ratio=1)
    for e in events:
        at = e.get("at")
        since = "" if not isinstance(at, int) or not isinstance(start, int) else f"{at - start}"
        kind = str(e.get("type", ""))
        _row(table, e.get("seq", ""), since, safe(kind, style=_EVENT_STYLE.get(kind, "")),
             _step(e), e.get("attempt", ""), _worker(e, names, with_id=False), event_detail(e))
    return table


def journal_line(e: Mapping[str, Any], *, run: str = "", names: Mapping[str, str] | None = None,
                 origin_ms: int | None = None) -> Text:
    """One journal event as one line (the demo's live view).

    Args:
        e: the event.
        run: a short label of its run, shown after the time.
        names: worker names by worker id (``step_offered`` events carry them).
        origin_ms: show times as seconds since this epoch-ms instant, else as UTC clock time.
    """
    kind = printable(e.get("type", ""))
    at = e.get("at")
    text = Text()
    if origin_ms is not None and isinstance(at, int):
        text.append(f"{(at - origin_ms) / 1000:7.3f}s", style="dim")
    else:
        text.append(_ms(at if isinstance(at, int) else None), style="dim")
    if run:
        text.append(printable(f"  {run:<3}"), style="blue")
    text.append(f"  {kind:<16}", style=_EVENT_STYLE.get(kind, ""))
    step = _step(e)
    if e.get("attempt") is not None and kind.startswith("step_"):
        step += f" #{e['attempt']}"
    text.append(printable(f" {step:<20}"))
    worker = _worker(e, names or {})
    detail = event_detail(e) if kind != "step_offered" else f"to {worker}"
    if detail:
        text.append(printable(f" {detail}"),
                    style="red" if kind in ("step_failed", "run_failed") else "dim")
    return text


# --------------------------------------------------------------------------- lists


def run_list_table(runs: Sequence[RunSummary]) -> Table:
    table = Table(show_edge=False, pad_edge=False)
    table.add_column("run", no_wrap=True)
    table.add_column("workflow", no_wrap=True, overflow="ellipsis", ratio=1)
    table.add_column("version", no_wrap=True, overflow="ellipsis", ratio=1)
    table.add_column("status", no_wrap=True)
    table.add_column("created (UTC)", no_wrap=True)
    table.add_column("updated (UTC)", no_wrap=True)
    for r in runs:
        _row(table, r.run_id, r.workflow, r.definition_version or "—", _status_text(r.status),
             _when(r.created_at, short=True), _when(r.updated_at, short=True))
    return table


def workers_table(workers: Sequence[Mapping[str, Any]]) -> Table:
    table = Table(show_edge=False, pad_edge=False)
    table.add_column("worker", no_wrap=True)
    table.add_column("name", overflow="fold")
    table.add_column("build", overflow="fold")
    table.add_column("concurrency", justify="right")
    table.add_column("connected")
    table.add_column("leases", justify="right")
    table.add_column("last heartbeat", no_wrap=True)
    # Worker affinity (docs/affinity.md): the negotiated protocol, what the worker
    # supports (its flat capabilities, each marked supported in its manifest), and
    # the worker sessions it holds.
    table.add_column("protocol", no_wrap=True)
    table.add_column("capabilities", overflow="fold")
    table.add_column("sessions", justify="right")
    # Sticky execution's cache counts (docs/affinity.md), only when a worker has them.
    sticky = any(isinstance(w.get("sticky"), Mapping) for w in workers)
    if sticky:
        table.add_column("sticky hit/miss/evict/cold", no_wrap=True)
    for w in workers:
        connected = bool(w.get("connected"))
        cells = [w.get("worker_id"), w.get("name") or "", w.get("build_id") or "—",
                 w.get("concurrency", ""),
                 Text("yes" if connected else "no", style="green" if connected else "dim"),
                 len(w.get("leases") or []), w.get("last_heartbeat_at") or "—",
                 w.get("protocol_version") or "—", _capabilities(w),
                 len(w.get("sessions") or [])]
        if sticky:
            s = w.get("sticky")
            cells.append("/".join(str(_int(s.get(k))) for k in
                                  ("hit", "miss", "eviction", "forced_cold_replay"))
                         if isinstance(s, Mapping) else "—")
        _row(table, *cells)
    return table


def _capabilities(worker: Mapping[str, Any]) -> str:
    """The capabilities a worker declared supported (``—``: none)."""
    caps = worker.get("capabilities")
    if not isinstance(caps, list) or not caps:
        return "—"
    return ", ".join(str(c) for c in caps)


def _int(value: Any) -> int:
    """A count the daemon sent (0 when absent or not an integer)."""
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _actor_label(node: Mapping[str, Any]) -> Text:
    state = str(node.get("state", ""))
    label = Text()
    label.append(printable(node.get("path", "?")), style="bold")
    label.append(printable(f"  {node.get('kind', '')}"), style="cyan")
    label.append(printable(f"  {state}"), style="green" if state == "running" else "yellow")
    restarts = _int(node.get("restarts"))
    label.append(f"  restarts {restarts}", style="red" if restarts else "dim")
    label.append(printable(f"  mailbox {node.get('mailbox_depth', 0)}/"
                           f"{node.get('mailbox_size', '?')}"), style="dim")
    if node.get("timers"):
        label.append(printable(f"  timers {node['timers']}"), style="dim")
    return label


def actor_tree(root: Mapping[str, Any], *, max_children: int | None = 50) -> Tree:
    """The supervision tree; a supervisor with more than ``max_children`` shows the first ones."""

    def add(tree: Tree, node: Mapping[str, Any]) -> None:
        children = list(node.get("children") or [])
        shown = children if max_children is None else children[:max_children]
        for child in shown:
            add(tree.add(_actor_label(child)), child)
        if len(shown) < len(children):
            tree.add(Text(f"… and {len(children) - len(shown)} more (--all shows them)",
                          style="dim"))

    tree = Tree(_actor_label(root))
    add(tree, root)
    return tree


def count_actors(root: Mapping[str, Any]) -> tuple[int, int]:
    """(actors, restarts) in the whole tree."""
    actors, restarts = 1, _int(root.get("restarts"))
    for child in root.get("children") or []:
        a, r = count_actors(child)
        actors += a
        restarts += r
    return actors, restarts


def kill_message(path: str, answer: Mapping[str, Any]) -> str:
    """What ``stepd actors kill PATH`` prints: what was killed and what its supervisor restarts.

    The daemon answers ``{"path", "restarted": [the killed actor first, then the
    siblings its supervisor restarts with it]}``: under ``rest_for_one`` killing
    ``/registry`` also restarts the children started after it. A daemon that
    predates ``restarted`` does not say; the message then does not claim that
    the one actor restarts alone. The result is `printable`.
    """
    killed = answer.get("path") if isinstance(answer.get("path"), str) else path
    restarted = answer.get("restarted")
    if not isinstance(restarted, list):
        return printable(f"killed {killed}; its supervisor restarts it from storage, with any "
                         "siblings its strategy restarts along with it (this daemon does not "
                         "say which)")
    others = [str(p) for p in restarted if p != killed]
    if not others:
        return printable(f"killed {killed}; its supervisor restarts it from storage")
    strategy = answer.get("strategy") if isinstance(answer.get("strategy"), str) else "rest_for_one"
    return printable(f"killed {killed}; its supervisor restarts it and, with it ({strategy}), "
                     f"{', '.join(others)}")
