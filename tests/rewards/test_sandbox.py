"""The code sandbox (adarl.rewards.sandbox): what a program can do, and the escapes that must fail.

Every escape case runs a program that tries one thing it must not be able to do and prints
``ESCAPED`` if it succeeded; the host side then checks that nothing happened (no file written
outside, the listener got no connection, the decoy process is alive, no process is left over).
A case that needs a protection layer this machine lacks is skipped with the layer's name, so a
weaker machine shows exactly what is unprotected (`sandbox_capabilities`).
"""

from __future__ import annotations

import functools
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from adarl.rewards.sandbox import UID_BASE, SandboxResult, run_code, sandbox_capabilities

pytestmark = [pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox needs Linux"),
              pytest.mark.heavy]

REPO = Path(__file__).resolve().parents[2]
SECRET = "adarl-secret-" + uuid.uuid4().hex
MARKER = "adarl-escape-marker-" + uuid.uuid4().hex  # in the argv of every process a case spawns


def leftovers() -> list[str]:
    """Processes a sandbox of this test session left behind (launcher, init, program, children).

    Every sandbox here gets MARKER as an argument: it is in the launcher's command line (and so in
    its forked init's) and in the program's, whose forks inherit it; spawned children add it too.
    """
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{name}/stat") as f:
                state = f.read().rpartition(")")[2].split()[0]
        except OSError:
            continue
        if MARKER in cmd and state != "Z":
            found.append(f"{name} {cmd[:160]}")
    return found


def sandboxed(code: str, **kwargs: object) -> SandboxResult:
    """`run_code` with this session's marker in the program's argv."""
    return run_code(code, args=[MARKER], **kwargs)  # type: ignore[arg-type]


@pytest.fixture(autouse=True)
def no_leftover_processes() -> Iterator[None]:
    yield
    deadline = time.monotonic() + 3
    while leftovers() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert leftovers() == []


@pytest.fixture(scope="module")
def caps() -> dict[str, object]:
    return sandbox_capabilities()


@dataclass
class Host:
    """What the host side of an escape test prepared."""

    tmp: Path
    secret_file: Path
    outside: Path
    port: int
    unix_path: Path
    abstract: str
    decoy_pid: int
    accepted: list[int] = field(default_factory=list)


@pytest.fixture
def host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Host]:
    monkeypatch.setenv("ADARL_TEST_SECRET", SECRET)
    secret_file = tmp_path / "secret.txt"
    secret_file.write_text(SECRET)
    secret_file.chmod(0o600)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(0.05)
    unix = socket.socket(socket.AF_UNIX)
    unix_path = tmp_path / "host.sock"
    unix.bind(str(unix_path))
    unix.listen(8)
    abstract = "adarl-test-" + uuid.uuid4().hex
    abstract_sock = socket.socket(socket.AF_UNIX)
    abstract_sock.bind("\0" + abstract)
    abstract_sock.listen(8)
    for s in (unix, abstract_sock):
        s.settimeout(0.05)
    decoy = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    state = Host(tmp=tmp_path, secret_file=secret_file, outside=Path("/tmp") / f"adarl-outside-{uuid.uuid4().hex}",
                 port=listener.getsockname()[1], unix_path=unix_path, abstract=abstract, decoy_pid=decoy.pid)
    try:
        yield state
    finally:
        for s in (listener, unix, abstract_sock):
            try:
                conn, _ = s.accept()
                state.accepted.append(1)
                conn.close()
            except OSError:
                pass
            s.close()
        assert state.accepted == [], "a socket of the host accepted a connection from the sandbox"
        assert decoy.poll() is None, "the host's decoy process was killed"
        decoy.kill()
        decoy.wait()
        state.outside.unlink(missing_ok=True)


@dataclass(frozen=True)
class Escape:
    name: str
    code: str
    needs: tuple[str, ...] = ()  # sandbox layers this protection relies on
    timeout_s: float = 3.0
    statuses: tuple[str, ...] = ()  # allowed statuses (any if empty)
    check: Callable[[SandboxResult, Host], None] | None = None
    kwargs: dict[str, object] = field(default_factory=dict)


def fill(code: str, h: Host) -> str:
    values = {"SECRET_FILE": str(h.secret_file), "TMP": str(h.tmp), "OUTSIDE": str(h.outside), "PORT": str(h.port),
              "UNIX": str(h.unix_path), "ABSTRACT": h.abstract, "DECOY": str(h.decoy_pid), "REPO": str(REPO),
              "MARKER": MARKER, "HOST_PID": str(os.getpid())}
    for key, value in values.items():
        code = code.replace(f"@{key}@", value)
    return code


