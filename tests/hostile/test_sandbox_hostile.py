"""Holes an outside tester found in the code sandbox, each closed as a class, with several cases per class.

1. kernel keyrings (the caller's session keyring was inherited: read, search, plant keys);
2. nested user namespaces (uid 0 with capabilities, then its own mounts past the disk cap);
3. memory held outside RLIMIT_AS (memfd, System V shared memory and queues, a tmpfs of its own);
4. the launcher's configuration (host paths, the caller's pid) and socket families beyond IP;
5. the system-call filter itself (present, inherited, on the calls no program here needs);
6. the code reward's verdict (the old nonce was in the program's memory; the tests ran beside it).

A case prints ``ESCAPED`` when it got through. As root the whole sandbox must be there (as
test_sandbox.py's ``test_capabilities_on_this_machine`` says), so a missing layer fails the case
instead of skipping it; elsewhere it is skipped with the layer's name.
"""

from __future__ import annotations

import ctypes
import os
import platform
import shutil
import sys
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from adarl.rewards import code as code_reward
from adarl.rewards.sandbox import SandboxResult, run_code, sandbox_capabilities

pytestmark = [pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox needs Linux"),
              pytest.mark.heavy]

REPO = Path(__file__).resolve().parents[2]
SECRET = "adarl-key-secret-" + uuid.uuid4().hex
# add_key, request_key, keyctl, clone, clone3, socket: the cases call them by number
SYSCALLS = {"x86_64": (248, 249, 250, 56, 435, 41), "aarch64": (217, 218, 219, 220, 435, 198)}
ADD_KEY, REQUEST_KEY, KEYCTL, CLONE, CLONE3, SOCKET = SYSCALLS.get(platform.machine(), (-1,) * 6)
KEY_SPEC_SESSION = -3
KEYCTL_GET_KEYRING_ID, KEYCTL_JOIN_SESSION, KEYCTL_INVALIDATE, KEYCTL_SEARCH, KEYCTL_READ = 0, 1, 21, 10, 11
FILTER, JAIL, PIDNS = "syscall_filter", "filesystem_jail", "pid_namespace"
# memory_mb x max_procs + disk_mb: what a program may hold by the README's bound (here 216 MiB)
BOUND_KW: dict[str, object] = {"memory_mb": 100, "max_procs": 2, "disk_mb": 16, "max_file_mb": 16}
BOUND_MB = 100 * 2 + 16


@pytest.fixture(scope="module")
def caps() -> dict[str, object]:
    return sandbox_capabilities()


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def keyctl(*args: object) -> int:
    return _libc().syscall(KEYCTL, *[ctypes.c_long(a) if isinstance(a, int) else a for a in args])


@dataclass
class Host:
    key_id: int
    key_desc: str
    planted: str = field(default_factory=lambda: "adarl-planted-" + uuid.uuid4().hex)


@pytest.fixture
def host() -> Iterator[Host]:
    """A key with a secret payload in the caller's session keyring, as a real caller might hold one."""
    if KEYCTL < 0:
        pytest.skip(f"no system call numbers for {platform.machine()}")
    desc = "adarl-test-key-" + uuid.uuid4().hex
    key = _libc().syscall(ADD_KEY, b"user", desc.encode(), SECRET.encode(), ctypes.c_size_t(len(SECRET)),
                          ctypes.c_long(KEY_SPEC_SESSION))
    if key < 0:
        pytest.skip(f"this kernel has no keyrings (errno {ctypes.get_errno()})")
    state = Host(key, desc)
    try:
        yield state
    finally:
        keyctl(KEYCTL_INVALIDATE, key)
        planted = keyctl(KEYCTL_SEARCH, KEY_SPEC_SESSION, b"user", state.planted.encode(), 0)
        if planted >= 0:
            keyctl(KEYCTL_INVALIDATE, planted)
        assert planted < 0, "the sandbox planted a key in the caller's session keyring"


