"""Run untrusted (model-generated) Python in a separate, locked-down process.

`run_code` starts a small launcher (launcher.py, run as a script with ``python -I -S -B``), which
builds the sandbox and then runs the program. On Linux, as root (or as a user allowed to create
user namespaces), the layers are:

- **namespaces** (``unshare``): a new network namespace (no interface is up, not even loopback:
  every connect fails at once with "Network is unreachable"), a new PID namespace (the program
  sees only its own processes; when the program exits, or the sandbox is killed, the kernel kills
  every process left in it, including ones that called ``setsid`` or double-forked), new mount,
  IPC (System V / POSIX message queues), UTS and cgroup namespaces (``/proc/self/cgroup`` reads
  ``/``, not the host's cgroup path).
- **a filesystem jail**: a new root (``pivot_root``) holding read-only, nosuid binds of ``/usr``,
  ``/etc``, the interpreter's prefix and minimal ``/dev`` nodes (null, zero, full, random,
  urandom), a fresh ``/proc`` for the PID namespace, and a private, size-capped ``tmpfs`` at
  ``/tmp`` that is the program's working and home directory. The repository, ``/root``,
  ``/home``, the host's ``/tmp`` and ``/dev/shm``, ``/sys`` and ``/run`` are not there at all.
- **a private user id**: as root the program runs as an unprivileged uid of its own
  (``UID_BASE`` + the launcher's pid, no supplementary groups, ``no_new_privs``), so it holds no
  capabilities, cannot signal or ptrace anything outside, and the per-user process limit
  (``RLIMIT_NPROC``, which root ignores) applies to this one sandbox only.
- **rlimits**: CPU seconds (SIGXCPU, then SIGKILL), address space, file size, processes,
  open files, no core dumps, no locked memory; soft = hard, so the program cannot raise them.
- **a system-call filter** (seccomp-BPF, compiled once per caller process by libseccomp through
  `pyseccomp`, loaded by the launcher just before ``execve`` and inherited by every child):
  refuses the kernel keyrings, new namespaces and mounts (``unshare``, ``setns``, ``clone`` with a
  CLONE_NEW* flag; ``clone3`` answers ENOSYS), memory that ``RLIMIT_AS`` does not count
  (``memfd_create``, System V shared memory, semaphores and message queues, POSIX message
  queues), ``ptrace`` and ``process_vm_readv``/``writev``, sockets of any family but unix, IPv4
  and IPv6 (netlink, vsock, packet: EAFNOSUPPORT), growing pipe and socket buffers past their
  defaults, and ``bpf``, ``perf_event_open``, ``userfaultfd``, ``io_uring``, module and kexec
  calls. See `_DENIED_SYSCALLS`.
- **a scrubbed environment** (PATH, LANG, HOME=TMPDIR=the working dir; nothing of the parent's),
  ``python -I -S -B`` (no user site, no ``PYTHON*`` variables, no bytecode written), no inherited
  file descriptors besides stdin/stdout/stderr. The launcher's configuration (host paths, the
  caller's pid) and the program's source reach it in a memfd, never on a command line; the
  sandbox's init is not dumpable and ``/proc`` is mounted with ``hidepid=2``, so the program
  sees only its own processes in ``/proc``.
- **a hard wall-clock kill**: past ``timeout_s`` the launcher's process group is SIGKILLed; the
  launcher and the namespace's init die with ``PR_SET_PDEATHSIG`` chains, so killing the caller
  (e.g. a reward worker) kills the sandbox too.

Where a layer is unavailable (not Linux, no namespaces, not root, no libseccomp) the sandbox
degrades to what remains, never silently: `sandbox_capabilities` reports which layers are
active, and a warning is logged once. Without namespaces, a process the program detaches from
its group can survive it (as root it is still killed by uid), the network is reachable, and the
program can write wherever its uid may (as root, what its uid left in the host's ``/dev/shm``
and temporary directory is deleted afterwards).

What it does NOT protect against (see README, "Security and isolation"): kernel exploits
through the system calls the filter allows (the kernel is the trust boundary), reading
world-readable files under ``/usr`` and ``/etc``, CPU contention, and memory beyond a per-process
bound (no cgroup: ``max_procs`` x (``memory_mb`` + the kernel's buffers of up to
``max_open_files`` pipes and sockets at their default sizes) + the tmpfs), and side channels.

This module imports only the standard library: the launcher runs it without the package.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from adarl.rewards.sandbox.launcher import _ENV, _TOP_LINKS, UID_BASE, _proc_uids
from adarl.rewards.sandbox.seccomp import _syscall_filter, filter_error

__all__ = ["SandboxResult", "run_code", "sandbox_capabilities", "UID_BASE"]

Status = Literal["ok", "error", "timeout", "killed", "sandbox_error"]
_LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "launcher.py")
_MAX_OUTPUT = 64 * 1024



@dataclass(frozen=True)
class SandboxResult:
    """How a sandboxed program ended.

    ``status``: "ok" (exit code 0), "error" (another exit code), "timeout" (wall clock or CPU
    limit), "killed" (ended by another signal: a segfault, a SIGKILL), "sandbox_error" (the
    sandbox itself could not be set up; the program did not run).
    """

    status: Status
    returncode: int | None  # exit code, or -signal; None when the program never ran or was wall-killed
    stdout: str
    stderr: str
    duration: float  # wall seconds
    cpu_s: float | None = None
    reason: str = ""  # e.g. "wall-clock limit 5 s", "CPU limit 5 s", "signal SIGSEGV", a setup error
    truncated: bool = False  # stdout or stderr was longer than max_output_bytes
    layers: dict[str, bool] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == "ok"


# ====================================================================== caller side


def _interpreter() -> tuple[str, str]:
    """The real (non-venv) interpreter and its prefix: what runs inside the jail."""
    exe = getattr(sys, "_base_executable", None) or sys.executable
    exe = os.path.realpath(exe)
    return exe, os.path.realpath(sys.base_prefix)


def _world_executable(path: str) -> bool:
    """Whether any user may run `path` (every parent directory searchable, the file executable)."""
    import stat

    try:
        if not os.stat(path).st_mode & stat.S_IXOTH:
            return False
        parent = os.path.dirname(path)
        while parent not in ("", "/"):
            if not os.stat(parent).st_mode & stat.S_IXOTH:
                return False
            parent = os.path.dirname(parent)
    except OSError:
        return False
    return True


def _fallback_interpreter(python: str) -> str:
    """Without a jail the program's private uid runs the host's files: a world-executable python."""
    if _world_executable(python):
        return python
    version = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    for candidate in (f"/usr/bin/{version}", f"/usr/local/bin/{version}", "/usr/bin/python3", "/usr/local/bin/python3"):
        if _world_executable(candidate):
            return candidate
    return python


def _ro_binds(python: str, prefix: str) -> list[str]:
    """Host directories bound read-only into the jail (nested ones dropped)."""
    paths = ["/usr", "/etc", prefix, os.path.dirname(os.path.dirname(python))]
    paths += [f"/{d}" for d in _TOP_LINKS if os.path.isdir(f"/{d}") and not os.path.islink(f"/{d}")]
    out: list[str] = []
    for p in sorted({os.path.realpath(p) for p in paths if p and os.path.isdir(p)}):
        if p == "/" or any(p == q or p.startswith(q.rstrip("/") + "/") for q in out):
            continue
        out.append(p)
    return out


def _memfd(data: bytes, name: str) -> int:
    fd = os.memfd_create(name)  # close-on-exec: only the launcher gets it (pass_fds)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def _kill_uid(uid: int, rounds: int = 50) -> None:
    """SIGKILL every process whose real uid is `uid` (a sandbox's private uid; root only)."""
    for _ in range(rounds):
        victims = [pid for pid, u in _proc_uids() if u == uid]
        if not victims:
            return
        for pid in victims:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)


