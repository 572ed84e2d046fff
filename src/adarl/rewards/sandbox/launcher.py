"""The sandbox's launcher: the process that builds the jail and runs the program in it.

`run_code` (api.py) starts this file as a script, ``python -I -S -B launcher.py CONFIG_FD ARGS``,
with its configuration and the program's source in a memfd. It must stay one file of the standard
library only: ``-I`` puts neither the package nor this folder on ``sys.path``. In order: the
namespaces (``unshare``), the uid map, the filesystem jail (``pivot_root`` into read-only binds and
a size-capped tmpfs; `_build_jail`), the rlimits, the seccomp program compiled by the caller
(seccomp.py), and the ``execve`` of the interpreter; then it supervises the program (a subreaper
that kills what the program leaves behind) and reports each layer's state on the status pipe.
The API process imports the constants and `_proc_uids` from here, so both sides agree.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from typing import Any

UID_BASE = 200_000_000  # the sandboxed program runs as UID_BASE + the launcher's pid (as root)
_CLONE = {"user": 0x10000000, "mount": 0x00020000, "net": 0x40000000, "ipc": 0x08000000,
          "uts": 0x04000000, "pid": 0x20000000, "cgroup": 0x02000000}
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


# ====================================================================== launcher side
# Everything below runs in the launcher process (as the caller's user, normally root), started
# as ``python -I -S -B launcher.py CONFIG``: standard library only, nothing from the package.


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
            # cgroup: /proc/self/cgroup reads "/" instead of the host's cgroup path
            for name in ("mount", "net", "ipc", "uts", "pid", "cgroup"):
                layers[f"{'network' if name == 'net' else name}_namespace"] = (
                    allowed and _unshare(libc, _CLONE[name]))
        else:
            layers.update({f"{n}_namespace": False for n in ("mount", "network", "ipc", "uts", "pid", "cgroup")})
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
