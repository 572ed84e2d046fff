"""A thread pool for calls into user code (an agent environment's reset, step, tools, get_reward,
close) in which every call has a deadline that a hang cannot outlive.

    pool = DaemonPool(workers=4, name="adarl-tools")
    future = pool.submit(env.reset, timeout_s=30.0)   # done by then at the latest
    future.result()                                   # its value, its exception, or CallTimeout

`concurrent.futures.ThreadPoolExecutor` joins its threads when the interpreter exits, so one tool that
never returns keeps the process alive for good, and holds its worker meanwhile. Here a call runs on a
daemon thread of its own, at most `workers` at a time; at its deadline, `timeout_s` after it started
running, its future fails with `CallTimeout`. The call is then abandoned: its thread finishes or hangs
alone, never blocking exit, and its slot goes to the next call. `timeouts` counts the calls that failed
so. Time spent queued does not count: a burst of quick calls (a hundred held-out trajectories calling
their tools in the same turn) must not fail because the pool is small, only because a call is slow.
Every call still ends in bounded time, since each slot is freed within `timeout_s`: n calls on w
workers are all done within ceil(n / w) deadlines.

Abandoned threads are capped: while `max_abandoned` of them are still running (hung user code holds
a thread, its stack and whatever it allocated), `submit` fails every new call at once with
`PoolExhausted` (a `CallTimeout`, so callers censor it as they censor a timeout) and counts it in
`refused`; as hung calls return, the pool takes calls again.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any


class CallTimeout(TimeoutError):
    """A call to user code did not answer before its deadline."""


class PoolExhausted(CallTimeout):
    """Refused at once: too many earlier calls are still hung past their deadlines."""


MAX_ABANDONED = 256  # hung calls whose threads may still be running before a pool refuses new calls


class DaemonPool:
    def __init__(self, workers: int, name: str = "adarl-daemon", max_abandoned: int = MAX_ABANDONED) -> None:
        self.workers, self.name, self.max_abandoned = workers, name, max_abandoned
        self.timeouts = 0  # calls failed at their deadline, ever (their threads may still be running)
        self.abandoned = 0  # threads of calls failed at their deadline that are still running now
        self.refused = 0  # calls refused because `max_abandoned` threads were still hung
        self._cond = threading.Condition()
        # waiting calls: (future, fn, args, timeout_s); a call's deadline is set when it starts
        self._queued: list[tuple[Future, Callable[..., Any], tuple[Any, ...], float]] = []
        self._running: dict[Future, float] = {}  # a running call's future -> its deadline (time.monotonic())
        self._watcher: threading.Thread | None = None
        self._closed = False

    def submit(self, fn: Callable[..., Any], *args: Any, timeout_s: float) -> Future:
        """Run `fn(*args)` on a daemon thread; its future is done `timeout_s` after the call starts at the latest."""
        future: Future = Future()
        with self._cond:
            if self._closed:
                raise RuntimeError(f"{self.name}: the pool is shut down")
            if self.abandoned >= self.max_abandoned:
                self.refused += 1
                future.set_exception(PoolExhausted(
                    f"{self.name}: {self.abandoned} earlier calls are still hung past their deadlines "
                    f"(at most {self.max_abandoned}); refused without running"))
                return future
            self._queued.append((future, fn, args, timeout_s))
            self._dispatch()
        return future

    def shutdown(self) -> None:
        """Cancel the queued calls and take no more; running ones are left to finish (daemon threads)."""
        with self._cond:
            self._closed = True
            for future, *_ in self._queued:
                future.cancel()
            self._queued.clear()
            self._cond.notify_all()

    def _dispatch(self) -> None:
        """Start queued calls while slots are free, and wake the watcher (called holding the lock)."""
        while self._queued and len(self._running) < self.workers:
            future, fn, args, timeout_s = self._queued.pop(0)
            if not future.set_running_or_notify_cancel():
                continue
            self._running[future] = time.monotonic() + timeout_s
            threading.Thread(target=self._call, args=(future, fn, args), name=self.name, daemon=True).start()
        if self._watcher is None and (self._queued or self._running):
            self._watcher = threading.Thread(target=self._watch, name=f"{self.name}-deadlines", daemon=True)
            self._watcher.start()
        self._cond.notify_all()

    def _call(self, future: Future, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        try:
            value, error = fn(*args), None
        except BaseException as exc:  # noqa: BLE001 - user code may raise anything (SystemExit too): it goes to the caller
            value, error = None, exc
        with self._cond:
            if self._running.pop(future, None) is None:  # past its deadline: already failed, now returned
                self.abandoned -= 1
                return
            self._dispatch()
        if error is None:
            future.set_result(value)
        else:
            future.set_exception(error)

    def _watch(self) -> None:
        """Fail the running calls past their deadline and free their slots; ends when idle."""
        with self._cond:
            while self._queued or self._running:
                now = time.monotonic()
                late = [f for f, d in self._running.items() if d <= now]
                if late:
                    self.abandoned += len(late)  # their threads go on alone
                    self.timeouts += len(late)
                    for future in late:
                        del self._running[future]
                        future.set_exception(CallTimeout(f"{self.name}: no answer before the deadline"))
                    self._dispatch()
                    continue
                self._cond.wait(min(self._running.values()) - now if self._running else None)
            self._watcher = None
