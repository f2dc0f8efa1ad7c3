"""The pure parts of ``python -m bench --vs-restate``: arguments, ratios, medians, table.

Nothing here starts Restate or stepd (the driver itself runs for minutes and
needs the package registries once); these check that the figures are divided
the right way round, judged against issue 16's targets, and summarised by the
median of the per-cycle ratios. No timing is asserted.
"""

from __future__ import annotations

from typing import Any

import pytest

from bench.__main__ import parse_args
from bench._ratios import FIGURES, cycle_ratios, median_ratios, render
from bench._vs_restate import loopback_netns, restate_flags, sizes


def cycle_rows(scale: float = 1.0) -> dict[str, dict[str, dict[str, Any]]]:
    """One cycle: Restate's rows as its bench.py prints them, stepd's as bench's."""
    restate = {
        "A": {"per_step_ms_median": 1.5, "wf1_e2e_ms_median": 6.0},
        "B": {"steps_per_s": 1500.0, "cpu_s": {"server": 2.0, "worker": 1.5, "client": 0.5}},
        "C": {"cpu_pct": {"server": 2.5, "worker": 0.1}},
        "D": {"peak_rss_mb": {"server": 320.0, "worker": 60.0, "client": 40.0}},
    }
    def net(step: float, rate: float) -> dict[str, dict[str, Any]]:
        return {"A": {"per_step_ms_median": step * scale, "wf1_e2e_ms_median": 2.0 * scale},
                "B": {"steps_per_s": rate / scale,
                      "cpu_s": {"daemon": 2.0, "worker": 1.0, "client": 0.2}},
                "C": {"cpu_pct": {"daemon": 0.033, "worker": 0.0}},
                "D": {"peak_rss_mb": {"daemon": 70.0, "worker": 60.0, "client": 50.0}}}
    embedded = {"A": {"per_step_ms_median": 0.3 * scale, "wf1_e2e_ms_median": 1.2 * scale},
                "B": {"steps_per_s": 4000.0 / scale, "cpu_s": {"process": 3.0}},
                "C": {"cpu_pct": {"process": 0.033}},
                "D": {"peak_rss_mb": {"process": 85.0}}}
    return {"restate": restate, "websocket": net(0.75, 4500.0), "http": net(1.5, 1200.0),
            "embedded": embedded}


def by_name(rows: list[dict[str, Any]], figure: str, transport: str) -> dict[str, Any]:
    return next(r for r in rows if r["figure"] == figure and r["transport"] == transport)


def test_a_cycle_divides_stepd_by_restate_and_judges_every_target() -> None:
    rows = cycle_ratios(cycle_rows(), commit_ms=0.2)
    a = by_name(rows, "A per-step median", "websocket")
    assert a["ratio"] == 0.5 and a["target"] == "<= 0.6x" and a["met"] is True
    one = by_name(rows, "A 1-step e2e median", "websocket")
    assert one["ratio"] == round(2.0 / 6.0, 3) and one["met"] is True  # 0.333 <= 0.4
    b = by_name(rows, "B steps/s", "websocket")
    assert b["ratio"] == 3.0 and b["met"] is True  # higher is better: 3.0 >= 2.5
    http_a = by_name(rows, "A per-step median", "http")
    assert http_a["ratio"] == 1.0 and http_a["met"] is True  # no worse than Restate
    http_b = by_name(rows, "B steps/s", "http")
    assert http_b["ratio"] == 0.8 and http_b["met"] is False
    commit = by_name(rows, "A per-step / synced commit", "embedded")
    assert commit["reference"] == 0.2 and commit["ratio"] == 1.5 and commit["met"] is True
    cpu = by_name(rows, "B CPU s, all processes", "websocket")
    assert cpu["ratio"] == round(3.2 / 4.0, 3) and cpu["met"] is None  # reported, no target
    idle = by_name(rows, "C idle daemon CPU %", "websocket")
    assert idle["ratio"] == 0.033 and idle["target"] == "<= 0.1" and idle["met"] is True
    rss = by_name(rows, "D daemon peak RSS in B (MB)", "http")
    assert rss["ratio"] == 70.0 and rss["met"] is True
    assert by_name(rows, "D daemon RSS vs Restate", "embedded")["ratio"] == round(85 / 320, 3)
    assert len(rows) == len(FIGURES)


def test_a_missing_row_gives_no_ratio_and_no_verdict() -> None:
    rows = cycle_rows()
    del rows["restate"]["B"]
    judged = by_name(cycle_ratios(rows, 0.2), "B steps/s", "websocket")
    assert judged["ratio"] is None and judged["met"] is None


def test_only_the_transports_asked_for() -> None:
    rows = cycle_ratios(cycle_rows(), 0.2, ["websocket"])
    assert {r["transport"] for r in rows} == {"websocket"}


def test_the_summary_is_the_median_of_the_per_cycle_ratios() -> None:
    cycles = [cycle_ratios(cycle_rows(s), 0.2) for s in (1.0, 1.2, 0.9)]
    medians = median_ratios(cycles)
    a = by_name(medians, "A per-step median", "websocket")
    assert a["ratios"] == [0.5, 0.6, 0.45] and a["median"] == 0.5 and a["met"] is True
    b = by_name(medians, "B steps/s", "websocket")
    assert b["ratios"] == [3.0, 2.5, round(3.0 / 0.9, 3)] and b["median"] == 3.0
    assert b["stepd_median"] == 4500.0 and b["reference_median"] == 1500.0
    table = render(medians)
    assert "| A per-step median" in table and "cycle 3" in table and "median" in table


def test_arguments_default_to_three_cycles_of_peers_sizes_and_user_defaults() -> None:
    args, _only, transports = parse_args(["--vs-restate"])
    assert args.vs_restate and args.cycles == 3
    assert (args.a_runs, args.b_count, args.idle_seconds, args.settle) == (20, 1000, 30.0, 5.0)
    assert transports == ["embedded", "websocket", "http"]
    assert args.client_loop == "asyncio" and args.worker_concurrency is None
    assert args.embedded_gc == "default"
    assert sizes(args) == {"a_runs": 20, "a_one": 20, "b_wf": 1000, "c_settle": 5.0,
                           "c_window": 30.0}
    flags = restate_flags(args)
    assert flags[flags.index("--b-count") + 1] == "1000" and "--no-fsync-probe" in flags
    assert flags[flags.index("--concurrency") + 1] == "100"


def test_arguments_tuned_and_sizes() -> None:
    args, _, transports = parse_args(["--vs-restate", "--cycles", "2", "--b-count", "200",
                                      "--transport", "websocket,http", "--tuned"])
    assert args.cycles == 2 and args.b_count == 200 and transports == ["websocket", "http"]
    assert (args.client_loop, args.worker_concurrency, args.embedded_gc) == ("uvloop", 128, "tuned")


@pytest.mark.parametrize("argv", [["--vs-restate", "--cycles", "0"],
                                  ["--worker-concurrency", "0"],
                                  ["--vs-restate", "--b-count", "0"],
                                  ["--transport", "carrier-pigeon"]])
def test_bad_arguments_are_refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    assert "error" in capsys.readouterr().err


def test_a_given_namespace_is_used_as_it_is() -> None:
    with loopback_netns("someone-elses") as ns:
        assert ns == "someone-elses"
