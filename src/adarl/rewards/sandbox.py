"""Run untrusted (model-generated) Python in a separate, locked-down process.

`run_code` starts a small launcher (this file, run as a script with ``python -I -S -B``), which
builds the sandbox and then runs the program. On Linux, as root (or as a user allowed to create
user namespaces), the layers are:

- **namespaces** (``unshare``): a new network namespace (no interface is up, not even loopback:
  every connect fails at once with "Network is unreachable"), a new PID namespace (the program
  sees only its own processes; when the program exits, or the sandbox is killed, the kernel kills
  every process left in it, including ones that called ``setsid`` or double-forked), new mount,
  IPC (System V / POSIX message queues) and UTS namespaces.
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

__all__ = ["SandboxResult", "run_code", "sandbox_capabilities", "UID_BASE"]

Status = Literal["ok", "error", "timeout", "killed", "sandbox_error"]

UID_BASE = 200_000_000  # the sandboxed program runs as UID_BASE + the launcher's pid (as root)
_MAX_OUTPUT = 64 * 1024
_CLONE = {"user": 0x10000000, "mount": 0x00020000, "net": 0x40000000, "ipc": 0x08000000,
          "uts": 0x04000000, "pid": 0x20000000}
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 32, 4096, 16384, 1 << 18
_MS_NOATIME, _MS_NODIRATIME, _MS_RELATIME = 1024, 2048, 1 << 21
_MNT_DETACH = 2
_PR_SET_PDEATHSIG, _PR_SET_DUMPABLE, _PR_SET_CHILD_SUBREAPER, _PR_SET_NO_NEW_PRIVS = 1, 4, 36, 38
_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 22, 2
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}
_DEVICES = ("null", "zero", "full", "random", "urandom")
_TOP_LINKS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")  # symlinks into /usr on merged-usr systems
_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}


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


# System calls the program is refused (EPERM), as a deny list on top of the other layers: each
# group names the hole it closes. Names this kernel or architecture lacks are skipped.
_DENIED_SYSCALLS = {
    "kernel keyrings (the caller's session keyring is inherited)": ("add_key", "request_key", "keyctl"),
    "new namespaces (a user namespace gives uid 0 and mounts)": (
        "unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree", "fsopen",
        "fsconfig", "fsmount", "fspick", "mount_setattr"),
    "memory outside RLIMIT_AS": (
        "memfd_create", "memfd_secret", "shmget", "shmat", "shmctl", "shmdt", "msgget", "msgsnd", "msgrcv",
        "msgctl", "semget", "semop", "semtimedop", "semctl", "mq_open", "mq_unlink", "mq_timedsend",
        "mq_timedreceive", "mq_notify", "mq_getsetattr"),
    "other processes' memory": ("ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "kcmp"),
    "kernel attack surface no program here needs": (
        "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register",
        "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "reboot", "swapon",
        "swapoff", "syslog", "acct", "quotactl", "quotactl_fd", "lookup_dcookie", "open_by_handle_at",
        "fanotify_init", "vhangup", "iopl", "ioperm", "uselib", "ustat", "sysfs", "_sysctl", "nfsservctl",
        "sethostname", "setdomainname"),
}
_CLONE_NEW = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000)  # CLONE_NEW*
_AF_UNIX, _AF_INET, _AF_INET6 = 1, 2, 10
_F_SETPIPE_SZ, _SOL_SOCKET, _SO_SNDBUF, _SO_RCVBUF = 1031, 1, 7, 8
_filter_cache: tuple[bytes, str] | None = None


def _syscall_filter() -> bytes:
    """The seccomp-BPF program the sandboxed program runs under (b"" where libseccomp is missing).

    Built once per process with libseccomp (through `pyseccomp`) and handed to the launcher as
    bytes, so the launcher stays standard-library only. Default: allow. Refused: the calls in
    `_DENIED_SYSCALLS`; ``clone`` with any CLONE_NEW* flag; ``clone3`` with ENOSYS (its flags are
    in memory a filter cannot read; glibc then falls back to ``clone``); sockets of any family but
    unix, IPv4 and IPv6 (EAFNOSUPPORT: netlink, vsock, packet, ...); growing a pipe's or a
    socket's kernel buffer (``F_SETPIPE_SZ``, ``SO_SNDBUF``, ``SO_RCVBUF``). A system call of
    another architecture (x32, i386) kills the program.
    """
    global _filter_cache
    if _filter_cache is None:
        try:
            _filter_cache = (_build_syscall_filter(), "")
        except Exception as exc:  # noqa: BLE001 - no libseccomp here: the layer is reported as off
            _filter_cache = (b"", f"{type(exc).__name__}: {exc}")
    return _filter_cache[0]


def _build_syscall_filter() -> bytes:
    import errno
    import platform
    import tempfile

    import pyseccomp as sc

    f = sc.SyscallFilter(sc.ALLOW)
    f.set_attr(sc.Attr.ACT_BADARCH, sc.KILL_PROCESS)
    deny = sc.ERRNO(errno.EPERM)
    for names in _DENIED_SYSCALLS.values():
        for name in names:
            with contextlib.suppress(Exception):  # not a system call of this kernel/architecture
                f.add_rule(deny, name)
    flags_arg = 1 if platform.machine().startswith("s390") else 0  # clone(stack, flags) there
    for flag in _CLONE_NEW:
        f.add_rule(deny, "clone", sc.Arg(flags_arg, sc.MASKED_EQ, flag, flag))
    with contextlib.suppress(Exception):
        f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    no_family = sc.ERRNO(errno.EAFNOSUPPORT)
    # domain not in {AF_UNIX, AF_INET, AF_INET6}: 64-bit compares, so high bits cannot sneak past
    for family in (0, *range(_AF_INET + 1, _AF_INET6)):
        f.add_rule(no_family, "socket", sc.Arg(0, sc.EQ, family))
    f.add_rule(no_family, "socket", sc.Arg(0, sc.GT, _AF_INET6))
    f.add_rule(no_family, "socketpair", sc.Arg(0, sc.NE, _AF_UNIX))
    # Kernel buffers stay at their default sizes: they are memory that RLIMIT_AS does not count.
    f.add_rule(deny, "fcntl", sc.Arg(1, sc.EQ, _F_SETPIPE_SZ))
    for option in (_SO_SNDBUF, _SO_RCVBUF):
        f.add_rule(deny, "setsockopt", sc.Arg(1, sc.EQ, _SOL_SOCKET), sc.Arg(2, sc.EQ, option))
    with tempfile.TemporaryFile() as out:
        f.export_bpf(out)
        out.seek(0)
        return out.read()


def _signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def _proc_uids() -> list[tuple[int, int]]:
    """(pid, real uid) of every process visible in /proc."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError), open(f"/proc/{name}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Uid:"):
                    out.append((int(name), int(line.split()[1])))
                    break
    return out


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
                [python, "-I", "-S", "-B", os.path.abspath(__file__), str(config_fd), *map(str, args)],
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
                "ipc_namespace", "uts_namespace", "private_uid", "nproc_limit", "no_new_privs",
                "disk_quota", "rlimits", "syscall_filter")