@dataclass(frozen=True)
class Case:
    name: str
    code: str
    needs: tuple[str, ...] = (FILTER,)
    check: Callable[[SandboxResult, Host], None] | None = None
    kwargs: dict[str, object] = field(default_factory=dict)
    old_code_fails: bool = True  # False: a guard that already held before the filter


def try_(body: str) -> str:
    """A program that prints ESCAPED when `body` runs without raising."""
    indented = "\n".join("    " + line for line in body.strip().splitlines())
    return (f"import ctypes, os, socket\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            f"def ok(rc):\n    assert rc >= 0, f'errno {{ctypes.get_errno()}}'\n    return rc\n"
            f"try:\n{indented}\nexcept BaseException as exc:\n    print('blocked:', type(exc).__name__, exc)\n"
            f"else:\n    print('ESCAPED')\n")


def fill(code: str, h: Host) -> str:
    values = {"KEY_ID": str(h.key_id), "KEY_DESC": h.key_desc, "PLANTED": h.planted, "ADD_KEY": str(ADD_KEY),
              "REQUEST_KEY": str(REQUEST_KEY), "KEYCTL": str(KEYCTL), "CLONE": str(CLONE), "CLONE3": str(CLONE3),
              "SOCKET": str(SOCKET), "BOUND_MB": str(BOUND_MB)}
    for key, value in values.items():
        code = code.replace(f"@{key}@", value)
    return code


def secret_not_printed(result: SandboxResult, h: Host) -> None:
    assert SECRET not in result.stdout + result.stderr


def no_config_keys(result: SandboxResult, h: Host) -> None:
    out = result.stdout + result.stderr
    for leak in ('"parent_pid"', '"workdir"', '"binds"', f"{os.getpid()},"):
        assert leak not in out, leak


def no_configuration(result: SandboxResult, h: Host) -> None:
    no_config_keys(result, h)
    assert str(REPO) not in result.stdout + result.stderr  # the launcher's path: a host path


def nothing_left(result: SandboxResult, h: Host) -> None:
    left = [Path(d, f"adarl-left-{h.planted}") for d in ("/dev/shm", "/tmp")]
    left = [p for p in left if p.exists()]
    for p in left:
        if p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink()
    assert not left, f"the program's files outlived it: {left}"


# A program that holds `n` MiB (0 if refused) by `hold(i)` and says whether it passed the bound.
HOLD = ("held = 0\n"
        "try:\n    for i in range(@BOUND_MB@ // 16 + 4):\n        hold(i)\n        held += 16\n"
        "except OSError as exc:\n    print('refused:', exc)\n"
        "print('held MiB', held)\nprint('ESCAPED' if held > @BOUND_MB@ else 'bounded')\n")
MEMFD_WRITE = ("import os\nkeep = []\n"
               "def hold(i):\n    fd = os.memfd_create(f'm{i}')\n    keep.append(fd)\n"
               "    for _ in range(16):\n        os.write(fd, b'x' * (1 << 20))\n") + HOLD
MEMFD_FALLOCATE = ("import os\nkeep = []\n"
                   "def hold(i):\n    fd = os.memfd_create(f'm{i}')\n    keep.append(fd)\n"
                   "    os.posix_fallocate(fd, 0, 16 << 20)\n") + HOLD
SYSV_SHM = ("import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "libc.shmat.restype = ctypes.c_void_p\n"
            "def hold(i):\n    shm = libc.shmget(0, 16 << 20, 0o1600)\n"
            "    if shm < 0:\n        raise OSError(ctypes.get_errno(), 'shmget')\n"
            "    addr = libc.shmat(shm, None, 0)\n"
            "    if addr in (None, ctypes.c_void_p(-1).value):\n        raise OSError(ctypes.get_errno(), 'shmat')\n"
            "    ctypes.memset(addr, 1, 16 << 20)\n"
            "    libc.shmdt(ctypes.c_void_p(addr))  # detached: no longer in the address space, still held\n") + HOLD
