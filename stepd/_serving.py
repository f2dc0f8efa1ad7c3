"""How a worker runs (mixed into `stepd.Worker`): ``serve()`` from any thread,
``await run()`` in a loop, on an embedded daemon's loop whoever starts it, and
``wait_ready()`` for the threads that wait for its registration.
"""

from __future__ import annotations

import functools
import signal
import threading
import time
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
import anyio.to_thread

from stepd._errors import Invalid
from stepd._loop import loop_options

if TYPE_CHECKING:
    from stepd._bodies import Definition
    from stepd.embedded import Embedded


class Serving:
    """`serve`, `run` and `wait_ready`; they read the worker's state below."""

    grace: float
    _daemon: Embedded | None
    _lock: threading.Lock
    _ran: bool
    _defs: dict[tuple[str, str | None], Definition]
    _done_thread: threading.Event
    _ready_thread: threading.Event
    _task_status: Any

    if TYPE_CHECKING:  # the worker's
        def stop(self, grace: float | None = None) -> None: ...

        async def _run_here(self) -> None: ...

    def serve(self, *, backend: str = "asyncio", handle_signals: bool = True) -> None:
        """Run until stopped; blocks. Usable from any thread.

        On the main thread, SIGINT and SIGTERM stop the worker gracefully (a
        second one cancels the running bodies at once, failing them back).

        Args:
            backend: the event loop for a network worker, ``"asyncio"`` or
                ``"trio"`` (a worker of an embedded daemon runs on its loop).
            handle_signals: install the SIGINT/SIGTERM handling (main thread only).

        Raises:
            Invalid: a definition refused at register (``field`` names it).
            Unauthorized, Forbidden: the key.
            NotStarted: the daemon answered ``not_started`` (a worker bug).
            RuntimeError: the worker ran already.
        """
        daemon = self._daemon
        if daemon is not None:
            self._serve_embedded(daemon)
            return
        anyio.run(self._serve_main, handle_signals, backend=backend,
                  backend_options=loop_options(backend))

    def _serve_embedded(self, daemon: Embedded) -> None:
        portal = daemon._portal
        if portal is None:
            daemon.call_blocking(self.run)
            return
        future = portal.start_task_soon(self.run)
        interrupts = 0
        while True:
            try:
                future.result()
                return
            except KeyboardInterrupt:
                interrupts += 1
                self.stop(self.grace if interrupts == 1 else 0.0)

    async def _serve_main(self, handle_signals: bool) -> None:
        if not handle_signals or threading.current_thread() is not threading.main_thread():
            await self.run()
            return
        error: list[BaseException] = []
        async with anyio.create_task_group() as tg:

            async def watch() -> None:
                try:
                    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                        count = 0
                        async for _ in signals:
                            count += 1
                            self.stop(self.grace if count == 1 else 0.0)
                except NotImplementedError:  # no signal support on this platform/loop
                    return

            async def main() -> None:
                try:
                    await self.run()
                except Exception as exc:  # noqa: BLE001 - re-raised below, outside the task group
                    error.append(exc)
                finally:
                    tg.cancel_scope.cancel()

            tg.start_soon(watch)
            tg.start_soon(main)
        if error:
            raise error[0]

    async def run(self, *, task_status: anyio.abc.TaskStatus[Any] = anyio.TASK_STATUS_IGNORED
                  ) -> None:
        """Run in the current event loop (asyncio or trio) until stopped.

        ``await tg.start(worker.run)`` returns once the worker has registered
        (its workflows can be started from then on).

        Cancelling it cancels the running bodies and fails them back as
        ``retryable`` (shielded, bounded), then re-raises the cancellation.

        Raises:
            as `serve`.
        """
        daemon = self._daemon
        if daemon is not None and not daemon.on_loop():
            await self._run_elsewhere(daemon, task_status)
            return
        with self._lock:
            if self._ran:
                raise RuntimeError("a Worker runs once; create another to run again")
            self._ran = True
        if not self._defs:
            self._done_thread.set()
            raise Invalid("register at least one workflow before running", field="workflows")
        self._task_status = task_status
        await self._run_here()

    async def _run_elsewhere(self, daemon: Embedded, task_status: anyio.abc.TaskStatus[Any]
                             ) -> None:
        """The embedded daemon's loop is another thread's: run the worker there."""
        error: list[BaseException] = []
        ended = threading.Event()

        def run_there() -> None:
            try:
                daemon.call_blocking(self.run)
            except Exception as exc:  # noqa: BLE001 - re-raised below, in this task
                error.append(exc)
            finally:
                ended.set()

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(functools.partial(anyio.to_thread.run_sync, run_there,
                                                abandon_on_cancel=True))
                while not (self._ready_thread.is_set() or ended.is_set()):
                    await anyio.to_thread.run_sync(self._ready_thread.wait, 0.05,
                                                   abandon_on_cancel=True)
                if self._ready_thread.is_set():
                    task_status.started(self)
        except anyio.get_cancelled_exc_class():
            self.stop(0.0)
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self._done_thread.wait, 30.0)
            raise
        if error:
            raise error[0]

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until the worker has registered (or ended); for code on other threads.

        ``threading.Thread(target=worker.serve).start(); worker.wait_ready(10)``:
        the worker's workflows can be started once this returns True.

        Returns:
            True once registered; False if ``timeout`` passed or the worker ended first.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._ready_thread.is_set():
            if self._done_thread.is_set():
                return self._ready_thread.is_set()
            left = 0.05 if deadline is None else min(0.05, deadline - time.monotonic())
            if left <= 0:
                return False
            self._ready_thread.wait(left)
        return True

