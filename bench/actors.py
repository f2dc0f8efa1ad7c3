"""Micro-benchmark of the generic actor runtime (stepd.actors).

Run it as ``python -m bench.actors`` (``--quick`` for a smoke run). It prints,
for asyncio and for trio:

* asks/s: sequential request/reply round trips from one caller to one actor
  (the per-ask runtime overhead is 1/rate: one mailbox send, one handler
  call, one reply wake-up);
* asks/s with a timeout: the same, each ask under a cancel scope;
* tells/s: one producer filling a bounded mailbox as fast as the actor drains
  it (backpressure included), measured until the actor has handled them all;
* concurrent asks/s: 100 callers asking one actor at once;
* dynamic child start+stop/s: `start_child` then `stop_child` (graceful), one
  after the other, of an actor that overrides neither `on_start` nor
  `on_stop` (so the handshake and the stop have nothing to wait for); each
  `ChildSpec` is built inside the timed loop, as the daemon builds one per
  lease, from ids made before it (as a lease's id is made before its spec);
* the same with `start_child_nowait`;
* the same with an actor that overrides both (trivial hooks: the handshake
  and a graceful stop that runs `on_stop`);
* timer fire+deliver/s: 1,000 actors, each with a timer armed in on_start,
  all fired by one virtual clock advance and handled (arming not timed).

Then, because timings on a shared machine move by tens of percent, the
deterministic figure: Python calls per operation (cProfile, every ``call``
event, i.e. a function called or a coroutine resumed, plus every ``c_call``,
as ``python -m bench.calls`` counts them) for a sequential inline ask, a tell
(the producer's call and the dispatcher's handling of the message, mailbox
backpressure included) and a dynamic child start+stop, over `COUNT_OPS`
operations after a warm-up. `count_calls_per_op()` is what
tests/actors/test_costs.py holds to a budget. Beside them, the CPU time
(`time.process_time`) per operation, best of three rounds: on a loaded
machine it moves far less than wall time.

Numbers are wall time on this machine, best of a few rounds; they are for
comparing runtime changes, not a target by themselves (DESIGN.md: targets are
measured by bench/, never by timed tests).
"""

from __future__ import annotations

import argparse
import cProfile
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import anyio.lowlevel

from stepd.actors import Actor, ActorSystem, ChildSpec, ManualClock, Supervisor


class Echo(Actor):
    async def receive(self, message: Any) -> Any:
        return message


class Sink(Actor):
    mailbox_size = 256

    def __init__(self) -> None:
        self.count = 0
        self.target = -1
        self.reached = anyio.Event()

    async def receive(self, message: Any) -> Any:
        self.count += 1
        if self.count == self.target:
            self.reached.set()
        return None


class Idle(Actor):
    async def receive(self, message: Any) -> Any:
        return None


class Hooked(Actor):
    async def on_start(self) -> None:
        self.loaded = True

    async def receive(self, message: Any) -> Any:
        return None

    async def on_stop(self, reason: BaseException | None) -> None:
        self.loaded = False


class TimerActor(Actor):
    fired = 0

    async def on_start(self) -> None:
        self.arm_timer("t", self.clock.now() + 1.0, "fire")

    async def receive(self, message: Any) -> Any:
        TimerActor.fired += 1
        return None


async def _best(rounds: int, fn: Callable[[], Awaitable[float]]) -> float:
    return max([await fn() for _ in range(rounds)])


async def bench_asks(system: ActorSystem, n: int) -> float:
    ref = await system.spawn(ChildSpec("echo", Echo))
    ask = ref.ask
    for _ in range(200):  # warm up
        await ask(1)
    t0 = time.perf_counter()
    for i in range(n):
        await ask(i)
    rate = n / (time.perf_counter() - t0)
    await system.stop("/echo")
    return rate


async def bench_asks_timeout(system: ActorSystem, n: int) -> float:
    ref = await system.spawn(ChildSpec("echo_t", Echo))
    ask = ref.ask
    t0 = time.perf_counter()
    for i in range(n):
        await ask(i, timeout=10.0)
    rate = n / (time.perf_counter() - t0)
    await system.stop("/echo_t")
    return rate


async def bench_concurrent_asks(system: ActorSystem, n: int, callers: int = 100) -> float:
    ref = await system.spawn(ChildSpec("echo_c", Echo))
    per = n // callers

    async def caller() -> None:
        for i in range(per):
            await ref.ask(i)

    t0 = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for _ in range(callers):
            tg.start_soon(caller)
    rate = per * callers / (time.perf_counter() - t0)
    await system.stop("/echo_c")
    return rate