OWN_TMPFS = ("import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\nuid, gid = os.getuid(), os.getgid()\n"
             "if libc.unshare(0x10000000 | 0x00020000) != 0:  # CLONE_NEWUSER | CLONE_NEWNS\n"
             "    raise SystemExit(f'refused: errno {ctypes.get_errno()}')\n"
             "open('/proc/self/setgroups', 'w').write('deny')\n"
             "open('/proc/self/uid_map', 'w').write(f'0 {uid} 1')\n"
             "open('/proc/self/gid_map', 'w').write(f'0 {gid} 1')\n"
             "if libc.mount(b'none', b'/tmp', b'tmpfs', 0, None) != 0:\n"
             "    raise SystemExit(f'refused: errno {ctypes.get_errno()}')\n"
             "def hold(i):\n    with open(f'/tmp/shm{i}', 'wb') as f:\n"
             "        for _ in range(16):\n            f.write(b'x' * (1 << 20))\n") + HOLD

CASES = [
    # ---------------------------------------------------------------- 1. kernel keyrings
    Case("keyring_read_callers_key", try_(
        "buf = ctypes.create_string_buffer(4096)\n"
        "n = ok(libc.syscall(@KEYCTL@, @KEYCTL_READ@, ctypes.c_long(@KEY_ID@), buf, 4096))\n"
        "print(buf.raw[:n])".replace("@KEYCTL_READ@", str(KEYCTL_READ))), check=secret_not_printed),
    Case("keyring_search_session", try_(
        "key = ok(libc.syscall(@KEYCTL@, @SEARCH@, ctypes.c_long(-3), b'user', b'@KEY_DESC@', 0))\n"
        "buf = ctypes.create_string_buffer(4096)\n"
        "print(buf.raw[:libc.syscall(@KEYCTL@, 11, ctypes.c_long(key), buf, 4096)])".replace(
            "@SEARCH@", str(KEYCTL_SEARCH))), check=secret_not_printed),
    Case("keyring_request_key", try_(
        "ok(libc.syscall(@REQUEST_KEY@, b'user', b'@KEY_DESC@', None, ctypes.c_long(0)))")),
    Case("keyring_plant_in_session", try_(
        "ok(libc.syscall(@ADD_KEY@, b'user', b'@PLANTED@', b'planted', ctypes.c_size_t(7), ctypes.c_long(-3)))")),
    Case("keyring_session_id", try_(f"ok(libc.syscall(@KEYCTL@, {KEYCTL_GET_KEYRING_ID}, ctypes.c_long(-3), 0))")),
    Case("keyring_join_new_session", try_(f"ok(libc.syscall(@KEYCTL@, {KEYCTL_JOIN_SESSION}, b'mine'))")),
    Case("keyring_plant_in_user_keyring", try_(
        "ok(libc.syscall(@ADD_KEY@, b'user', b'x', b'planted', ctypes.c_size_t(7), ctypes.c_long(-4)))")),
    # ---------------------------------------------------------------- 2. nested user namespaces
    Case("userns_unshare", try_("ok(libc.unshare(0x10000000))  # CLONE_NEWUSER")),
    Case("userns_unshare_and_mount_tmpfs", try_(
        "ok(libc.unshare(0x10000000 | 0x00020000))  # CLONE_NEWUSER | CLONE_NEWNS\n"
        "ok(libc.mount(b'none', b'/tmp', b'tmpfs', 0, b'size=1g'))")),
    Case("userns_unshare_program", try_(
        "import subprocess\n"
        "out = subprocess.run(['unshare', '-Ur', 'id', '-u'], capture_output=True, text=True, timeout=5).stdout\n"
        "assert out.strip() == '0', out")),
    Case("userns_raw_clone", try_(
        "pid = ok(libc.syscall(@CLONE@, ctypes.c_long(0x10000000 | 17), None, None, None, None))\n"
        "if pid == 0:\n    os._exit(0)  # the child: exit at once\n"
        "os.waitpid(pid, 0)")),
    Case("userns_clone3", try_(
        "args = (ctypes.c_uint64 * 11)(0x10000000, 0, 0, 0, 17)  # flags, pidfd, ..., exit_signal\n"
        "pid = ok(libc.syscall(@CLONE3@, args, ctypes.c_size_t(88)))\n"
        "if pid == 0:\n    os._exit(0)\n"
        "os.waitpid(pid, 0)")),
    Case("userns_uts_and_hostname", try_(
        "ok(libc.unshare(0x10000000 | 0x04000000))  # CLONE_NEWUSER | CLONE_NEWUTS\n"
        "ok(libc.sethostname(b'pwned', 5))")),
    # ---------------------------------------------------------------- 3. memory outside RLIMIT_AS
    Case("memory_memfd_write", MEMFD_WRITE, kwargs=BOUND_KW),
    Case("memory_memfd_fallocate", MEMFD_FALLOCATE, kwargs=BOUND_KW),
    Case("memory_sysv_shm_detached", SYSV_SHM, kwargs=BOUND_KW),
    Case("memory_socket_buffers", "import socket\nheld, pairs = 0, []\n"
         "for i in range(40):\n    a, b = socket.socketpair()\n    pairs.append((a, b))\n"
         "    try:\n        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)\n"
         "    except OSError as exc:\n        refused = exc\n"
         "    a.setblocking(False)\n    try:\n        while True:\n            held += a.send(b'x' * 65536)\n"
         "    except BlockingIOError:\n        pass\n"
         "print('held MiB', held >> 20)\nprint('ESCAPED' if held >> 20 > @BOUND_MB@ else 'bounded')", kwargs=BOUND_KW),
    Case("memory_sysv_message_queue", try_("ok(libc.msgget(0, 0o1600))  # up to msgmni x msgmnb bytes")),
    Case("memory_own_tmpfs_past_disk_cap", OWN_TMPFS, kwargs=BOUND_KW),
    Case("memory_posix_shm_open", try_(
        "from multiprocessing import shared_memory\n"
        "shared_memory.SharedMemory(create=True, size=256 << 20)"), needs=(JAIL,), old_code_fails=False),
    Case("memory_posix_shm_left_without_namespaces", "import os\n"
         "with open('/dev/shm/adarl-left-@PLANTED@', 'wb') as f:\n    f.write(b'x' * (8 << 20))\n"
         "os.makedirs('/tmp/adarl-left-@PLANTED@/d')\nopen('/tmp/adarl-left-@PLANTED@/d/f', 'wb').write(b'x')",
         needs=("private_uid",), kwargs={"namespaces": False},
         check=nothing_left),
    Case("memory_posix_shm_dir", try_("os.makedirs('/dev/shm', exist_ok=True); open('/dev/shm/x', 'w')"),
         needs=(JAIL,), old_code_fails=False),
    # ---------------------------------------------------------------- 4. configuration and socket families
    Case("config_init_cmdline", "print(open('/proc/1/cmdline', 'rb').read())", needs=(PIDNS,),
         check=no_configuration),
    Case("config_every_cmdline", "import os\n"
         "for p in os.listdir('/proc'):\n    try:\n        print(p, open(f'/proc/{p}/cmdline', 'rb').read())\n"
         "    except OSError:\n        pass", needs=(PIDNS,), check=no_configuration),
    Case("config_init_is_hidden", "import os\nprint('ESCAPED' if os.path.exists('/proc/1/cmdline') else 'hidden')",
         needs=(PIDNS,)),
    Case("config_ancestors_without_namespaces", "import os\npid = os.getppid()\n"
         "for _ in range(2):  # init, the launcher (host paths are readable anyway in this mode)\n"
         "    print(open(f'/proc/{pid}/cmdline', 'rb').read())\n"
         "    pid = int(open(f'/proc/{pid}/stat').read().rpartition(')')[2].split()[1])",
         needs=(), check=no_config_keys, kwargs={"namespaces": False}),
    Case("socket_vsock", try_("socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM)")),
    Case("socket_vsock_bind", try_(
        "s = socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM)\n"
        "s.bind((socket.VMADDR_CID_ANY, socket.VMADDR_PORT_ANY))")),
    Case("socket_vsock_high_bits", try_("ok(libc.syscall(@SOCKET@, ctypes.c_long((1 << 32) | 40), 1, 0))")),
    Case("socket_netlink_route", try_(
        "s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE)\ns.bind((0, 0))")),
    Case("socket_netlink_uevent", try_(
        "s = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, 15)  # NETLINK_KOBJECT_UEVENT\ns.bind((0, 1))")),
    Case("socket_netlink_audit", try_("socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 9)  # NETLINK_AUDIT")),
    # ---------------------------------------------------------------- 5. the system-call filter
    Case("filter_active", "print('ESCAPED' if 'Seccomp:\\t0' in open('/proc/self/status').read() else 'filtered')"),
    Case("filter_inherited_by_other_programs", "import subprocess\n"
         "out = subprocess.run(['sh', '-c', 'grep Seccomp: /proc/self/status'], capture_output=True,\n"
         "                     text=True).stdout\n"
         "print(out)\nprint('ESCAPED' if out.split()[-1] == '0' else 'filtered')"),
    Case("filter_userfaultfd", try_("ok(libc.syscall(323 if os.uname().machine == 'x86_64' else 282, 1))")),
    Case("filter_perf_event_open", try_(
        "attr = ctypes.create_string_buffer(128)\n"
        "attr[0:8] = (1).to_bytes(4, 'little') + (128).to_bytes(4, 'little')  # PERF_TYPE_SOFTWARE\n"
        "attr[40:48] = (1 << 5 | 1 << 6).to_bytes(8, 'little')  # exclude_kernel, exclude_hv\n"
        "ok(libc.syscall(298 if os.uname().machine == 'x86_64' else 241, attr, 0, -1, -1, 0))")),
    Case("filter_ptrace_own_child", try_(
        "import signal, time\npid = os.fork()\n"
        "if pid == 0:\n    time.sleep(5)\n    os._exit(0)\n"
        "try:\n    ok(libc.ptrace(16, pid, None, None))  # PTRACE_ATTACH\n"
        "finally:\n    os.kill(pid, signal.SIGKILL)")),
    Case("filter_process_vm_readv_child", try_(
        "import signal, time\nsecret = ctypes.create_string_buffer(b'x' * 64)\npid = os.fork()\n"
        "if pid == 0:\n    time.sleep(5)\n    os._exit(0)\n"
        "class IoVec(ctypes.Structure):\n    _fields_ = [('base', ctypes.c_void_p), ('len', ctypes.c_size_t)]\n"
        "out = ctypes.create_string_buffer(64)\n"
        "local, remote = IoVec(ctypes.addressof(out), 64), IoVec(ctypes.addressof(secret), 64)\n"
        "try:\n    ok(libc.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0))\n"
        "finally:\n    os.kill(pid, signal.SIGKILL)")),
]