_capabilities: dict[str, Any] | None = None


def sandbox_capabilities(refresh: bool = False) -> dict[str, Any]:
    """Which protection layers are active on this machine (probed once by running a program).

    Keys: each of ``network_namespace``, ``pid_namespace``, ``mount_namespace``,
    ``filesystem_jail``, ``ipc_namespace``, ``uts_namespace``, ``private_uid``, ``nproc_limit``,
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
        if _filter_cache is not None and _filter_cache[1]:
            caps["syscall_filter_error"] = _filter_cache[1]
        missing = [name for name in _LAYER_NAMES if not caps[name]]
        if missing:
            import logging

            logging.getLogger(__name__).warning(
                "code sandbox degraded: %s not available here%s", ", ".join(missing),
                f" ({caps['error']})" if "error" in caps else "")
        _capabilities = caps
    return dict(_capabilities)


# ====================================================================== launcher side
# Everything below runs in the launcher process (as the caller's user, normally root), started
# as ``python -I -S -B sandbox.py CONFIG``: standard library only, nothing from the package.


def _libc() -> Any:
    import ctypes

    return ctypes.CDLL(None, use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        import ctypes

        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _prctl(libc: Any, option: int, value: int) -> int:
    import ctypes

    return libc.prctl(option, ctypes.c_ulong(value), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0))


def _mount(libc: Any, source: str | None, target: str, fstype: str | None, flags: int,
           data: str | None = None) -> None:
    import ctypes

    def enc(s: str | None) -> bytes | None:
        return None if s is None else os.fsencode(s)

    _check(libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
           f"mount {source or ''} on {target}")


def _locked_flags(path: str) -> int:
    """Mount flags of `path` that a read-only remount must keep (required inside a user namespace)."""
    f = os.statvfs(path).f_flag
    flags = 0
    for st, ms in ((os.ST_NOSUID, _MS_NOSUID), (os.ST_NODEV, _MS_NODEV), (os.ST_NOEXEC, _MS_NOEXEC),
                   (os.ST_NOATIME, _MS_NOATIME), (os.ST_NODIRATIME, _MS_NODIRATIME),
                   (os.ST_RELATIME, _MS_RELATIME)):
        if f & st:
            flags |= ms
    return flags


def _bind_ro(libc: Any, source: str, target: str, extra: int = _MS_NOSUID | _MS_NODEV) -> None:
    _mount(libc, source, target, None, _MS_BIND | _MS_REC)
    flags = _MS_REMOUNT | _MS_BIND | _MS_RDONLY | extra | _locked_flags(target)
    _mount(libc, None, target, None, flags)


def _build_jail(libc: Any, cfg: dict[str, Any], uid: int, gid: int, code: bytes, own_proc: bool) -> None:
    """Pivot into a new root: read-only system dirs, minimal /dev, fresh /proc, private /tmp."""
    import platform

    _mount(libc, None, "/", None, _MS_REC | _MS_PRIVATE)  # nothing below propagates to the host
    # The new root is staged on the (now private) /tmp, unless something to bind lives there.
    if any(b == "/tmp" or b.startswith("/tmp/") for b in cfg["binds"]) or not os.path.isdir("/tmp"):
        new = cfg["workdir"]
        os.mkdir(new, 0o700)
    else:
        new = "/tmp"
    _mount(libc, "tmpfs", new, "tmpfs", _MS_NOSUID | _MS_NODEV, "size=8m,nr_inodes=4096,mode=0755")
    for path in cfg["binds"]:
        target = new + path
        os.makedirs(target, mode=0o755, exist_ok=True)
        _bind_ro(libc, path, target)
    for name in _TOP_LINKS:
        src = f"/{name}"
        if os.path.islink(src) and not os.path.lexists(new + src):
            os.symlink(os.readlink(src), new + src)
    os.mkdir(new + "/dev", 0o755)
    for dev in _DEVICES:
        if os.path.exists(f"/dev/{dev}"):
            target = f"{new}/dev/{dev}"
            with open(target, "wb"):
                pass
            _mount(libc, f"/dev/{dev}", target, None, _MS_BIND)
            _mount(libc, None, target, None, _MS_REMOUNT | _MS_BIND | _MS_NOSUID | _MS_NOEXEC
                   | (_locked_flags(target) & ~_MS_NODEV))
    for i, name in enumerate(("stdin", "stdout", "stderr")):
        os.symlink(f"/proc/self/fd/{i}", f"{new}/dev/{name}")
    os.symlink("/proc/self/fd", f"{new}/dev/fd")
    os.mkdir(new + "/proc", 0o555)
    if own_proc:  # only a PID namespace's own /proc: the host's would show every process
        # hidepid=2: the program sees only its own processes, not init's command line or files
        try:
            _mount(libc, "proc", new + "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, "hidepid=2")
        except OSError:  # an old kernel: init is still not dumpable, so its files stay unreadable
            _mount(libc, "proc", new + "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
    os.mkdir(new + "/tmp", 0o755)
    _mount(libc, "tmpfs", new + "/tmp", "tmpfs", _MS_NOSUID | _MS_NODEV,
           f"size={cfg['disk_bytes'] // 1024}k,nr_inodes=16384,mode=0700,uid={uid},gid={gid}")
    main = new + "/tmp/main.py"
    with open(main, "wb") as f:
        f.write(code)
    os.chown(main, uid, gid)
    nr = _SYS_PIVOT_ROOT.get(platform.machine())
    os.chdir(new)
    if nr is not None and libc.syscall(nr, b".", b".") == 0:
        _check(libc.umount2(b".", _MNT_DETACH), "umount old root")
    else:  # an unprivileged program cannot leave a chroot
        _check(libc.chroot(b"."), "chroot")
    os.chdir("/")
    _mount(libc, None, "/", None, _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)


def _count_processes(uid: int) -> int:
    return sum(1 for _, u in _proc_uids() if u == uid)


def _exec_program(cfg: dict[str, Any], uid: int, gid: int, root: bool, workdir: str, err_w: int) -> None:
    """In the program's process: drop everything, set the limits, exec the interpreter."""
    import resource

    libc = _libc()
    os.chdir(workdir)
    os.closerange(3, err_w)
    os.closerange(err_w + 1, 65536)
    nproc = cfg["nproc"] if root else _count_processes(os.getuid()) + cfg["nproc"]
    limits = [
        (resource.RLIMIT_CORE, 0), (resource.RLIMIT_CPU, cfg["cpu_s"]), (resource.RLIMIT_AS, cfg["memory_bytes"]),
        (resource.RLIMIT_FSIZE, cfg["fsize_bytes"]), (resource.RLIMIT_NOFILE, cfg["nofile"]),
        (resource.RLIMIT_NPROC, nproc), (resource.RLIMIT_MEMLOCK, 0), (resource.RLIMIT_MSGQUEUE, 0),
    ]
    for which, value in limits:
        hard = value + 1 if which == resource.RLIMIT_CPU else value  # SIGXCPU first, SIGKILL a second later
        resource.setrlimit(which, (value, hard))
    _check(_prctl(libc, _PR_SET_NO_NEW_PRIVS, 1), "no_new_privs")
    if root:
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
        try:
            os.setuid(0)
        except PermissionError:
            pass
        else:
            raise RuntimeError("privileges were not dropped")
    env = dict(_ENV, HOME=workdir, TMPDIR=workdir)
    python = cfg["python"] if workdir == "/tmp" else cfg["python_unjailed"]
    if cfg["syscall_filter"]:  # last: from here on the filter applies, to execve and all children
        _load_syscall_filter(libc, bytes.fromhex(cfg["syscall_filter"]))
    os.execve(python, [python, "-I", "-S", "-B", "main.py", *cfg["args"]], env)