def try_(body: str) -> str:
    """A program that prints ESCAPED when `body` runs without raising."""
    indented = "\n".join("    " + line for line in body.strip().splitlines())
    return f"try:\n{indented}\nexcept BaseException as exc:\n    print('blocked:', type(exc).__name__, exc)\n" \
           f"else:\n    print('ESCAPED')\n"


def not_on_host(path: str) -> Callable[[SandboxResult, Host], None]:
    def check(result: SandboxResult, h: Host) -> None:
        assert not Path(fill(path, h)).exists()
    return check


def secret_not_printed(result: SandboxResult, h: Host) -> None:
    assert SECRET not in result.stdout + result.stderr


def quick(limit_s: float) -> Callable[[SandboxResult, Host], None]:
    def check(result: SandboxResult, h: Host) -> None:
        assert result.duration < limit_s, result
    return check


NET, PIDNS, JAIL, UID = "network_namespace", "pid_namespace", "filesystem_jail", "private_uid"
KILLABLE = (PIDNS, UID)  # a case that signals other processes is only run when it cannot hit the host's

SPAWN_DETACHED = ("subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)', '@MARKER@'],"
                  " start_new_session=True)\n")

ESCAPES = [
    # ---------------------------------------------------------------- network
    Escape("connect_loopback_listener", try_(
        "import socket; socket.create_connection(('127.0.0.1', @PORT@), timeout=1)"), (NET,)),
    Escape("connect_test_net_address", try_(
        "import socket; socket.create_connection(('192.0.2.1', 80), timeout=1)"), (NET,), check=quick(2.5)),
    Escape("udp_sendto_external", try_(
        "import socket; socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', ('192.0.2.1', 53))"), (NET,)),
    Escape("dns_lookup", try_("import socket; socket.getaddrinfo('example.com', 80)"), (NET,), check=quick(2.5)),
    Escape("connect_ipv6_loopback", try_(
        "import socket; socket.create_connection(('::1', @PORT@), timeout=1)"), (NET,)),
    Escape("connect_abstract_unix_socket", try_(
        "import socket; s = socket.socket(socket.AF_UNIX); s.connect('\\0@ABSTRACT@')"), (NET,)),
    Escape("connect_unix_socket_file", try_(
        "import socket; s = socket.socket(socket.AF_UNIX); s.connect('@UNIX@')"), (JAIL,)),
    Escape("raw_socket", try_("import socket; socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)"),
           (UID,)),
    Escape("bring_loopback_up", try_(
        "import fcntl, socket, struct\n"
        "s = socket.socket()\n"
        "fcntl.ioctl(s, 0x8914, struct.pack('16sH22x', b'lo', 1))  # SIOCSIFFLAGS IFF_UP"), (UID,)),
    # ---------------------------------------------------------------- filesystem
    Escape("write_host_tmp", "open('@OUTSIDE@', 'w').write('x')", (JAIL,), check=not_on_host("@OUTSIDE@")),
    Escape("write_into_repo", try_("open('@REPO@/adarl-escape-" + uuid.uuid4().hex[:8] + "', 'w').write('x')"), (UID,),
           check=lambda r, h: not any(p.name.startswith("adarl-escape-") for p in REPO.iterdir())),
    Escape("write_parent_home", try_("open('/root/adarl-escape', 'w').write('x')"), (UID,),
           check=not_on_host("/root/adarl-escape")),
    Escape("write_system_dirs", try_("open('/etc/adarl-escape', 'w').write('x')") + try_(
        "open('/usr/adarl-escape', 'w').write('x')"), (UID,),
           check=lambda r, h: not Path("/etc/adarl-escape").exists() and not Path("/usr/adarl-escape").exists()),
    Escape("overwrite_etc_passwd", try_("open('/etc/passwd', 'a').write('evil::0:0::/:/bin/sh\\n')"), (UID,)),
    Escape("write_dev_shm", "import os\nos.makedirs('/dev/shm', exist_ok=True)\n"
           "open('/dev/shm/adarl-escape-@DECOY@', 'w').write('x')", (JAIL,),
           check=not_on_host("/dev/shm/adarl-escape-@DECOY@")),
    Escape("read_root_bashrc", try_("print(open('/root/.bashrc').read()[:1])"), (UID,)),
    Escape("read_secret_in_parent_tmp", try_("print(open('@SECRET_FILE@').read())"), (UID,), check=secret_not_printed),
    Escape("read_repo_source", try_("print(open('@REPO@/pyproject.toml').read()[:1])"), (JAIL,)),
    Escape("list_parent_tmp_dir", try_("import os; print(os.listdir('@TMP@'))"), (JAIL,)),
    Escape("symlink_to_secret", try_("import os; os.symlink('@SECRET_FILE@', 'link'); print(open('link').read())"),
           (UID,), check=secret_not_printed),
    Escape("symlink_to_root_home", try_("import os; os.symlink('/root/.bashrc', 'r'); print(open('r').read()[:1])"),
           (UID,)),
    Escape("hardlink_to_secret", try_("import os; os.link('@SECRET_FILE@', 'x'); print(open('x').read())"), (UID,),
           check=secret_not_printed),
    Escape("proc_root_of_init", try_("print(open('/proc/1/root/root/.bashrc').read()[:1])"), (UID,)),
    Escape("mount_host_disk", try_(
        "import ctypes; libc = ctypes.CDLL(None, use_errno=True)\n"
        "assert libc.mount(b'tmpfs', b'/tmp', b'tmpfs', 0, None) == 0, ctypes.get_errno()"), (UID,)),
    Escape("chroot", try_("import os; os.chroot('/tmp')"), (UID,)),
    Escape("mknod_disk_device", try_("import os, stat; os.mknod('vda', stat.S_IFBLK | 0o600, os.makedev(254, 0))"),
           (UID,)),
    Escape("write_proc_sys", try_("open('/proc/sys/kernel/hostname', 'w').write('pwned')"), (UID,),
           check=lambda r, h: socket.gethostname() != "pwned"),
    # ---------------------------------------------------------------- environment and processes
    Escape("read_parent_env", "import os\nprint(dict(os.environ))\nprint(os.environ.get('ADARL_TEST_SECRET'))",
           check=secret_not_printed),
    Escape("read_every_proc_environ", "import os\n"
           "for p in os.listdir('/proc'):\n"
           "    try:\n        print(open(f'/proc/{p}/environ', 'rb').read())\n"
           "    except OSError:\n        pass", check=secret_not_printed),
    Escape("read_host_pid_environ", try_("print(open('/proc/@HOST_PID@/environ', 'rb').read())"), (PIDNS,),
           check=secret_not_printed),
    Escape("inherited_file_descriptors", "import fcntl\nalive = []\n"
           "for fd in range(3, 1024):\n"
           "    try:\n        fcntl.fcntl(fd, fcntl.F_GETFD)\n        alive.append(fd)\n"
           "    except OSError:\n        pass\n"
           "print('ESCAPED' if alive else 'no inherited fds', alive)"),
    Escape("kill_parent", try_("import os, signal; os.kill(os.getppid(), signal.SIGKILL)"), KILLABLE),
    Escape("kill_pid_1", try_("import os, signal; os.kill(1, signal.SIGKILL)"), KILLABLE),
    Escape("kill_host_process_by_pid", try_("import os, signal; os.kill(@DECOY@, signal.SIGKILL)"), KILLABLE),
    Escape("kill_everything", try_("import os, signal; os.kill(-1, signal.SIGKILL)"), KILLABLE),
    Escape("ptrace_attach_init", try_(
        "import ctypes; libc = ctypes.CDLL(None, use_errno=True)\n"
        "assert libc.ptrace(16, 1, None, None) == 0, ctypes.get_errno()  # PTRACE_ATTACH"), (UID,)),
    Escape("read_init_memory", try_("f = open('/proc/1/mem', 'rb'); f.seek(0x400000); f.read(16)"), (UID,)),
    Escape("setuid_root", try_("import os; os.setuid(0)"), (UID,)),
    Escape("sethostname", try_("import socket; socket.sethostname('pwned')"), (UID,),
           check=lambda r, h: socket.gethostname() != "pwned"),
    Escape("raise_rlimits_back_up", "import resource\n" + "\n".join(try_(
        f"resource.setrlimit(resource.{lim}, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))")
        for lim in ("RLIMIT_AS", "RLIMIT_CPU", "RLIMIT_NPROC", "RLIMIT_FSIZE", "RLIMIT_NOFILE"))),
    Escape("setuid_binary", try_(
        "import subprocess\n"
        "out = subprocess.run(['su', '-c', 'id -u'], capture_output=True, text=True, timeout=2).stdout\n"
        "assert out.strip() == '0'"), (UID,)),
    # ---------------------------------------------------------------- resource exhaustion
    Escape("fork_bomb", "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
           timeout_s=2.0, statuses=("timeout", "error", "killed"), check=quick(4.0), kwargs={"max_procs": 16}),
    Escape("thread_bomb", "import threading, time\nn = 0\n"
           "try:\n    while True:\n"
           "        threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n        n += 1\n"
           "except RuntimeError:\n    pass\nprint('threads', n)\nprint('ESCAPED' if n >= 16 else 'bounded')",
           timeout_s=3.0, kwargs={"max_procs": 16}),
    Escape("memory_bomb", "x = bytearray(8 << 30)\nprint('ESCAPED')", statuses=("error",),
           check=lambda r, h: "MemoryError" in r.stderr),
    Escape("slow_memory_bomb", "blocks = []\nwhile True:\n    blocks.append(bytearray(64 << 20))",
           statuses=("error", "killed"), check=lambda r, h: r.duration < 3.0),
    Escape("huge_file", try_("open('big', 'wb').write(b'x' * (64 << 20))"), statuses=("ok",)),
    Escape("disk_exhaustion", "import os\ntotal = 0\n"
           "for i in range(1000):\n"
           "    try:\n        with open(f'f{i}', 'wb') as f:\n            f.write(b'x' * (4 << 20))\n"
           "        total += 4\n"
           "    except OSError:\n        break\n"
           "print('MB', total)\nprint('ESCAPED' if total > 16 else 'bounded')",
           (JAIL,), kwargs={"max_file_mb": 4, "disk_mb": 16}),
    Escape("too_many_open_files", "fs = []\ntry:\n    while True:\n        fs.append(open('/dev/null'))\n"
           "except OSError:\n    pass\nprint('ESCAPED' if len(fs) > 64 else 'bounded')", kwargs={"max_open_files": 64}),
    Escape("infinite_loop", "while True:\n    pass", timeout_s=1.5, statuses=("timeout",), check=quick(3.0)),
    Escape("ignore_signals_and_loop", "import signal\n"
           "for s in (signal.SIGTERM, signal.SIGXCPU, signal.SIGINT, signal.SIGHUP):\n"
           "    signal.signal(s, signal.SIG_IGN)\n"
           "while True:\n    pass", timeout_s=1.5, statuses=("timeout",), check=quick(3.0)),
    Escape("sleep_forever", "import time\ntime.sleep(10_000)", timeout_s=1.0, statuses=("timeout",), check=quick(2.5)),
    Escape("detached_child_outlives_program",
           "import os, subprocess, sys\n" + SPAWN_DETACHED +
           "if os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
           "        os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(600)', '@MARKER@'])\n"
           "    os._exit(0)\n"
           "print('spawned')", statuses=("ok",)),
    Escape("detached_child_then_hang",
           "import subprocess, sys, time\n" + SPAWN_DETACHED + "time.sleep(600)", timeout_s=1.0, statuses=("timeout",)),
    Escape("output_bomb", "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)", timeout_s=1.0,
           statuses=("timeout",), check=lambda r, h: r.truncated and len(r.stdout) <= 64 * 1024),
]