async def bench_tells(system: ActorSystem, n: int) -> float:
    sink = Sink()
    sink.target = n
    ref = await system.spawn(ChildSpec("sink", lambda: sink))
    tell = ref.tell
    t0 = time.perf_counter()
    for i in range(n):
        await tell(i)
    await sink.reached.wait()
    rate = n / (time.perf_counter() - t0)
    await system.stop("/sink")
    return rate


async def bench_children(system: ActorSystem, n: int) -> float:
    runs = await system.root.start_child(ChildSpec("runs", Supervisor))
    sup = system.supervisor("/runs")
    ids = [f"r_{i}" for i in range(n)]  # the daemon has its lease ids already
    t0 = time.perf_counter()
    for child_id in ids:
        await sup.start_child(ChildSpec(child_id, Idle))
        await sup.stop_child(child_id)
    rate = n / (time.perf_counter() - t0)
    await system.stop(runs.path)
    return rate


async def bench_children_nowait(system: ActorSystem, n: int) -> float:
    runs = await system.root.start_child(ChildSpec("runs_nw", Supervisor))
    sup = system.supervisor("/runs_nw")
    ids = [f"r_{i}" for i in range(n)]  # the daemon has its lease ids already
    t0 = time.perf_counter()
    for child_id in ids:
        sup.start_child_nowait(ChildSpec(child_id, Idle))
        await sup.stop_child(child_id)
    rate = n / (time.perf_counter() - t0)
    await system.stop(runs.path)
    return rate


async def bench_children_hooked(system: ActorSystem, n: int) -> float:
    runs = await system.root.start_child(ChildSpec("runs_h", Supervisor))
    sup = system.supervisor("/runs_h")
    ids = [f"r_{i}" for i in range(n)]  # the daemon has its lease ids already
    t0 = time.perf_counter()
    for child_id in ids:
        await sup.start_child(ChildSpec(child_id, Hooked))
        await sup.stop_child(child_id)
    rate = n / (time.perf_counter() - t0)
    await system.stop(runs.path)
    return rate


async def bench_timers(n: int) -> float:
    clock = ManualClock()
    async with ActorSystem(clock=clock) as system:
        sup = await system.root.start_child(ChildSpec("timers", Supervisor))
        timers = system.supervisor(sup.path)
        for i in range(n):
            await timers.start_child(ChildSpec(f"t{i}", TimerActor))
        TimerActor.fired = 0
        t0 = time.perf_counter()
        clock.advance(1.0)
        while TimerActor.fired < n:
            await anyio.lowlevel.checkpoint()
        return n / (time.perf_counter() - t0)


#: Operations counted per figure by `count_calls_per_op` (a multiple of the
#: runtime's checkpoint period, 64, and of `Sink.mailbox_size`).
COUNT_OPS = 4096


def _profiled_calls(prof: cProfile.Profile) -> tuple[int, int]:
    """(Python calls, C calls) recorded by `prof`, without its own `disable`."""
    prof.create_stats()
    python = c = 0
    for (filename, _line, name), (_cc, nc, _tt, _ct, _callers) in prof.stats.items():  # type: ignore[attr-defined]
        if name == "<method 'disable' of '_lsprof.Profiler' objects>":
            continue
        if filename == "~":
            c += nc
        else:
            python += nc
    return python, c


async def _count(n: int, op: Callable[[int], Awaitable[object]],
                 after: Callable[[], Awaitable[object]] | None = None) -> tuple[float, float]:
    """Run ``op(0) .. op(n - 1)`` (then `after`) under cProfile: (Python, C) calls per op."""
    prof = cProfile.Profile()
    prof.enable()
    for i in range(n):
        await op(i)
    if after is not None:
        await after()
    prof.disable()
    python, c = _profiled_calls(prof)
    return python / n, c / n


async def _cpu(n: int, op: Callable[[int], Awaitable[object]],
               after: Callable[[], Awaitable[object]] | None = None) -> tuple[float, float]:
    """Run ``op(0) .. op(n - 1)`` (then `after`): (CPU µs of this process per op, 0.0).

    CPU time, not wall time: on a shared machine the other processes' load
    stretches wall time by several times, much less the CPU an op takes.
    """
    t0 = time.process_time()
    for i in range(n):
        await op(i)
    if after is not None:
        await after()
    return (time.process_time() - t0) * 1e6 / n, 0.0