def _load_syscall_filter(libc: Any, program: bytes) -> None:
    """Install a seccomp-BPF program (struct sock_filter[], 8 bytes each) on this process."""
    import ctypes

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    buf = ctypes.create_string_buffer(program, len(program))
    prog = SockFprog(len(program) // 8, ctypes.cast(buf, ctypes.c_void_p))
    _check(libc.prctl(_PR_SET_SECCOMP, ctypes.c_ulong(_SECCOMP_MODE_FILTER), ctypes.byref(prog),
                      ctypes.c_ulong(0), ctypes.c_ulong(0)), "seccomp filter")


def _kill_children(uid: int | None) -> None:
    """Without a PID namespace: kill what the program left behind (by uid as root, else our orphans)."""
    me = os.getpid()
    for _ in range(100):
        victims = []
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            with contextlib.suppress(OSError, ValueError, IndexError):
                with open(f"/proc/{name}/status", "rb") as f:
                    fields = dict(line.split(b":", 1) for line in f if b":" in line)
                real_uid = int(fields[b"Uid"].split()[0])
                ppid = int(fields[b"PPid"].strip())
                if (uid is not None and real_uid == uid) or (uid is None and ppid == me):
                    victims.append(int(name))
        for pid in victims:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-1, os.WNOHANG)[0] > 0:
                pass
        if not victims:
            return
        time.sleep(0.01)