def _remove_owned(directory: str, uid: int) -> None:
    """Delete the entries of `directory` that `uid` owns (a sandbox's private uid, without a jail)."""
    import shutil

    with contextlib.suppress(OSError), os.scandir(directory) as entries:
        for entry in entries:
            with contextlib.suppress(OSError):
                if entry.stat(follow_symlinks=False).st_uid != uid:
                    continue
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path, ignore_errors=True)
                else:
                    os.unlink(entry.path)


class _Reader:
    """Drains a pipe, keeping the first `cap` bytes."""

    def __init__(self, fd: int, cap: int) -> None:
        self.fd, self.cap = fd, cap
        self.chunks: list[bytes] = []
        self.kept = 0
        self.truncated = False
        self.eof = False

    def read(self) -> None:
        try:
            data = os.read(self.fd, 65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self.eof = True
            return
        room = self.cap - self.kept
        if len(data) > room:
            self.truncated = True
            data = data[:max(0, room)]
        if data:
            self.chunks.append(data)
            self.kept += len(data)

    def text(self) -> str:
        return b"".join(self.chunks).decode("utf-8", errors="replace")


def run_code(code: str, *, timeout_s: float = 5.0, memory_mb: int = 512, max_file_mb: int = 16,
             max_procs: int = 32, stdin: str | bytes | None = None, disk_mb: int | None = None,
             max_open_files: int = 256, max_output_bytes: int = _MAX_OUTPUT, args: Sequence[str] = (),
             namespaces: bool = True) -> SandboxResult:
    """Run the Python program `code` in the sandbox and wait for it (never longer than `timeout_s`).

    Args:
        code: the program's source (run as ``main.py`` in its working directory).
        timeout_s: wall-clock limit; CPU time is limited to the same number of seconds (rounded up).
        memory_mb: address-space limit of each process (MemoryError beyond it).
        max_file_mb: the largest file the program may write (SIGXFSZ / EFBIG beyond it).
        max_procs: processes and threads the program may have at once (its private uid's count).
        stdin: the program's standard input (empty by default).
        disk_mb: size of its private tmpfs (default ``4 * max_file_mb``, at least 16).
        max_open_files: RLIMIT_NOFILE.
        max_output_bytes: stdout and stderr are each cut to this many bytes (the rest is drained).
        args: the program's command-line arguments (``sys.argv[1:]``).
        namespaces: False turns the namespace and jail layers off (tests of the degraded mode).

    Never raises for anything the program does; a sandbox that cannot start is a "sandbox_error".
    """
    import secrets
    import selectors
    import shutil
    import subprocess
    import tempfile

    start = time.monotonic()
    if not sys.platform.startswith("linux"):
        return SandboxResult("sandbox_error", None, "", "", 0.0, reason="the sandbox needs Linux")
    python, prefix = _interpreter()
    cpu_s = max(1, int(-(-timeout_s // 1)))
    disk = int(disk_mb if disk_mb is not None else max(16, 4 * max_file_mb))
    payload = code.encode("utf-8", errors="surrogatepass")
    data_in = stdin.encode("utf-8", errors="surrogatepass") if isinstance(stdin, str) else stdin
    # Created by the launcher only where needed (no namespaces, or an interpreter under /tmp), so
    # that a sandbox killed with its caller leaves nothing behind on the host in the usual case.
    workdir = os.path.join(tempfile.gettempdir(), f"adarl-sandbox-{secrets.token_hex(8)}")
    fds: list[int] = []
    proc: subprocess.Popen[bytes] | None = None
    try:
        stdin_fd = _memfd(data_in, "adarl-stdin") if data_in else subprocess.DEVNULL
        if data_in:
            fds.append(stdin_fd)
        status_r, status_w = os.pipe()
        fds += [status_r, status_w]
        cfg = {
            "parent_pid": os.getpid(), "status_fd": status_w, "workdir": workdir,
            "python": python, "python_unjailed": _fallback_interpreter(python),
            "binds": _ro_binds(python, prefix), "namespaces": bool(namespaces),
            "cpu_s": cpu_s, "memory_bytes": int(memory_mb) << 20, "fsize_bytes": int(max_file_mb) << 20,
            "nproc": int(max_procs), "nofile": int(max_open_files), "disk_bytes": disk << 20,
            "syscall_filter": _syscall_filter().hex(),
        }
        # The configuration (host paths, the caller's pid) travels in a memfd, not on a command line
        # that /proc would show; only the program's own arguments are there (for `ps`).
        config_fd = _memfd(json.dumps(cfg).encode() + b"\n" + payload, "adarl-config")
        fds.append(config_fd)
        try:
            proc = subprocess.Popen(
                [python, "-I", "-S", "-B", _LAUNCHER, str(config_fd), *map(str, args)],
                stdin=stdin_fd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd="/",
                env=dict(_ENV, HOME="/"), pass_fds=(config_fd, status_w), start_new_session=True,
            )
        except OSError as exc:
            return SandboxResult("sandbox_error", None, "", "", time.monotonic() - start,
                                 reason=f"could not start the launcher: {exc}")
        os.close(status_w)
        fds.remove(status_w)
        assert proc.stdout is not None and proc.stderr is not None
        readers = [_Reader(proc.stdout.fileno(), max_output_bytes), _Reader(proc.stderr.fileno(), max_output_bytes)]
        for r in readers:
            os.set_blocking(r.fd, False)
        sel = selectors.DefaultSelector()
        for r in readers:
            sel.register(r.fd, selectors.EVENT_READ, r)
        pidfd = -1
        with contextlib.suppress(AttributeError, OSError):
            pidfd = os.pidfd_open(proc.pid)
            sel.register(pidfd, selectors.EVENT_READ, None)
        deadline = start + float(timeout_s)
        timed_out = False
        exited_at: float | None = None
        try:
            while True:
                now = time.monotonic()
                if exited_at is None and proc.poll() is not None:
                    exited_at = now
                    if pidfd >= 0:
                        sel.unregister(pidfd)
                if exited_at is not None and (all(r.eof for r in readers) or now - exited_at > 0.5):
                    break  # exited; output pipes held open by leftovers are not waited for
                if exited_at is None and now >= deadline:
                    timed_out = True
                    break
                wait = 0.05 if exited_at is not None else (deadline - now if pidfd >= 0 else min(0.02, deadline - now))
                for key, _ in sel.select(max(0.0, wait)):
                    if key.data is not None:
                        key.data.read()
                        if key.data.eof:
                            sel.unregister(key.fd)
        finally:
            sel.close()
            if pidfd >= 0:
                os.close(pidfd)
            if proc.poll() is None:
                with contextlib.suppress(OSError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            for r in readers:  # what was written before the kill
                with contextlib.suppress(OSError):
                    for _ in range(64):
                        r.read()
                        if r.eof:
                            break
        messages = _read_status(status_r)
        layers: dict[str, bool] = {}
        outcome: dict[str, Any] = {}
        for m in messages:
            layers.update(m.get("layers", {}))
            outcome.update({k: v for k, v in m.items() if k != "layers"})
        if os.geteuid() == 0 and not layers.get("pid_namespace") and layers.get("private_uid"):
            _kill_uid(UID_BASE + proc.pid)  # no PID namespace: leftovers die by uid
        if os.geteuid() == 0 and not layers.get("filesystem_jail") and layers.get("private_uid"):
            for shared in ("/dev/shm", tempfile.gettempdir()):  # what it left in the host's RAM-backed dirs
                _remove_owned(shared, UID_BASE + proc.pid)
        duration = time.monotonic() - start
        out, err = readers[0].text(), readers[1].text()
        truncated = any(r.truncated for r in readers)
        if timed_out:
            return SandboxResult("timeout", None, out, err, duration, outcome.get("cpu_s"),
                                 f"wall-clock limit {timeout_s:g} s", truncated, layers)
        if outcome.get("setup_error"):
            return SandboxResult("sandbox_error", None, out, err, duration, None,
                                 str(outcome["setup_error"]), truncated, layers)
        wstatus = outcome.get("wait")
        if wstatus is None:
            reason = f"the launcher ended without a result (exit code {proc.returncode})"
            return SandboxResult("sandbox_error", None, out, err, duration, None, reason, truncated, layers)
        used = outcome.get("cpu_s")
        if os.WIFSIGNALED(wstatus):
            sig = os.WTERMSIG(wstatus)
            if sig == signal.SIGXCPU or (sig == signal.SIGKILL and used is not None and used >= cpu_s - 0.05):
                return SandboxResult("timeout", -sig, out, err, duration, used, f"CPU limit {cpu_s} s",
                                     truncated, layers)
            return SandboxResult("killed", -sig, out, err, duration, used, _signal_name(sig), truncated, layers)
        code_ = os.WEXITSTATUS(wstatus)
        return SandboxResult("ok" if code_ == 0 else "error", code_, out, err, duration, used,
                             "" if code_ == 0 else f"exit code {code_}", truncated, layers)
    except Exception as exc:  # noqa: BLE001 - the caller gets a result, never an exception
        return SandboxResult("sandbox_error", None, "", "", time.monotonic() - start, reason=repr(exc))
    finally:
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if proc is not None:
            for stream in (proc.stdout, proc.stderr):
                with contextlib.suppress(Exception):
                    stream.close()  # type: ignore[union-attr]
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        shutil.rmtree(workdir, ignore_errors=True)


def _read_status(fd: int) -> list[dict[str, Any]]:
    """The launcher's JSON lines (layers, then the program's wait status), without blocking."""
    os.set_blocking(fd, False)
    buf = b""
    with contextlib.suppress(OSError):
        while len(buf) < 1 << 20:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            buf += chunk
    out = []
    for line in buf.splitlines():
        with contextlib.suppress(ValueError):
            item = json.loads(line)
            if isinstance(item, dict):
                out.append(item)
    return out


_LAYER_NAMES = ("network_namespace", "pid_namespace", "mount_namespace", "filesystem_jail",
                "ipc_namespace", "uts_namespace", "cgroup_namespace", "private_uid", "nproc_limit", "no_new_privs",
                "disk_quota", "rlimits", "syscall_filter")
_capabilities: dict[str, Any] | None = None


def sandbox_capabilities(refresh: bool = False) -> dict[str, Any]:
    """Which protection layers are active on this machine (probed once by running a program).

    Keys: each of ``network_namespace``, ``pid_namespace``, ``mount_namespace``,
    ``filesystem_jail``, ``ipc_namespace``, ``uts_namespace``, ``cgroup_namespace``, ``private_uid``, ``nproc_limit``,
    ``no_new_privs``, ``disk_quota``, ``rlimits``, ``syscall_filter`` (bools), plus ``root``,
    ``python``, when the probe failed ``error``, and when libseccomp could not build the filter
    ``syscall_filter_error``. A layer that is off is logged once as a warning.
    """
    global _capabilities
    if _capabilities is None or refresh:
        result = run_code("print('ok')", timeout_s=20, memory_mb=256)
        caps: dict[str, Any] = {name: bool(result.layers.get(name, False)) for name in _LAYER_NAMES}
        caps["root"] = sys.platform.startswith("linux") and os.geteuid() == 0
        caps["python"] = _interpreter()[0]
        if not (result.ok and result.stdout.strip() == "ok"):
            caps["error"] = f"{result.status}: {result.reason or result.stderr[-500:]}"
        if error := filter_error():
            caps["syscall_filter_error"] = error
        missing = [name for name in _LAYER_NAMES if not caps[name]]
        if missing:
            import logging

            logging.getLogger(__name__).warning(
                "code sandbox degraded: %s not available here%s", ", ".join(missing),
                f" ({caps['error']})" if "error" in caps else "")
        _capabilities = caps
    return dict(_capabilities)