def test_every_class_has_several_cases() -> None:
    assert len({c.name for c in CASES}) == len(CASES)
    for prefix in ("keyring_", "userns_", "memory_", "config_", "socket_", "filter_"):
        assert sum(c.name.startswith(prefix) for c in CASES) >= 3, prefix


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_hole_is_closed(case: Case, host: Host, caps: dict[str, object]) -> None:
    missing = [layer for layer in case.needs if not caps.get(layer)]
    if missing and not caps["root"]:
        pytest.skip(f"this machine's sandbox lacks {', '.join(missing)}")
    result = run_code(fill(case.code, host), timeout_s=10, **case.kwargs)  # type: ignore[arg-type]
    assert result.status != "sandbox_error", result.reason
    assert "ESCAPED" not in result.stdout, result
    assert result.status in ("ok", "error"), result
    if case.check is not None:
        case.check(result, host)


def test_capabilities_include_the_filter(caps: dict[str, object]) -> None:
    if caps["root"] or caps.get("syscall_filter_error") is None:
        assert caps["syscall_filter"], caps


def test_ordinary_programs_still_work_under_the_filter() -> None:
    """Threads, subprocesses, unix and IP sockets (refused at connect, as before), multiprocessing pipes."""
    r = run_code("import os, socket, subprocess, sys, threading\n"
                 "t = threading.Thread(target=print, args=('thread',)); t.start(); t.join()\n"
                 "print(subprocess.run([sys.executable, '-c', 'print(6 * 7)'], capture_output=True,\n"
                 "                     text=True).stdout)\n"
                 "a, b = socket.socketpair(); a.send(b'pair'); print(b.recv(4).decode())\n"
                 "socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)\n"
                 "r, w = os.pipe(); os.write(w, b'pipe'); print(os.read(r, 4).decode())\n"
                 "if os.fork() == 0:\n    os._exit(0)\nprint('fork', os.wait()[1])")
    assert r.ok, r
    assert r.stdout.split() == ["thread", "42", "pair", "pipe", "fork", "0"], r.stdout


