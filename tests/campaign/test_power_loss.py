"""D2: acknowledged work survives power cuts (research/anchors-reliability.md D2).

A SIGKILL keeps the kernel's page cache, so D1 (tests/reliability/
test_crash_sigkill.py) cannot see a missing fsync. Here the daemon's data
directory is a lazyfs mount (`_lazyfs.py`): writes stay in the memory of the
FUSE server until the file is synced, and a power cut drops whatever was not.

One data directory (the mount's root) for the whole test. Each round starts
``python -m stepd serve`` on it (D1's short lease settings) while four SDK-less
workers (two over HTTP, two over the WebSocket), a starter and a signaller
(`_powerloss_load.py`) work against it.
After a random 0.3-1.5 s, then (the rounds take turns) while the daemon is
inside an fsync (lazyfs holds the sync until the cut: what the daemon wrote
for it is unsynced, and whatever waits on it unanswered), right as the next
completion, start or signal is acknowledged, or at once, the round ends with
a cut:

1. the daemon is SIGKILLed by its PID;
2. the lazyfs server is SIGKILLed: every write not yet synced is gone (every
   other round the cut is torn: each unsynced page is kept or dropped at
   random, as a disk's cache may leave them), and every request it had not
   answered (a held fsync) fails;
3. the daemon is reaped, the dead mount unmounted (the kernel's page cache
   of its files goes with it) and a new server mounted on what was synced;
4. the next round starts a new daemon on the same directory.

After the last cut a last daemon lets every run finish, and the history is
checked through the HTTP API: every acknowledged completion is in its run's
journal and is the output the run kept; every acknowledged start is still a
run under its idempotency key (a start sent again with the key gets that run,
``created: false``); every acknowledged signal is the payload of the ``wait``
step it answered, received once; every run completes with the right result.

The control runs the same cuts against ``stepd serve --unsafe-no-sync``
(commits without fsync): it must lose acknowledged work, or this test could
not fail.

Size: ``STEPD_CAMPAIGN_POWER_CUTS`` (default 20; the campaign's reduced size
is 3), seed ``STEPD_CAMPAIGN_SEED``. Needs root, ``/dev/fuse``, libfuse 3 and
mfusepy; skipped (with the reason) without them.
"""

from __future__ import annotations

import functools
import os
import random
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.campaign._lazyfs import LazyFS, unavailable_reason
from tests.campaign._powerloss_load import (
    History,
    Signaller,
    Starter,
    Verdict,
    Worker,
    WsWorker,
    check,
    guarded,
    wait_runs,
)
from tests.campaign.conftest import campaign_int, campaign_seed
from tests.reliability.conftest import Current, DaemonProcess, kill9, start_daemon, stop_daemon

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]

WORKERS = 2  # of each transport: HTTP long-poll and WebSocket push
DAEMON_ARGS = ("--lease-ttl-ms", "1000", "--heartbeat-ms", "300",
               "--recovery-window-ms", "300", "--max-request-ms", "1000",
               "--shutdown-grace-ms", "2000")
ROUND_S = (0.3, 1.5)
# When each round (in turn) cuts: after its random time; right after the next acknowledged
# completion, start or signal; or while the daemon is inside an fsync (lazyfs holds it).
# (The order puts a cut amid a sync first, so that a reduced run of 3 cuts has one.)
ROUND_KINDS = ("amid-sync", "complete", "start", "signal", "random")
ACK_WAIT_S = 3.0
# Every other round's cut is torn: each unsynced page reaches the disk with this
# probability (`LazyFS.cut`'s ``keep``), the way a real disk's cache can leave a meta
# page written ahead of the pages it names. The storage runs LMDB without its own sync
# behind its write-ahead log (docs/storage.md), which must recover from exactly that.
# Not for the control: it has nothing to recover with.
TORN_KEEP = 0.5
FINAL_DEADLINE_S = 90.0
CONTROL_FINAL_DEADLINE_S = 20.0  # the control's lost runs never finish


@pytest.fixture
def lazyfs(tmp_path: Path) -> Iterator[LazyFS]:
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    with LazyFS(tmp_path / "disk", tmp_path / "mnt") as fs:
        yield fs


@dataclass
class Campaign:
    history: History
    verdict: Verdict
    cuts: int
    on_ack: Counter[str]
    dropped_pages: int
    cuts_mid_write: int
    syncs: int
    runs_finished: int
    tracebacks: list[str]
    final_status: int
    starter_idle: bool
    elapsed: float
    torn_cuts: int = 0
    torn_pages_kept: int = 0