def test_there_are_at_least_30_escapes() -> None:
    assert len(ESCAPES) >= 30
    assert len({e.name for e in ESCAPES}) == len(ESCAPES)


@pytest.mark.parametrize("case", ESCAPES, ids=[e.name for e in ESCAPES])
def test_escape_fails(case: Escape, host: Host, caps: dict[str, object]) -> None:
    missing = [layer for layer in case.needs if not caps.get(layer)]
    if case.needs == KILLABLE and len(missing) < len(KILLABLE):
        missing = []  # either layer keeps the signal inside the sandbox
    if missing:
        pytest.skip(f"this machine's sandbox lacks {', '.join(missing)}")
    result = sandboxed(fill(case.code, host), timeout_s=case.timeout_s, **case.kwargs)  # type: ignore[arg-type]
    assert result.status != "sandbox_error", result.reason
    assert "ESCAPED" not in result.stdout, result
    if case.statuses:
        assert result.status in case.statuses, result
    assert result.duration < case.timeout_s + 1.5, result
    if case.check is not None:
        case.check(result, host)


# ---------------------------------------------------------------- what a program can do


def test_capabilities_on_this_machine(caps: dict[str, object]) -> None:
    assert caps["rlimits"] and caps["no_new_privs"]
    assert "error" not in caps, caps
    if caps["root"]:  # CI runs as root on a Linux VM: the whole sandbox must be there
        for layer in ("network_namespace", "pid_namespace", "mount_namespace", "filesystem_jail",
                      "cgroup_namespace", "private_uid", "nproc_limit", "disk_quota"):
            assert caps[layer], layer


