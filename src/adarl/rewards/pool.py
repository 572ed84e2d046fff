"""A small process pool for running verifiers and users' reward functions in isolation.

Each worker runs under its own *supervisor*: a "spawn"ed process (never forked from the parent,
which holds torch threads) that makes itself a child subreaper (Linux ``PR_SET_CHILD_SUBREAPER``)
and forks the worker. Every process the worker starts (children, ``setsid`` children,
double-forked grandchildren, whatever their process group) stays a descendant of the supervisor
or is reparented to it, so when the worker dies, times out or the pool closes, the supervisor
SIGKILLs its whole tree before it exits. The supervisor runs no user code.

The parent never blocks on a worker: it reads length-prefixed frames from non-blocking pipes
against the job's deadline, refuses a frame over `max_result_bytes`, and unpickles results with
an unpickler that builds plain data only (numbers, strings, bytes, lists, tuples, dicts, sets),
so a worker cannot run code in the parent. Anything malformed is a crash of that worker. A
worker's stdout and stderr (user code's prints, its subprocesses' output) go to a pipe the parent
drains and keeps the tail of; a failed job's message quotes a short, escaped excerpt of it.

Jobs carry a *domain*: a worker only ever runs jobs of one domain, so state one reward function
leaves in its process (a patched builtin, a poisoned module) cannot reach another's scores.

A job that runs past `timeout_s` of wall time gets its worker and all its descendants killed and
replaced; a worker that dies mid-job (segfault, ``os._exit``, OOM kill) is replaced too. Neither
ever raises in the parent: every job comes back as ``(value, "ok")`` or
``(None, "error" | "timeout" | "crashed")``.

Functions sent to workers are pickled by reference, so they must live at module level in a module
the worker can import.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import logging
import multiprocessing as mp
import numbers
import os
import pickle
import select
import signal
import struct
import sys
import threading
import time
import types
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, Literal

log = logging.getLogger(__name__)

Status = Literal["ok", "error", "timeout", "crashed"]
Job = tuple[Callable[..., Any], tuple[Any, ...]]

_READY = -1  # job id of the "worker started" message
_MAX_REPR = 2000
_STARTUP_TIMEOUT_S = 120.0
MAX_TIMEOUT_S = 86_400.0  # any timeout: a day (the recipe's MAX_SECONDS; select() overflows far beyond)
MAX_WORKERS = 1024  # worker processes per domain (the recipe's bound on reward_workers)
MAX_MEMORY_MB = 1 << 30  # a worker's address-space cap: a PiB, past any machine
_HEADER = struct.Struct("!I")  # frame: 4-byte big-endian payload length, then a pickle
_OUTPUT_TAIL = 4096  # bytes of a worker's output kept (the most recent)
_EXCERPT_CHARS = 300  # characters of it quoted in a failed job's message
_READ_CHUNK = 1 << 16
_DRAIN_LIMIT = 1 << 22  # bytes of output read per check, so a flood cannot starve the loop
_KILL_GRACE_S = 3.0  # how long the parent waits for a supervisor to clean up before SIGKILLing it
_PR_SET_CHILD_SUBREAPER = 36


def _describe(exc: BaseException) -> str:
    """A bounded repr of an exception that cannot itself raise."""
    try:
        text = repr(exc)
    except Exception:  # noqa: BLE001 - a broken __repr__ must not kill the worker
        text = f"<{type(exc).__name__} with an unprintable repr>"
    return text if len(text) <= _MAX_REPR else text[:_MAX_REPR] + "...]"


def printable(text: str, limit: int = _MAX_REPR) -> str:
    """`text` on one line with control characters escaped (no terminal escapes), at most `limit` chars."""
    if len(text) > limit:
        text = text[:limit] + "..."
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


class _PlainUnpickler(pickle.Unpickler):
    """Builds plain data only: any class or function reference is refused, so loading runs no code."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refused {module}.{name}: only plain data may come back")