def run_campaign(fs: LazyFS, cuts: int, seed: int, *, unsafe: bool) -> Campaign:
    rng = random.Random(seed)
    data = fs.mountpoint  # LMDB's files at the mount's root; the daemon's log beside it, on disk
    args = DAEMON_ARGS + (("--unsafe-no-sync",) if unsafe else ())
    t0 = time.monotonic()
    current = Current()
    h = History()
    stop = threading.Event()
    starter = Starter(current, h, stop, random.Random(rng.random()),
                      prefix="control-run" if unsafe else "power-run")
    signaller = Signaller(current, h, stop, random.Random(rng.random()))
    workers = [Worker(i, current, h, stop) for i in range(WORKERS)]
    workers += [WsWorker(i, current, h, stop) for i in range(WORKERS)]
    threads = [threading.Thread(target=guarded(h, w.run), name=w.name, daemon=True)
               for w in workers]
    threads.append(threading.Thread(target=guarded(h, starter.run), name="power-starter",
                                    daemon=True))
    threads.append(threading.Thread(target=guarded(h, signaller.run), name="power-signaller",
                                    daemon=True))
    for t in threads:
        t.start()
    tracebacks: list[str] = []
    on_ack: Counter[str] = Counter()
    syncs = 0
    mid_write = 0  # cuts that found written, unsynced pages of data.mdb
    torn = kept = 0
    done = 0
    d: DaemonProcess | None = None
    try:
        for round_no in range(cuts):
            d = start_daemon(data, *args)
            current.publish(d.url)
            time.sleep(rng.uniform(*ROUND_S))
            kind = ROUND_KINDS[round_no % len(ROUND_KINDS)]
            if kind == "amid-sync":
                if fs.hold_syncs(ACK_WAIT_S):
                    on_ack[kind] += 1
            elif kind != "random":
                h.ack_events[kind].clear()
                if h.ack_events[kind].wait(ACK_WAIT_S):
                    on_ack[kind] += 1
            # The power goes: the daemon and the disk's cache at once. The daemon is
            # reaped once the lazyfs server is dead (a held fsync keeps it until then).
            os.kill(d.pid, signal.SIGKILL)
            current.publish(None)
            keep = TORN_KEEP if round_no % 2 == 1 and not unsafe else 0.0
            before = fs.cut(keep=keep, seed=seed + round_no, then=functools.partial(kill9, d))
            torn += keep > 0
            kept += int(before.get("torn_pages_kept", 0))
            if "Traceback" in d.stderr():
                tracebacks.append(f"round {round_no}:\n{d.stderr()}")
            d = None
            syncs += int(before.get("fsyncs", 0)) + int(before.get("fdatasyncs", 0))
            data_file = before.get("files", {}).get("/data.mdb", {})
            mid_write += bool(data_file.get("dirty_pages")
                              or data_file.get("size") != data_file.get("durable_size"))
            done += 1

        d = start_daemon(data, *args)
        current.publish(d.url)
        starter.no_new_runs.set()
        deadline = time.monotonic() + (CONTROL_FINAL_DEADLINE_S if unsafe else FINAL_DEADLINE_S)
        while not starter.idle() and time.monotonic() < deadline:
            time.sleep(0.05)
        starter_idle = starter.idle()
        with d.client() as client:
            run_ids = [run_id for _, run_id, _ in h.runs.values()]
            results = wait_runs(client, run_ids, deadline)
            stop.set()
            for t in threads:
                t.join(15)
            assert not any(t.is_alive() for t in threads), "a client thread did not stop"
            verdict = check(client, h, results)
        final_status = stop_daemon(d)
        if "Traceback" in d.stderr():
            tracebacks.append(f"final daemon:\n{d.stderr()}")
        d = None
    finally:
        stop.set()
        current.publish(None)
        if d is not None:
            kill9(d)
        for t in threads:
            t.join(15)
    finished = sum(1 for r in results.values() if r.get("status") == "completed")
    return Campaign(h, verdict, done, on_ack, fs.dropped_pages, mid_write, syncs, finished, tracebacks,
                    final_status, starter_idle, time.monotonic() - t0, torn, kept)


