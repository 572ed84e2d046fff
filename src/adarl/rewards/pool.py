"""A small process pool for running verifiers in isolation.

Each worker is a "spawn"ed process (never forked: the parent holds torch threads) talking to the
parent over a Pipe. A job that runs past `timeout_s` of wall time gets its worker SIGKILLed (with
its whole process group) and replaced; a worker that dies mid-job (segfault, ``os._exit``, OOM
kill) is replaced too. Neither ever raises in the parent: every job comes back as
``(value, "ok")`` or ``(None, "error" | "timeout" | "crashed")``.

Functions sent to workers are pickled by reference, so they must live at module level in a module
the worker can import.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import multiprocessing as mp
import os
import pickle
import signal
import sys
import threading
import time
import types
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any, Literal

log = logging.getLogger(__name__)

Status = Literal["ok", "error", "timeout", "crashed"]
Job = tuple[Callable[..., Any], tuple[Any, ...]]

_READY = -1  # job id of the "worker started" message
_MAX_REPR = 2000
_STARTUP_TIMEOUT_S = 120.0


def _describe(exc: BaseException) -> str:
    """A bounded repr of an exception that cannot itself raise."""
    try:
        text = repr(exc)
    except Exception:  # noqa: BLE001 - a broken __repr__ must not kill the worker
        text = f"<{type(exc).__name__} with an unprintable repr>"
    return text if len(text) <= _MAX_REPR else text[:_MAX_REPR] + "...]"


def _address_space_bytes() -> int:
    """This process's current virtual memory size (0 where /proc is unavailable)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _limit_memory(extra_bytes: int | None) -> None:
    """Cap RLIMIT_AS at the current size plus `extra_bytes`, so a memory bomb raises MemoryError."""
    if not extra_bytes or not sys.platform.startswith("linux"):
        return
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        limit = _address_space_bytes() + extra_bytes
        if hard != resource.RLIM_INFINITY:
            limit = min(limit, hard)
        if soft == resource.RLIM_INFINITY or limit < soft:
            resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    except (ImportError, OSError, ValueError):
        pass