def loads_plain(blob: bytes) -> Any:
    """Unpickle numbers, strings, bytes, lists, tuples, dicts and sets; UnpicklingError otherwise."""
    return _PlainUnpickler(io.BytesIO(blob)).load()


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


# ---------------------------------------------------------------------- inside the worker


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _read_exact(fd: int, n: int) -> bytes | None:
    parts, left = [], n
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            return None
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


def _reply_blob(reply: tuple[int, str, Any], max_bytes: int) -> bytes:
    """The frame payload of a reply, or of an error reply when the parent would refuse it."""
    job_id = reply[0]
    try:
        blob = pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
        loads_plain(blob)
    except BaseException as exc:  # noqa: BLE001 - e.g. an unpicklable or non-plain result
        blob = pickle.dumps((job_id, "error", f"result could not be sent back: {_describe(exc)}"))
    if len(blob) > max_bytes:
        blob = pickle.dumps((job_id, "error", f"result too large: {len(blob)} bytes > {max_bytes}"))
    return blob


def _isolate_fds(keep: int, output: Connection) -> None:
    """stdin from /dev/null, stdout and stderr into `output`, every other fd but `keep` closed."""
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(output.fileno(), 1)
    os.dup2(output.fileno(), 2)
    output.close()
    os.close(null)
    os.closerange(3, keep)
    os.closerange(keep + 1, 1 << 16)
    with contextlib.suppress(Exception):  # the parent's resource tracker is not the worker's to use
        from multiprocessing import resource_tracker

        resource_tracker._resource_tracker._fd = None  # type: ignore[attr-defined]
        resource_tracker._resource_tracker._pid = None  # type: ignore[attr-defined]
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.reconfigure(line_buffering=True)  # type: ignore[union-attr]


def _worker_loop(conn: Connection, output: Connection, preload: tuple[str, ...],
                 memory_limit_bytes: int | None, max_result_bytes: int) -> None:
    """Receive ``(job_id, pickled (fn, args))`` frames, reply ``(job_id, status, value)`` frames."""
    with contextlib.suppress(OSError):
        os.setsid()  # its own session and group: no controlling terminal, so no /dev/tty to write to
    fd = conn.fileno()
    _isolate_fds(fd, output)
    for name in preload:
        module, _, warm_up = name.partition(":")
        with contextlib.suppress(Exception):  # a job needing the module will report the error itself
            imported = importlib.import_module(module)
            if warm_up:
                getattr(imported, warm_up)()
    _limit_memory(memory_limit_bytes)
    try:
        _write_all(fd, _frame(pickle.dumps((_READY, "ok", os.getpid()))))
        while True:
            header = _read_exact(fd, _HEADER.size)
            if header is None:
                return  # the parent is gone
            payload = _read_exact(fd, _HEADER.unpack(header)[0])
            if payload is None:
                return
            job_id, blob = pickle.loads(payload)  # from the parent: trusted
            try:
                fn, args = pickle.loads(blob)
                reply: tuple[int, str, Any] = (job_id, "ok", fn(*args))
            except BaseException as exc:  # noqa: BLE001 - SystemExit from user code is an error too
                reply = (job_id, "error", _describe(exc))
            _write_all(fd, _frame(_reply_blob(reply, max_result_bytes)))
    except OSError:
        return


def _frame(payload: bytes) -> bytes:
    return _HEADER.pack(len(payload)) + payload


# ---------------------------------------------------------------------- the supervisor