# ---------------------------------------------------------------- 6. the code reward's verdict

COLUMNS = {"prompt_code": "def f(x):\n    \"\"\"Twice x.\"\"\"\n", "entry_point": "f",
           "test": "def check(candidate):\n    assert candidate(2) == 4\n    assert candidate(21) == 42\n"}
TELL_EVERY_FD = ("for fd in range(1, 32):\n    for secret in found:\n"
                 "        try:\n            os.write(fd, secret + b'\\n')\n        except OSError:\n            pass\n"
                 "os._exit(0)\n```")
CHEATS = {
    # the old harness read a nonce from stdin and printed it after the tests; these found it
    "nonce_from_stdin_buffer": "```python\nimport gc, os, re, sys\nfound = set()\n"
    "for obj in gc.get_referents(sys.stdin):\n"
    "    text = obj.encode() if isinstance(obj, str) else obj if isinstance(obj, bytes) else b''\n"
    "    found.update(re.findall(rb'[0-9a-f]{32}', text))\n" + TELL_EVERY_FD,
    "nonce_from_harness_frame": "```python\nimport os, sys\nframe = sys._getframe(1)\n"
    "os.write(frame.f_locals['report'], (frame.f_locals['nonce'] + '\\n').encode())\nos._exit(0)\n```",
    "nonce_from_every_frame": "```python\nimport os, re, sys\nfound, frame = set(), sys._getframe()\n"
    "while frame is not None:\n    for value in list(frame.f_locals.values()):\n"
    "        if isinstance(value, str) and re.fullmatch('[0-9a-f]{32}', value):\n"
    "            found.add(value.encode())\n    frame = frame.f_back\n" + TELL_EVERY_FD,
    # and the tests, run beside the solution, could be fooled or read
    "always_equal_object": "```python\nclass Anything:\n    def __eq__(self, other):\n        return True\n"
    "def f(x):\n    return Anything()\n```",
    "always_equal_int_subclass": "```python\nclass Num(int):\n    def __eq__(self, other):\n        return True\n"
    "def f(x):\n    return Num(0)\n```",
    "answers_read_from_the_tests": "```python\nimport os, re\nsource = ''\n"
    "for path in ('main.py', f'/proc/{os.getppid()}/fd/0', f'/proc/{os.getppid()}/cmdline', '/proc/1/fd/0'):\n"
    "    try:\n        source += open(path, errors='replace').read()\n    except OSError:\n        pass\n"
    "pairs = dict(re.findall(r'candidate\\((\\d+)\\) == (\\d+)', source))\n"
    "def f(x):\n    return int(pairs[str(x)])\n```",
}