def _figures(c: Campaign) -> str:
    h, v = c.history, c.verdict
    return (
        f"cuts={c.cuts} (right after an ack / amid a sync: {dict(sorted(c.on_ack.items()))}) "
        f"dropped-unsynced-pages={c.dropped_pages} (cuts amid a data.mdb write {c.cuts_mid_write}) "
        f"torn-cuts={c.torn_cuts} (unsynced pages kept {c.torn_pages_kept}) "
        f"syncs={c.syncs} "
        f"checked: completions={len(h.acked)} starts={len(h.runs)} signals={len(h.signals)} "
        f"lost: completions={len(v.lost_completions)} starts={len(v.lost_starts)} "
        f"signals={len(v.lost_signals)} (total {v.lost}) "
        f"runs-completed={c.runs_finished}/{len(h.runs)} "
        f"completions-by-worker={dict(sorted(h.acked_by.items()))} "
        f"ambiguous-completes={len(h.ambiguous)} (recovered {v.recovered}, not-landed {v.not_landed}; "
        f"resent and acknowledged {h.retried_acked}) "
        f"signals: sent-before-the-wait={h.signals_before_wait} "
        f"unanswered-landed={len(h.signals_recovered)} not-landed={h.signals_not_landed} "
        f"duplicated={v.duplicated} unexpected={len(v.unexpected)} "
        f"contradictions={len(v.contradictions)} double-created={v.double_created} "
        f"registrations-lost={h.registrations_lost} runs-404={sum(h.runs_unknown.values())} "
        f"lease-404={h.lease_unknown} start-dedup={h.start_dedup} "
        f"conflicts={dict(sorted(h.conflicts.items()))} elapsed={c.elapsed:.1f}s"
    )


def test_acknowledged_work_survives_power_cuts(lazyfs: LazyFS, summary: Callable[[str], None]) -> None:
    cuts = campaign_int("STEPD_CAMPAIGN_POWER_CUTS")
    seed = campaign_seed()
    c = run_campaign(lazyfs, cuts, seed, unsafe=False)
    h, v = c.history, c.verdict
    line = f"D2 seed={seed} " + _figures(c)
    summary(line)
    assert not h.crashed, h.crashed[0]
    assert h.acked and h.runs and h.signals, "empty history: nothing acknowledged (" + line + ")"
    assert len(h.acked_by) == 2 * WORKERS, f"a worker got no completion through: {h.acked_by}"
    assert c.cuts == cuts
    assert c.cuts_mid_write > 0, \
        "no cut came while the daemon had unsynced writes: the power cut was not tested"
    assert not v.lost_completions, f"acknowledged completions lost: {v.lost_completions[:5]}"
    assert not v.lost_starts, f"acknowledged starts lost: {v.lost_starts[:5]}"
    assert not v.lost_signals, f"acknowledged signals lost: {v.lost_signals[:5]}"
    assert h.registrations_lost == 0, "an acknowledged worker registration was lost"
    assert not h.runs_unknown, f"acknowledged runs answered 404: {dict(h.runs_unknown)}"
    assert v.duplicated == 0
    assert not v.unexpected, v.unexpected[:5]
    assert not v.contradictions, v.contradictions[:5]
    assert c.starter_idle, "run starts still unanswered at the end"
    assert not v.wrong_results, f"{len(v.wrong_results)} runs not completed right: {v.wrong_results[:3]}"
    assert v.double_created == 0, f"{v.double_created} runs beyond one per idempotency key"
    assert not h.bad_status, h.bad_status[:5]
    assert not c.tracebacks, c.tracebacks[0]
    assert c.final_status == 0


def test_control_without_fsync_loses_acknowledged_work(lazyfs: LazyFS,
                                                       summary: Callable[[str], None]) -> None:
    """``--unsafe-no-sync`` under the same cuts: the check must find losses."""
    cuts = campaign_int("STEPD_CAMPAIGN_POWER_CUTS")
    seed = campaign_seed()
    c = run_campaign(lazyfs, cuts, seed, unsafe=True)
    h, v = c.history, c.verdict
    line = f"D2-control (--unsafe-no-sync) seed={seed} " + _figures(c)
    summary(line)
    assert not h.crashed, h.crashed[0]
    assert h.acked and h.runs, "empty history: nothing acknowledged (" + line + ")"
    assert v.lost > 0, "the control lost nothing: the power cut does not test durability (" + line + ")"