def _set_subreaper() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _children() -> list[int]:
    """Pids of this (single-threaded) process's children."""
    me = os.getpid()
    try:
        with open(f"/proc/{me}/task/{me}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        pass
    try:
        return [int(entry) for entry in os.listdir("/proc") if entry.isdigit() and _parent_of(int(entry)) == me]
    except OSError:
        return []


def _kill_tree(worker: int | None, limit_s: float = 10.0) -> None:
    """SIGKILL every descendant: orphans reparent to this subreaper, so repeat until none is left."""
    if worker is not None:  # not reaped yet, so its pid (and group id) cannot be anyone else's
        with contextlib.suppress(OSError):
            os.killpg(worker, signal.SIGKILL)  # its group too, for where no subreaper exists
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        kids = _children()
        for pid in kids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        try:
            while os.waitpid(-1, os.WNOHANG)[0] > 0:
                pass
        except ChildProcessError:
            return
        if not kids:
            time.sleep(0.001)


def _supervisor_main(conn: Connection, ctrl: Connection, output: Connection, preload: tuple[str, ...],
                     memory_limit_bytes: int | None, max_result_bytes: int) -> None:
    """Fork the worker, reap orphans, and on the worker's end or the parent's word kill the whole tree.

    Exits like the worker did (same code, or killed by the same signal), so the parent can tell.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's business
    _set_subreaper()
    worker = os.fork()
    if worker == 0:
        code = 0
        try:
            ctrl.close()
            _worker_loop(conn, output, preload, memory_limit_bytes, max_result_bytes)
        except BaseException:  # noqa: BLE001 - never return into the supervisor's code
            code = 1
        os._exit(code)
    conn.close()
    output.close()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGTERM, lambda *_: None)
    status: int | None = None
    while status is None:
        try:
            while True:
                pid, st = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    break
                if pid == worker:
                    status = st
        except ChildProcessError:
            break
        if status is not None:
            break
        ready, _, _ = select.select([ctrl.fileno(), wake_r], [], [])
        if ctrl.fileno() in ready:
            break  # the parent closed its end (a kill, close(), or the parent died)
        with contextlib.suppress(OSError):
            if signal.SIGTERM in os.read(wake_r, 4096):
                break
    _kill_tree(worker if status is None else None)
    if status is not None and os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        with contextlib.suppress(Exception):  # SIGKILL and SIGSTOP have no handler to reset
            signal.signal(sig, signal.SIG_DFL)
        with contextlib.suppress(Exception):
            os.kill(os.getpid(), sig)
    os._exit(os.WEXITSTATUS(status) if status is not None and os.WIFEXITED(status) else 1)


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


# ---------------------------------------------------------------------- the parent's side


@dataclass(eq=False)
class _Worker:
    process: Any  # the supervisor, a multiprocessing SpawnProcess
    conn: Connection  # parent's end of the job socket (its fd is non-blocking)
    ctrl: Connection  # closing it tells the supervisor to kill the worker's tree and exit
    out: Connection  # read end of the worker's stdout and stderr
    domain: str
    started: float
    pid: int | None = None  # the worker's own pid, from its ready message
    ready: bool = False
    job: int | None = None  # index into the current run's jobs
    sent_id: int = 0  # wire id of that job
    deadline: float = 0.0
    inbox: bytearray = field(default_factory=bytearray)
    outbox: bytes = b""
    output: bytearray = field(default_factory=bytearray)
    output_bytes: int = 0  # output seen since the current job was sent
    output_open: bool = True

    def read_output(self) -> None:
        """Drain the worker's output pipe (bounded per call), keeping the last `_OUTPUT_TAIL` bytes."""
        if not self.output_open:
            return
        taken = 0
        while taken < _DRAIN_LIMIT:
            try:
                chunk = os.read(self.out.fileno(), _READ_CHUNK)
            except BlockingIOError:
                return
            except OSError:
                chunk = b""
            if not chunk:
                self.output_open = False
                return
            taken += len(chunk)
            self.output_bytes += len(chunk)
            self.output += chunk
            del self.output[:-_OUTPUT_TAIL]

    def excerpt(self) -> str:
        """The end of what the job printed, escaped and labelled (empty when it printed nothing)."""
        self.read_output()
        if not self.output_bytes:
            return ""
        text = bytes(self.output).decode("utf-8", "replace")[-_EXCERPT_CHARS:]
        return (f"; the function printed (last {len(text)} chars of {self.output_bytes} bytes): "
                f"{printable(text, _EXCERPT_CHARS)!r}")

    def kill(self) -> None:
        """Have the supervisor kill the worker's whole tree; SIGKILL the supervisor if it does not."""
        with contextlib.suppress(Exception):
            self.ctrl.close()
        try:
            self.process.join(_KILL_GRACE_S)
        except ValueError:  # already closed
            return
        if self.process.is_alive():
            # A stuck (e.g. stopped) supervisor has not reaped the worker, so its pid is still its own
            # (the pid came from the worker: check it is the supervisor's child before killing it).
            if self.pid is not None and _parent_of(self.pid) == self.process.pid:
                with contextlib.suppress(OSError):
                    os.killpg(self.pid, signal.SIGKILL)
                with contextlib.suppress(OSError):
                    os.kill(self.pid, signal.SIGKILL)
            with contextlib.suppress(Exception):
                self.process.kill()
            self.process.join(5)
        self.release()

    def release(self) -> None:
        for handle in (self.conn, self.ctrl, self.out):
            with contextlib.suppress(Exception):
                handle.close()
        if not self.process.is_alive():
            with contextlib.suppress(Exception):
                self.process.close()


class _Garbage(Exception):
    """A worker sent something that is not a well-formed reply."""


@dataclass
class _Run:
    """Book-keeping of one `run` call."""

    jobs: Sequence[Job]
    domains: Sequence[str]
    results: list[tuple[Any, Status]]
    pending: dict[str, deque[int]] = field(default_factory=dict)  # job indices waiting, per domain


def check_workers(workers: object, name: str = "workers") -> int:
    """``workers`` as an int in 1..MAX_WORKERS, else a ValueError naming ``name`` and the range."""
    if isinstance(workers, bool) or not isinstance(workers, numbers.Integral) or not 1 <= workers <= MAX_WORKERS:
        raise ValueError(f"{name} must be an integer from 1 to {MAX_WORKERS}, got {workers!r}")
    return int(workers)


def check_timeout(timeout_s: object, name: str = "timeout_s") -> float:
    """``timeout_s`` as a float in (0, MAX_TIMEOUT_S] seconds, else a ValueError naming ``name`` and the range."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, numbers.Real) \
            or not 0 < float(timeout_s) <= MAX_TIMEOUT_S:  # NaN fails the comparison too
        raise ValueError(f"{name} must be a number of seconds > 0 and <= {MAX_TIMEOUT_S:g} (a day), "
                         f"got {timeout_s!r}")
    return float(timeout_s)


def check_memory_limit(memory_limit_mb: object, name: str = "memory_limit_mb") -> int | None:
    """``memory_limit_mb`` as None (no cap) or a positive int of MiB, else a ValueError naming ``name``."""
    if memory_limit_mb is None:
        return None
    if isinstance(memory_limit_mb, bool) or not isinstance(memory_limit_mb, numbers.Integral) \
            or not 1 <= memory_limit_mb <= MAX_MEMORY_MB:
        raise ValueError(f"{name} must be None (no cap) or an integer of MiB from 1 to {MAX_MEMORY_MB}, "
                         f"got {memory_limit_mb!r}")
    return int(memory_limit_mb)


class WorkerPool:
    """A lazily started pool of supervised worker processes with per-job wall-clock timeouts.

    Args:
        workers: worker processes per domain (started on first use, reused across calls).
        timeout_s: wall-clock seconds a job may run before its worker (and all it started) is killed.
        memory_limit_mb: address space (MiB) each worker may add after start-up (RLIMIT_AS, Linux);
            a job that allocates beyond it fails with MemoryError. None disables the cap.
        preload: modules each worker of the default domain ``""`` imports before accepting jobs
            (not counted in timeouts); ``module:function`` also calls ``function()`` there, to pay a
            library's first-call costs (math-verify's grammar) before any job's timeout starts.
        domains: preload modules of other domains; a job's domain (see `run`) picks the workers
            that may run it, and a worker runs jobs of one domain only.
        import_main: re-import the parent's ``__main__`` in workers (the multiprocessing default);
            off by default, so functions must live in importable modules, not in ``__main__``.
        max_result_bytes: largest reply (pickled) a worker may send; a larger one is an error.
        startup_timeout_s: seconds a worker may take to start (its preload imports included); past
            it, the call's jobs of that domain crash.
    """

    def __init__(self, workers: int = 2, timeout_s: float = 10.0, *, memory_limit_mb: int | None = 4096,
                 preload: Sequence[str] = (), domains: Mapping[str, Sequence[str]] | None = None,
                 import_main: bool = False, max_result_bytes: int = 1 << 20,
                 startup_timeout_s: float = _STARTUP_TIMEOUT_S) -> None:
        self.workers = check_workers(workers)
        self.timeout_s = check_timeout(timeout_s)
        self.memory_limit_mb = check_memory_limit(memory_limit_mb)
        self.preload = tuple(preload)
        self.domains = {name: tuple(mods) for name, mods in (domains or {}).items()}
        self.import_main = import_main
        self.max_result_bytes = int(max_result_bytes)
        self.startup_timeout_s = check_timeout(startup_timeout_s, "startup_timeout_s")
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

    def run(self, jobs: Sequence[Job], domains: Sequence[str] | None = None) -> list[tuple[Any, Status]]:
        """Run jobs ``(fn, args)`` (each its own function), job i in domain ``domains[i]``; results in order."""
        if domains is not None and len(domains) != len(jobs):
            raise ValueError(f"{len(domains)} domains for {len(jobs)} jobs")
        with self._lock:
            if self._closed:
                raise RuntimeError("WorkerPool is closed")
            self.errors = []
            state = _Run(jobs=jobs, domains=domains or [""] * len(jobs), results=[(None, "error")] * len(jobs))
            for idx, domain in enumerate(state.domains):
                state.pending.setdefault(domain, deque()).append(idx)
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
        """Stop every worker; no process a worker started outlives this call."""
        self._closed = True
        pool, self._pool = self._pool, []
        for w in pool:  # all supervisors clean up at once
            with contextlib.suppress(Exception):
                w.ctrl.close()
        for w in pool:
            with contextlib.suppress(Exception):
                w.kill()

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # at interpreter exit module globals (contextlib among them) may already be None: no `with` here
        try:  # noqa: SIM105
            if not getattr(self, "_closed", True):
                self.close()
        except Exception:
            pass

    @property
    def pids(self) -> list[int]:
        """Process ids of the live workers (of its supervisor for a worker that has not said it is ready)."""
        return [w.pid if w.pid is not None else w.process.pid for w in self._pool]

    # ------------------------------------------------------------------ internals

    def _start_worker(self, domain: str) -> _Worker:
        parent, child = self._ctx.Pipe(duplex=True)
        ctrl_r, ctrl_w = self._ctx.Pipe(duplex=False)
        out_r, out_w = self._ctx.Pipe(duplex=False)
        limit = None if self.memory_limit_mb is None else int(self.memory_limit_mb) << 20
        preload = self.domains.get(domain, ()) if domain else self.preload
        proc = self._ctx.Process(target=_supervisor_main,
                                 args=(child, ctrl_r, out_w, preload, limit, self.max_result_bytes),
                                 name="adarl-reward-worker", daemon=True)
        with contextlib.nullcontext() if self.import_main else _hide_main():
            proc.start()
        for end in (child, ctrl_r, out_w):
            end.close()
        os.set_blocking(parent.fileno(), False)
        os.set_blocking(out_r.fileno(), False)
        worker = _Worker(process=proc, conn=parent, ctrl=ctrl_w, out=out_r, domain=domain,
                         started=time.monotonic())
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
            self.errors.append((idx, printable(message or status) + w.excerpt()))

    def _dispatch(self, state: _Run) -> None:
        """Hand pending jobs to ready idle workers of their domain; start workers that are missing."""
        for domain, queue in state.pending.items():
            if not queue:
                continue
            mine = [w for w in self._pool if w.domain == domain]
            idle = [w for w in mine if w.ready and w.job is None]
            starting = sum(1 for w in mine if not w.ready)
            for _ in range(max(0, min(self.workers - len(mine), len(queue) - len(idle) - starting))):
                self._start_worker(domain)
            while queue and idle:
                w = idle.pop()
                if not w.process.is_alive() or _readable(w.conn.fileno()):
                    self._retire(w)  # dead, or sent something unasked while idle: not to be trusted
                    continue
                idx = queue.popleft()
                fn, args = state.jobs[idx]
                try:
                    blob = pickle.dumps((fn, args), protocol=pickle.HIGHEST_PROTOCOL)
                except Exception as exc:  # noqa: BLE001 - e.g. a lambda or a local function
                    state.results[idx] = (None, "error")
                    self.errors.append((idx, f"job could not be pickled: {_describe(exc)}"))
                    idle.append(w)
                    continue
                self._next_id += 1
                w.read_output()  # what it printed before this job is not this job's
                w.output.clear()
                w.output_bytes = 0
                w.outbox = _frame(pickle.dumps((self._next_id, blob), protocol=pickle.HIGHEST_PROTOCOL))
                try:
                    self._send(w)
                except OSError:
                    # Died while idle: not the job's fault, so it goes back in the queue.
                    queue.appendleft(idx)
                    self._retire(w)
                    continue
                w.job, w.sent_id = idx, self._next_id
                w.deadline = time.monotonic() + self.timeout_s

    @staticmethod
    def _send(w: _Worker) -> None:
        """Write as much of the worker's outbox as its socket takes now, never blocking."""
        while w.outbox:
            try:
                n = os.write(w.conn.fileno(), w.outbox)
            except BlockingIOError:
                return
            w.outbox = w.outbox[n:]

    def _run(self, state: _Run) -> None:
        while any(state.pending.values()) or any(w.job is not None for w in self._pool):
            self._dispatch(state)
            watched = [w for w in self._pool if w.job is not None or not w.ready]
            if not watched:
                continue
            deadlines = [w.deadline if w.ready else w.started + self.startup_timeout_s for w in watched]
            poller = select.poll()
            for w in watched:
                poller.register(w.conn.fileno(), select.POLLIN | (select.POLLOUT if w.outbox else 0))
                poller.register(w.process.sentinel, select.POLLIN)
                if w.output_open:
                    poller.register(w.out.fileno(), select.POLLIN)
            timeout_ms = max(0.0, min(deadlines) - time.monotonic()) * 1000
            with contextlib.suppress(InterruptedError):
                poller.poll(min(timeout_ms + 1, 2**31 - 1))
            for w in watched:
                self._check(state, w)

    def _check(self, state: _Run, w: _Worker) -> None:
        """Collect whatever happened to a watched worker: a reply, garbage, a death, or a timeout."""
        w.read_output()
        try:
            if w.outbox:
                self._send(w)
            eof = self._receive(w)
            while True:
                message = self._next_message(w)
                if message is None:
                    break
                job_id, status, value = message
                if job_id == _READY and not w.ready and type(value) is int and _parent_of(value) in (
                        w.process.pid, None):
                    w.ready, w.pid = True, value
                elif w.ready and w.job is not None and job_id == w.sent_id and not w.outbox:
                    if status == "ok":
                        self._finish(state, w, "ok", value)
                    else:
                        self._finish(state, w, "error", message=value if isinstance(value, str) else "error")
                else:
                    raise _Garbage(f"unexpected message for job {job_id!r}")
        except _Garbage as exc:
            self._lost(state, w, f"worker sent garbage ({exc})")
            return
        except OSError as exc:  # e.g. the socket was reset
            eof = True
            log.debug("reward worker socket: %s", exc)
        if eof or not w.process.is_alive():
            if w.job is None and w.ready:  # died while idle
                self._retire(w)
                return
            w.process.join(1.0)
            self._lost(state, w, _exit_reason(w.process.exitcode))
            return
        now = time.monotonic()
        if w.ready and w.job is not None and now >= w.deadline:
            if w.inbox:  # a frame begun and never finished: not a slow job, a broken pipe
                self._lost(state, w, f"worker sent an incomplete reply ({len(w.inbox)} bytes) by the deadline")
                return
            self._finish(state, w, "timeout", message=f"timed out after {self.timeout_s:g} s")
            self._retire(w)
        elif not w.ready and now >= w.started + self.startup_timeout_s:
            self._lost(state, w, f"worker did not start within {self.startup_timeout_s:g} s")

    def _receive(self, w: _Worker) -> bool:
        """Read what the worker has sent (at most one frame's worth beyond the limit); True at EOF."""
        cap = self.max_result_bytes + 2 * _HEADER.size
        while len(w.inbox) <= cap:
            try:
                chunk = os.read(w.conn.fileno(), min(_READ_CHUNK, cap + 1 - len(w.inbox)))
            except BlockingIOError:
                return False
            if not chunk:
                return True
            w.inbox += chunk
        return False

    def _next_message(self, w: _Worker) -> tuple[int, str, Any] | None:
        """The next complete frame in the inbox, checked; None if incomplete; _Garbage if malformed."""
        if len(w.inbox) < _HEADER.size:
            return None
        (size,) = _HEADER.unpack_from(w.inbox)
        if size > self.max_result_bytes:
            raise _Garbage(f"a frame of {size} bytes announced, more than {self.max_result_bytes}")
        if len(w.inbox) < _HEADER.size + size:
            return None
        payload = bytes(w.inbox[_HEADER.size:_HEADER.size + size])
        del w.inbox[:_HEADER.size + size]
        try:
            message = loads_plain(payload)
        except Exception as exc:  # noqa: BLE001 - any unpickling failure is garbage
            raise _Garbage(f"unreadable frame: {_describe(exc)}") from None
        if (not isinstance(message, tuple) or len(message) != 3 or type(message[0]) is not int
                or message[1] not in ("ok", "error")):
            raise _Garbage("a frame that is not a reply")
        return message

    def _lost(self, state: _Run, w: _Worker, reason: str) -> None:
        """A worker died or broke: its job crashed; a worker that never started fails its domain's jobs."""
        if w.job is not None:
            self._finish(state, w, "crashed", message=reason)
        elif not w.ready:
            # A worker that cannot start would be restarted forever: give up on this call's jobs of it.
            mine = state.pending.pop(w.domain, deque())
            if mine:
                log.error("reward worker failed to start (%s); %d jobs marked crashed",
                          printable(reason + w.excerpt()), len(mine))
            for idx in mine:
                state.results[idx] = (None, "crashed")
                self.errors.append((idx, f"worker failed to start: {printable(reason)}" + w.excerpt()))
        self._retire(w)