def test_ok_error_stdin_and_output() -> None:
    r = sandboxed("import sys\ndata = sys.stdin.read()\nprint(data.upper())\nprint('warn', file=sys.stderr)",
                 stdin="hello sandbox")
    assert (r.status, r.returncode, r.stdout, r.stderr) == ("ok", 0, "HELLO SANDBOX\n", "warn\n")
    assert r.ok and r.cpu_s is not None and r.duration < 5
    r = sandboxed("raise SystemExit(3)")
    assert (r.status, r.returncode) == ("error", 3)
    r = sandboxed("def f(:\n  pass")
    assert r.status == "error" and "SyntaxError" in r.stderr
    r = sandboxed("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    assert (r.status, r.returncode, r.reason) == ("killed", -signal.SIGSEGV, "SIGSEGV")
    r = sandboxed("print('x' * 100_000)", max_output_bytes=1000)
    assert r.truncated and r.stdout == "x" * 1000


def test_the_program_works_in_its_own_directory(caps: dict[str, object]) -> None:
    r = sandboxed("import os, json, subprocess, sys\n"
                 "open('data.txt', 'w').write('kept')\n"
                 "out = subprocess.run([sys.executable, '-c', 'print(6 * 7)'], capture_output=True, text=True).stdout\n"
                 "print(json.dumps({'cwd': os.getcwd(), 'home': os.environ['HOME'], 'files': os.listdir('.'),\n"
                 "                  'uid': os.getuid(), 'child': out.strip(), 'env': sorted(os.environ)}))")
    assert r.ok, r
    import json

    info = json.loads(r.stdout)
    assert info["child"] == "42" and "data.txt" in info["files"] and info["home"] == info["cwd"]
    assert set(info["env"]) <= {"PATH", "LANG", "LC_ALL", "HOME", "TMPDIR", "LC_CTYPE"}
    if caps["filesystem_jail"]:
        assert info["cwd"] == "/tmp" and sorted(info["files"]) == ["data.txt", "main.py"]
    if caps["private_uid"]:
        assert info["uid"] >= UID_BASE


def test_concurrent_sandboxes_are_separate() -> None:
    results: list[SandboxResult] = []
    code = ("import os, time\nopen('mine', 'w').write(str(os.getuid()))\ntime.sleep(0.3)\n"
            "print(sorted(os.listdir('.')), os.getuid())")
    threads = [threading.Thread(target=lambda: results.append(sandboxed(code))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.status for r in results] == ["ok"] * 3
    assert all(r.stdout.startswith("['main.py', 'mine']") for r in results)  # each sees only its own files
    if os.geteuid() == 0:
        assert len({r.stdout for r in results}) == 3  # each its own uid


def test_killing_the_caller_kills_the_sandbox() -> None:
    """A reward worker killed mid-job (its pool timeout) takes its sandbox down with it."""
    from adarl.rewards.pool import WorkerPool

    code = ("import subprocess, sys, time\n"
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)', '@MARKER@'],"
            " start_new_session=True)\n"
            "time.sleep(600)").replace("@MARKER@", MARKER)
    with WorkerPool(workers=1, timeout_s=1.5) as pool:
        start = time.monotonic()
        job = functools.partial(run_code, args=[MARKER])  # run_code's own limit (5 s) is longer
        [(value, status)] = pool.map(job, [(code,)])
        assert status == "timeout" and time.monotonic() - start < 4
    # the autouse fixture checks that the launcher, the program and its detached child are gone


def test_degraded_mode_without_namespaces(host: Host) -> None:
    """Without namespaces the private uid and the rlimits still hold (as root), and leftovers die by uid."""
    if os.geteuid() != 0:
        pytest.skip("the private uid needs root")
    r = sandboxed(fill("import os\nprint(os.getuid())\n" + try_("print(open('@SECRET_FILE@').read())")
                      + try_("print(open('/root/.bashrc').read())") + try_("os.kill(@DECOY@, 9)"), host),
                 namespaces=False)
    assert r.ok and "ESCAPED" not in r.stdout and SECRET not in r.stdout, r
    assert not r.layers["network_namespace"] and r.layers["private_uid"]
    r = sandboxed(fill("import subprocess, sys\n"
                      "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)', '@MARKER@'],"
                      " start_new_session=True)", host), namespaces=False)
    assert r.ok
    r = sandboxed("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
                 timeout_s=1.5, max_procs=8, namespaces=False)
    assert r.status == "timeout" and r.duration < 3