def _supervise(libc: Any, cfg: dict[str, Any], layers: dict[str, bool], code: bytes, uid: int, gid: int,
               root: bool, lifeline: int, report: Any) -> None:
    """The sandbox's init (PID 1 of its namespace): build the jail, run the program, reap, report."""
    import select

    _prctl(libc, _PR_SET_PDEATHSIG, signal.SIGKILL)
    if select.select([lifeline], [], [], 0)[0]:  # the launcher died before PDEATHSIG was set
        os._exit(1)
    # Our /proc files become root's and ptrace-proof: a program with our uid (no root, user
    # namespace) cannot read our memory, environment or file descriptors either.
    _prctl(libc, _PR_SET_DUMPABLE, 0)
    in_pid_ns = os.getpid() == 1
    if not in_pid_ns:
        _prctl(libc, _PR_SET_CHILD_SUBREAPER, 1)  # orphans come to us, so we can kill them
    workdir = cfg["workdir"]
    if layers.get("mount_namespace"):
        _build_jail(libc, cfg, uid, gid, code, own_proc=in_pid_ns)  # fails closed: a setup_error
        workdir = "/tmp"
        layers["filesystem_jail"] = layers["disk_quota"] = True
    else:
        os.mkdir(workdir, 0o700)
        with open(os.path.join(workdir, "main.py"), "wb") as f:
            f.write(code)
        if root:
            os.chown(workdir, uid, gid)
            os.chown(os.path.join(workdir, "main.py"), uid, gid)
        layers["filesystem_jail"] = layers["disk_quota"] = False
    if layers.get("uts_namespace"):
        with contextlib.suppress(OSError):
            _check(libc.sethostname(b"sandbox", 7), "sethostname")
    layers["private_uid"] = layers["nproc_limit"] = root
    layers["no_new_privs"] = layers["rlimits"] = True
    layers["syscall_filter"] = bool(cfg["syscall_filter"])  # its loading fails closed (a sandbox_error)
    report(layers=layers)
    err_r, err_w = os.pipe()  # close-on-exec: data arrives only if the exec failed
    child = os.fork()
    if child == 0:
        try:
            os.close(err_r)
            _exec_program(cfg, uid, gid, root, workdir, err_w)
        except BaseException as exc:  # noqa: BLE001 - reported to the caller as a sandbox_error
            with contextlib.suppress(Exception):
                os.write(err_w, f"{type(exc).__name__}: {exc}".encode()[:2000])
        os._exit(127)
    os.close(err_w)
    wstatus, cpu = None, None
    while True:
        try:
            pid, status, usage = os.wait4(-1, 0)
        except ChildProcessError:
            break
        except InterruptedError:
            continue
        if pid == child:
            wstatus, cpu = status, usage.ru_utime + usage.ru_stime
            break
    error = os.read(err_r, 4096).decode("utf-8", errors="replace")
    if not in_pid_ns:
        _kill_children(uid if root else None)
    if workdir != "/tmp":
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)
    report(wait=wstatus, cpu_s=cpu, setup_error=error or None)
    # Returning (exiting) as PID 1 makes the kernel kill everything left in the namespace.