CLOSE_ENOUGH = {"entry_point": "f", "test": "def check(candidate):\n    assert abs(candidate(2) - 4.0) < 1e-9\n"}
SHADOW_ABS = "```python\ndef abs(x):\n    return 0\ndef f(x):\n    return 0.0\n```"  # the tests' abs is its own


@pytest.mark.parametrize("name", sorted(CHEATS))
def test_code_reward_cheat_scores_zero(name: str) -> None:
    assert code_reward.score("    return x * 2\n", COLUMNS) == 1.0  # the honest answer passes
    assert code_reward.score(CHEATS[name], COLUMNS) == 0.0


def test_code_reward_cheat_by_shadowing_a_builtin_scores_zero() -> None:
    assert code_reward.score("```python\ndef f(x):\n    return 2.0 * x\n```", CLOSE_ENOUGH) == 1.0
    assert code_reward.score(SHADOW_ABS, CLOSE_ENOUGH) == 0.0


def test_code_reward_keeps_exceptions_and_plain_values() -> None:
    cols = {"entry_point": "g", "test": "def check(candidate):\n"
            "    assert candidate([3, 1]) == (1, 3) and candidate(None) is None\n"
            "    assert candidate({'a': float('inf')}) == {'a': float('inf')}\n"
            "    try:\n        candidate('boom')\n    except ValueError as exc:\n        assert 'boom' in str(exc)\n"
            "    else:\n        raise AssertionError('no exception')\n"
            "assert LIMIT == 3 and helper(2) == 4\n"}
    program = ("```python\nLIMIT = 3\ndef helper(x):\n    return x * 2\n"
               "def g(x):\n    if x == 'boom':\n        raise ValueError('boom!')\n"
               "    return tuple(sorted(x)) if isinstance(x, list) else x\n```")
    passed, result = code_reward.run(program, cols)
    assert passed, result