def _worker_main(conn: Connection, preload: tuple[str, ...], memory_limit_bytes: int | None) -> None:
    """Worker loop: receive ``(job_id, pickled (fn, args))``, reply ``(job_id, status, value)``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's business
    with contextlib.suppress(OSError):
        os.setpgrp()  # own process group: a timeout kill also takes the job's subprocesses
    for name in preload:
        with contextlib.suppress(Exception):  # a job needing the module will report the error itself
            importlib.import_module(name)
    _limit_memory(memory_limit_bytes)
    try:
        conn.send((_READY, "ok", os.getpid()))
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                return  # the parent is gone
            if msg is None:
                return
            job_id, blob = msg
            try:
                fn, args = pickle.loads(blob)
                reply: tuple[int, str, Any] = (job_id, "ok", fn(*args))
            except BaseException as exc:  # noqa: BLE001 - SystemExit from user code is an error too
                reply = (job_id, "error", _describe(exc))
            try:
                conn.send(reply)
            except (BrokenPipeError, EOFError):
                return
            except BaseException as exc:  # noqa: BLE001 - e.g. an unpicklable result
                conn.send((job_id, "error", f"result could not be sent back: {_describe(exc)}"))
    except (BrokenPipeError, EOFError, OSError):
        return


@contextlib.contextmanager
def _hide_main() -> Iterator[None]:
    """Spawn without re-importing the parent's ``__main__`` in the child.

    A spawned child normally re-runs the parent's main script (or module) as ``__mp_main__``;
    for a console script that imports the whole trainer (torch included) in every worker.
    """
    main = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        if main is not None:
            sys.modules["__main__"] = main
        else:
            del sys.modules["__main__"]


@dataclass(eq=False)
class _Worker:
    process: Any  # multiprocessing.context.SpawnProcess
    conn: Connection
    started: float
    ready: bool = False
    job: int | None = None  # index into the current run's jobs
    sent_id: int = 0  # wire id of that job
    deadline: float = 0.0

    def kill(self) -> None:
        """SIGKILL the worker (and its process group), reap it, release its handles."""
        try:
            alive, pid = self.process.is_alive(), self.process.pid
        except ValueError:  # already closed
            return
        if alive and pid is not None:
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                with contextlib.suppress(Exception):
                    self.process.kill()
        self.process.join(5)
        self.release()

    def release(self) -> None:
        with contextlib.suppress(Exception):
            self.conn.close()
        if not self.process.is_alive():
            with contextlib.suppress(Exception):
                self.process.close()


@dataclass
class _Run:
    """Book-keeping of one `run` call."""

    jobs: Sequence[Job]
    results: list[tuple[Any, Status]]
    pending: deque[int] = field(default_factory=deque)


class WorkerPool:
    """A lazily started pool of spawned worker processes with per-job wall-clock timeouts.

    Args:
        workers: number of worker processes (started on first use, reused across calls).
        timeout_s: wall-clock seconds a job may run before its worker is killed.
        memory_limit_mb: address space (MiB) each worker may add after start-up (RLIMIT_AS, Linux);
            a job that allocates beyond it fails with MemoryError. None disables the cap.
        preload: modules each worker imports before accepting jobs (not counted in timeouts).
        import_main: re-import the parent's ``__main__`` in workers (the multiprocessing default);
            off by default, so functions must live in importable modules, not in ``__main__``.
    """

    def __init__(self, workers: int = 2, timeout_s: float = 10.0, *, memory_limit_mb: int | None = 4096,
                 preload: Sequence[str] = (), import_main: bool = False) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.workers = int(workers)
        self.timeout_s = float(timeout_s)
        self.memory_limit_mb = memory_limit_mb
        self.preload = tuple(preload)
        self.import_main = import_main
        self.errors: list[tuple[int, str]] = []  # (job index, message) of the last call's failures
        self._ctx = mp.get_context("spawn")
        self._pool: list[_Worker] = []
        self._lock = threading.Lock()
        self._next_id = 0
        self._closed = False

    # ------------------------------------------------------------------ public API

    def map(self, fn: Callable[..., Any], arg_tuples: Iterable[tuple[Any, ...]]) -> list[tuple[Any, Status]]:
        """Run ``fn(*args)`` for each args tuple; results in input order as ``(value | None, status)``."""
        return self.run([(fn, tuple(args)) for args in arg_tuples])

    def run(self, jobs: Sequence[Job]) -> list[tuple[Any, Status]]:
        """Run jobs ``(fn, args)`` (each its own function); results in input order."""
        with self._lock:
            if self._closed:
                raise RuntimeError("WorkerPool is closed")
            self.errors = []
            state = _Run(jobs=jobs, results=[(None, "error")] * len(jobs), pending=deque(range(len(jobs))))
            try:
                self._run(state)
            except BaseException:
                # An interrupted call leaves workers mid-job: kill them rather than reuse them.
                for w in self._pool:
                    if w.job is not None:
                        w.kill()
                self._pool = [w for w in self._pool if w.job is None]
                raise
            return state.results

    def close(self) -> None:
        """Stop every worker; no child process outlives this call."""
        self._closed = True
        pool, self._pool = self._pool, []
        for w in pool:
            with contextlib.suppress(Exception):
                w.conn.send(None)
        end = time.monotonic() + 1.0
        for w in pool:
            with contextlib.suppress(Exception):
                w.process.join(max(0.0, end - time.monotonic()))
            with contextlib.suppress(Exception):
                w.kill()

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            if not getattr(self, "_closed", True):
                self.close()

    @property
    def pids(self) -> list[int]:
        """Process ids of the live workers."""
        return [w.process.pid for w in self._pool if w.process.pid is not None]

    # ------------------------------------------------------------------ internals

    def _start_worker(self) -> _Worker:
        parent, child = self._ctx.Pipe(duplex=True)
        limit = None if self.memory_limit_mb is None else int(self.memory_limit_mb) << 20
        proc = self._ctx.Process(target=_worker_main, args=(child, self.preload, limit),
                                 name="adarl-reward-worker", daemon=True)
        with contextlib.nullcontext() if self.import_main else _hide_main():
            proc.start()
        child.close()
        worker = _Worker(process=proc, conn=parent, started=time.monotonic())
        self._pool.append(worker)
        return worker

    def _retire(self, w: _Worker) -> None:
        w.kill()
        if w in self._pool:
            self._pool.remove(w)

    def _finish(self, state: _Run, w: _Worker, status: Status, value: Any = None, message: str = "") -> None:
        assert w.job is not None
        idx, w.job = w.job, None
        state.results[idx] = (value if status == "ok" else None, status)
        if status != "ok":
            self.errors.append((idx, message or status))

    def _dispatch(self, state: _Run) -> None:
        """Hand pending jobs to ready idle workers; start workers that are missing."""
        # Replace dead idle workers, then start as many as the pending jobs can use.
        for w in list(self._pool):
            if w.job is None and not w.process.is_alive():
                self._retire(w)
        starting = sum(1 for w in self._pool if not w.ready)
        idle = [w for w in self._pool if w.ready and w.job is None]
        want = min(self.workers - len(self._pool), len(state.pending) - len(idle) - starting)
        for _ in range(max(0, want)):
            self._start_worker()
        for w in idle:
            if not state.pending:
                break
            idx = state.pending.popleft()
            fn, args = state.jobs[idx]
            try:
                blob = pickle.dumps((fn, args), protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as exc:  # noqa: BLE001 - e.g. a lambda or a local function
                state.results[idx] = (None, "error")
                self.errors.append((idx, f"job could not be pickled: {_describe(exc)}"))
                continue
            self._next_id += 1
            w.job = idx
            try:
                w.conn.send((self._next_id, blob))
            except (BrokenPipeError, EOFError, OSError):
                # Died while idle: not the job's fault, so it goes back in the queue.
                w.job = None
                state.pending.appendleft(idx)
                self._retire(w)
                continue
            w.deadline = time.monotonic() + self.timeout_s
            w.sent_id = self._next_id

    def _run(self, state: _Run) -> None:
        while state.pending or any(w.job is not None for w in self._pool):
            self._dispatch(state)
            watched = [w for w in self._pool if w.job is not None or not w.ready]
            if not watched:
                continue
            now = time.monotonic()
            deadlines = [w.deadline if w.ready else w.started + _STARTUP_TIMEOUT_S for w in watched]
            handles: list[Any] = [w.conn for w in watched] + [w.process.sentinel for w in watched]
            wait(handles, timeout=max(0.0, min(deadlines) - now))
            for w in watched:
                self._check(state, w)

    def _check(self, state: _Run, w: _Worker) -> None:
        """Collect whatever happened to a watched worker: a reply, a death, or a timeout."""
        try:
            has_msg = w.conn.poll()
        except (EOFError, OSError):
            has_msg = False
        if has_msg:
            try:
                job_id, status, value = w.conn.recv()
            except (EOFError, OSError):
                w.process.join(0.5)
                self._lost(state, w, f"worker exited with code {w.process.exitcode}")
                return
            except Exception as exc:  # noqa: BLE001 - a result the parent cannot unpickle
                if w.job is not None:
                    self._finish(state, w, "error", message=f"result could not be read: {_describe(exc)}")
                return
            if job_id == _READY:
                w.ready = True
            elif w.job is not None and job_id == w.sent_id:
                self._finish(state, w, "ok" if status == "ok" else "error", value,
                             message="" if status == "ok" else str(value))
            return
        if not w.process.is_alive():
            self._lost(state, w, f"worker exited with code {w.process.exitcode}")
            return
        now = time.monotonic()
        if w.ready and w.job is not None and now >= w.deadline:
            self._finish(state, w, "timeout", message=f"timed out after {self.timeout_s:g} s")
            self._retire(w)
        elif not w.ready and now >= w.started + _STARTUP_TIMEOUT_S:
            self._lost(state, w, f"worker did not start within {_STARTUP_TIMEOUT_S:g} s")

    def _lost(self, state: _Run, w: _Worker, reason: str) -> None:
        """A worker died: its job crashed; a worker that never started fails the pending jobs."""
        if w.job is not None:
            self._finish(state, w, "crashed", message=reason)
        elif not w.ready:
            # A worker that cannot start would be restarted forever: give up on this call.
            if state.pending:
                log.error("reward worker failed to start (%s); %d jobs marked crashed",
                          reason, len(state.pending))
            while state.pending:
                idx = state.pending.popleft()
                state.results[idx] = (None, "crashed")
                self.errors.append((idx, f"worker failed to start: {reason}"))
        self._retire(w)