def check_in_worker(fn: Callable[..., Any], args: tuple, timeout_s: float, where: str) -> Any:
    """`fn(*args)` in a throwaway supervised worker (no memory cap) with a deadline, never in this
    process: its value, or one ValueError beginning with `where` if it timed out, crashed or raised.
    What validates user code before anything loads (a reward function's module, an environment's)."""
    with WorkerPool(1, timeout_s, memory_limit_mb=None) as pool:
        [(value, status)] = pool.run([(fn, args)])
        message = pool.errors[0][1] if pool.errors else ""
    if status == "timeout":
        raise ValueError(f"{where} timed out after {timeout_s:g} s")
    if status == "crashed":
        raise ValueError(f"{where} {message.removeprefix('worker ')}")
    if status == "error":
        raise ValueError(f"{where} raised {message}")
    return value


def _parent_of(pid: int) -> int | None:
    """The parent pid of `pid` (None where /proc cannot tell, -1 if there is no such process)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rpartition(")")[2].split()[1])
    except FileNotFoundError:
        return -1 if os.path.isdir("/proc/self") else None
    except (OSError, ValueError, IndexError):
        return None


def _readable(fd: int) -> bool:
    try:
        return bool(select.select([fd], [], [], 0)[0])
    except (OSError, ValueError):
        return True


def _exit_reason(code: int | None) -> str:
    """"worker exited with code N" or "worker was killed by signal SIGX" for a supervisor's exit code."""
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            return f"worker was killed by signal {signal.Signals(-code).name} (exit code {code})"
    return f"worker exited with code {code}"
