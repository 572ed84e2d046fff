"""The system-call filter of the sandboxed program, compiled in the caller's process.

`_syscall_filter()` builds a seccomp-BPF program once per process with libseccomp (through
`pyseccomp`) and returns it as bytes; the launcher (launcher.py, standard library only) loads it
just before ``execve``. Without libseccomp it returns b"" and the layer is reported as off.
"""

from __future__ import annotations

import contextlib

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


def filter_error() -> str:
    """Why the filter could not be built ("" when it was, or has not been asked for yet)."""
    return _filter_cache[1] if _filter_cache is not None else ""