def _unshare(libc: Any, flag: int) -> bool:
    return libc.unshare(flag) == 0


def _map_ids(uid: int, gid: int) -> bool:
    """Map our own uid/gid into a fresh user namespace (identity), so mounts are allowed."""
    try:
        with open("/proc/self/setgroups", "w") as f:
            f.write("deny")
        with open("/proc/self/uid_map", "w") as f:
            f.write(f"{uid} {uid} 1")
        with open("/proc/self/gid_map", "w") as f:
            f.write(f"{gid} {gid} 1")
    except OSError:
        return False
    return True


def _read_config(fd: int, args: list[str]) -> tuple[dict[str, Any], bytes]:
    """The caller's memfd: one line of JSON configuration, then the program's source."""
    chunks = []
    while chunk := os.read(fd, 1 << 20):
        chunks.append(chunk)
    os.close(fd)
    head, _, code = b"".join(chunks).partition(b"\n")
    cfg = json.loads(head)
    cfg["args"] = args
    return cfg, code


def _launch(cfg: dict[str, Any], code: bytes) -> int:
    """The launcher: unshare namespaces, fork the sandbox's init, wait for it."""
    libc = _libc()
    os.umask(0o022)
    status_fd = int(cfg["status_fd"])
    os.set_inheritable(status_fd, False)

    def report(**items: Any) -> None:
        with contextlib.suppress(OSError):
            os.write(status_fd, (json.dumps(items) + "\n").encode())

    _prctl(libc, _PR_SET_PDEATHSIG, signal.SIGKILL)  # the caller dies: so do we (and the sandbox)
    if os.getppid() != cfg["parent_pid"]:
        return 1
    try:
        root = os.geteuid() == 0
        uid, gid = (UID_BASE + os.getpid(),) * 2 if root else (os.getuid(), os.getgid())
        layers: dict[str, bool] = {}
        if cfg["namespaces"]:
            if not root:
                layers["user_namespace"] = _unshare(libc, _CLONE["user"]) and _map_ids(uid, gid)
            allowed = root or layers["user_namespace"]
            for name in ("mount", "net", "ipc", "uts", "pid"):
                layers[f"{'network' if name == 'net' else name}_namespace"] = (
                    allowed and _unshare(libc, _CLONE[name]))
        else:
            layers.update({f"{n}_namespace": False for n in ("mount", "network", "ipc", "uts", "pid")})
        lifeline_r, lifeline_w = os.pipe()
        pid = os.fork()
    except Exception as exc:  # noqa: BLE001
        report(setup_error=f"launcher: {type(exc).__name__}: {exc}")
        return 1
    if pid == 0:
        os.close(lifeline_w)
        try:
            _supervise(libc, cfg, layers, code, uid, gid, root, lifeline_r, report)
        except BaseException as exc:  # noqa: BLE001
            report(setup_error=f"sandbox setup: {type(exc).__name__}: {exc}")
        os._exit(0)
    os.close(lifeline_r)
    while True:
        try:
            os.waitpid(pid, 0)
            break
        except InterruptedError:
            continue
        except ChildProcessError:
            break
    return 0


if __name__ == "__main__":
    sys.exit(_launch(*_read_config(int(sys.argv[1]), sys.argv[2:])))