async def count_calls_per_op(n: int = COUNT_OPS) -> dict[str, tuple[float, float]]:
    """Calls per operation, ``{op: (python, c)}``, in a fresh system on the running backend.

    * ``ask``: a sequential ask of an idle `Echo` (handled inline);
    * ``tell``: `n` tells to a `Sink` (mailbox 256) and its handling of them,
      until it has handled the last one;
    * ``spawn+stop``: `start_child` then `stop_child` of an actor with no hooks.

    Each is warmed up first (256 operations), so caches and the facts the
    runtime learns about a class on its first calls are in place.
    """
    return await _per_op(n, _count)


async def cpu_per_op(n: int = 5 * COUNT_OPS) -> dict[str, float]:
    """CPU µs per operation (the operations of `count_calls_per_op`), no profiler on."""
    return {op: us for op, (us, _) in (await _per_op(n, _cpu)).items()}


async def _per_op(n: int, measure: Callable[..., Awaitable[tuple[float, float]]]
                  ) -> dict[str, tuple[float, float]]:
    warm = 256
    results: dict[str, tuple[float, float]] = {}
    async with ActorSystem() as system:
        ask = (await system.spawn(ChildSpec("echo", Echo))).ask
        for i in range(warm):
            await ask(i)
        results["ask"] = await measure(n, ask)

        sink = Sink()
        tell = (await system.spawn(ChildSpec("sink", lambda: sink))).tell
        sink.target = warm
        for i in range(warm):
            await tell(i)
        await sink.reached.wait()
        sink.count, sink.target, sink.reached = 0, n, anyio.Event()
        results["tell"] = await measure(n, tell, sink.reached.wait)

        runs = await system.root.start_child(ChildSpec("runs", Supervisor))
        sup = system.supervisor(runs.path)
        specs = [ChildSpec(f"r_{i}", Idle) for i in range(warm + n)]

        async def spawn_stop(i: int) -> None:
            spec = specs[i]
            await sup.start_child(spec)
            await sup.stop_child(spec.id)

        for i in range(warm):
            await spawn_stop(i)
        del specs[:warm]
        results["spawn+stop"] = await measure(n, spawn_stop)
    return results


async def run_backend(quick: bool) -> dict[str, float]:
    scale = 10 if quick else 1
    rounds = 1 if quick else 3
    results: dict[str, float] = {}
    async with ActorSystem() as system:
        results["asks/s"] = await _best(rounds, lambda: bench_asks(system, 50_000 // scale))
        results["asks/s (timeout)"] = await _best(
            rounds, lambda: bench_asks_timeout(system, 50_000 // scale)
        )
        results["concurrent asks/s (100 callers)"] = await _best(
            rounds, lambda: bench_concurrent_asks(system, 50_000 // scale)
        )
        results["tells/s"] = await _best(rounds, lambda: bench_tells(system, 100_000 // scale))
        results["dynamic child start+stop/s"] = await _best(
            rounds, lambda: bench_children(system, 10_000 // scale)
        )
        results["start_child_nowait+stop/s"] = await _best(
            rounds, lambda: bench_children_nowait(system, 10_000 // scale)
        )
        results["start+stop with on_start/on_stop/s"] = await _best(
            rounds, lambda: bench_children_hooked(system, 10_000 // scale)
        )
    results["timer fire+deliver/s (1000 actors)"] = await _best(
        rounds, lambda: bench_timers(1_000 // scale)
    )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument("--backend", choices=["asyncio", "trio"], action="append")
    parser.add_argument("--calls-only", action="store_true",
                        help="only the calls per op (deterministic; no timings)")
    args = parser.parse_args()
    for backend in args.backend or ["asyncio", "trio"]:
        print(f"{backend}:")
        results = {} if args.calls_only else anyio.run(run_backend, args.quick, backend=backend)
        for name, rate in results.items():
            extra = f"  ({1e6 / rate:6.1f} us each)" if "timer" not in name else ""
            print(f"  {name:34s} {rate:12,.0f}{extra}")
        counts = anyio.run(count_calls_per_op, backend=backend)
        cpu = [anyio.run(cpu_per_op, backend=backend) for _ in range(1 if args.calls_only else 3)]
        print(f"  calls per op (cProfile: Python + C = total, over {COUNT_OPS:,}),"
              " and CPU µs per op (best of the rounds, no profiler):")
        for name, (python, c) in counts.items():
            best = min(r[name] for r in cpu)
            print(f"    {name:12s} {python:7.1f} + {c:7.1f} = {python + c:7.1f} calls"
                  f"   {best:6.2f} us CPU")


if __name__ == "__main__":
    main()