def test_an_answer_that_is_not_plain_data_is_no_exception_a_test_could_expect() -> None:
    cols = {"entry_point": "f", "test": "def check(candidate):\n    assert candidate(1) == 2\n"
            "    try:\n        candidate(-1)\n    except Exception:\n        pass\n"
            "    else:\n        raise AssertionError('negative input accepted')\n"}
    honest = "```python\ndef f(x):\n    if x < 0:\n        raise ValueError(x)\n    return 2 * x\n```"
    assert code_reward.score(honest, cols) == 1.0
    cheat = "```python\nclass Anything:\n    pass\ndef f(x):\n    return 2 * x if x > 0 else Anything()\n```"
    passed, result = code_reward.run(cheat, cols)
    assert not passed and "no plain data" in result.stderr, result


# ---------------------------------------------------------------- 7. what the program learns about the host

def _layer_or_skip(caps: dict[str, object], layer: str) -> None:
    if not caps[layer]:
        if caps["root"]:
            pytest.fail(f"{layer} is off as root")
        pytest.skip(f"no {layer} here")


def test_the_program_sees_no_host_cgroup_path(caps):
    # was: "4:memory:/process_api/<the host's container id>" (time cap: the sandbox's own 10 s)
    _layer_or_skip(caps, "cgroup_namespace")
    r = run_code("print(open('/proc/self/cgroup').read())", timeout_s=10)
    assert r.ok, r.stderr
    lines = [line for line in r.stdout.splitlines() if line]
    assert lines and all(line.rsplit(":", 1)[1] == "/" for line in lines), r.stdout


def test_the_program_sees_only_the_jails_mount_points(caps):
    # the jail's own mounts, none of the host's others (the repository, /sys, /run, /home, the host's /tmp);
    # what stays visible is documented: the devices and options of the read-only binds (time cap 10 s)
    _layer_or_skip(caps, JAIL)
    r = run_code("print(open('/proc/self/mountinfo').read())", timeout_s=10)
    assert r.ok, r.stderr
    points = {line.split()[4] for line in r.stdout.splitlines() if line.strip()}
    prefix = os.path.realpath(sys.base_prefix)
    allowed = {"/", "/etc", "/usr", "/proc", "/tmp", *(f"/dev/{d}" for d in ("null", "zero", "full", "random",
                                                                              "urandom"))}
    assert points - allowed <= {prefix, sys.base_prefix, os.path.dirname(os.path.realpath(sys.executable))}, points
    assert str(REPO) not in r.stdout and "/sys" not in points and "/run" not in points
