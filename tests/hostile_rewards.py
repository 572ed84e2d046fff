"""Reward functions that attack the reward worker pool itself (for tests/hostile/test_reward_pool_hostile.py).

Workers import them by reference, so they live at module level. Dataset columns carry their
parameters: `marker` is a string the test looks for in the command lines of leftover processes,
`path` a file the test checks was not created.
"""

from __future__ import annotations

import builtins
import contextlib
import os
import pickle
import signal
import struct
import subprocess
import sys
import threading
import time
from typing import Any

# ---------------------------------------------------------------- the result pipe


def _sockets() -> list[int]:
    """This process's socket fds: the worker's result pipe is one of them."""
    fds = []
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                fds.append(int(name))
        except OSError:
            continue
    return fds


def _write_sockets(data: bytes) -> None:
    for fd in _sockets():
        with contextlib.suppress(OSError):
            os.write(fd, data)


def forged_huge_header(prompts: list[Any], completions: list[str], **kw: Any) -> list[float]:
    """Announces a 2 GiB result on the result pipe, then scores as usual."""
    _write_sockets(struct.pack("!i", 2**31 - 1))
    return [1.0]


def forged_partial_frame(prompts: list[Any], completions: list[str], **kw: Any) -> list[float]:
    """Announces a 1000-byte result and sends 10 bytes of it."""
    _write_sockets(struct.pack("!i", 1000) + b"x" * 10)
    return [1.0]


def forged_oversized_frame(prompts: list[Any], completions: list[str], **kw: Any) -> list[float]:
    """Sends a complete 4 MiB frame of zeros."""
    _write_sockets(struct.pack("!i", 4 << 20) + bytes(4 << 20))
    return [1.0]


def forged_garbage_frame(prompts: list[Any], completions: list[str], **kw: Any) -> list[float]:
    """Sends a well-framed payload that is not a pickle."""
    _write_sockets(struct.pack("!i", 5) + b"hello")
    return [1.0]


class _OpensFile:
    """Unpickling this calls ``open(path, "w")``: code run by whoever loads it."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.path, "w"))


def forged_code_frame(prompts: list[Any], completions: list[str], path: list[str], **kw: Any) -> list[float]:
    """Sends a reply whose unpickling creates the file `path` in the process that reads it."""
    payload = pickle.dumps((0, "ok", _OpensFile(path[0])))
    _write_sockets(struct.pack("!i", len(payload)) + payload)
    return [1.0]


def stop_self_later(prompts: list[Any], completions: list[str], **kw: Any) -> list[float]:
    """Scores 1.0, then (after the reply is sent) stops its own process, which then reads no job."""
    threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGSTOP)).start()
    return [1.0]


# ---------------------------------------------------------------- processes that try to outlive the job


def _sleeper(marker: str) -> list[str]:
    return [sys.executable, "-c", "import time; time.sleep(600)", marker]


_CHAIN = "import os, time\nwhile True:\n    time.sleep(0.02)\n    if os.fork():\n        os._exit(0)\n    os.setsid()\n"


def setsid_child_then_hang(prompts: list[Any], completions: list[str], marker: list[str], **kw: Any) -> None:
    subprocess.Popen(_sleeper(marker[0]), start_new_session=True)
    time.sleep(600)


def _double_fork(marker: str) -> None:
    pid = os.fork()
    if pid == 0:
        try:
            os.setsid()
            if os.fork() == 0:
                os.execv(sys.executable, _sleeper(marker))
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


def double_fork_then_hang(prompts: list[Any], completions: list[str], marker: list[str], **kw: Any) -> None:
    _double_fork(marker[0])
    time.sleep(600)


def double_fork_then_return(prompts: list[Any], completions: list[str], marker: list[str],
                            **kw: Any) -> list[float]:
    _double_fork(marker[0])
    return [1.0]


def move_group_then_hang(prompts: list[Any], completions: list[str], marker: list[str], **kw: Any) -> None:
    """Starts a child in a new process group, then moves the worker itself into that group (a session
    leader may not: then the child is simply in a group of its own)."""
    child = subprocess.Popen(_sleeper(marker[0]), process_group=0)
    with contextlib.suppress(PermissionError):
        os.setpgid(0, child.pid)
    time.sleep(600)


def runaway_chain_then_hang(prompts: list[Any], completions: list[str], marker: list[str], **kw: Any) -> None:
    """A process that keeps forking a successor in a new session and exiting: its pid keeps moving."""
    subprocess.Popen([sys.executable, "-c", _CHAIN, marker[0]], start_new_session=True)
    time.sleep(600)


def daemon_then_return(prompts: list[Any], completions: list[str], marker: list[str], **kw: Any) -> list[float]:
    """Leaves a detached child behind and scores normally."""
    subprocess.Popen(_sleeper(marker[0]), start_new_session=True)
    return [1.0]


# ---------------------------------------------------------------- changing other rewards' scores


class _AlwaysOne(float):
    def __new__(cls, *args: Any) -> _AlwaysOne:
        return super().__new__(cls, 1.0)


def patch_float(prompts: list[Any], completions: list[str], **kw: Any) -> list[float]:
    """Makes ``float(anything)`` 1.0 in its process."""
    builtins.float = _AlwaysOne  # type: ignore[misc]
    return [0.0]


def patch_builtin_scorers(prompts: list[Any], completions: list[str], **kw: Any) -> list[float]:
    """Makes math-verify, the regex format check and every user function's checks score 1.0."""
    import adarl.rewards.callable as user_fn
    import adarl.rewards.format as format_reward
    import adarl.rewards.math as math_reward

    math_reward.score = lambda *a, **k: 1.0
    format_reward.score = lambda *a, **k: 1.0
    user_fn.to_score = lambda out: 1.0
    return [0.0]


def zero(prompts: list[Any], completions: list[str], **kw: Any) -> list[float]:
    return [0.0]


# ---------------------------------------------------------------- output


def prints(prompts: list[Any], completions: list[str], marker: list[str], **kw: Any) -> list[float]:
    print("stdout from the reward function", marker[0])
    print("stderr from the reward function", marker[0], file=sys.stderr)
    return [1.0]


def writes_fds(prompts: list[Any], completions: list[str], marker: list[str], **kw: Any) -> list[float]:
    os.write(1, f"raw fd 1 {marker[0]}\n".encode())
    os.write(2, f"raw fd 2 {marker[0]}\n".encode())
    return [1.0]


def child_prints(prompts: list[Any], completions: list[str], marker: list[str], **kw: Any) -> list[float]:
    subprocess.run(["echo", "child", marker[0]], check=True)
    subprocess.run(["sh", "-c", f"echo child-err {marker[0]} >&2"], check=True)
    return [1.0]


def floods_then_raises(prompts: list[Any], completions: list[str], marker: list[str], **kw: Any) -> None:
    sys.stdout.write("x" * (1 << 20) + "\n")
    print("LAST WORDS", marker[0], "\x1b[2J\x1b[31m", flush=True)
    raise ValueError("flooded")


class _Escapes(Exception):
    def __repr__(self) -> str:
        return "\x1b[2J\x1b[31mFAKE adarl ERROR\nsecond line\r"


def raises_escapes(prompts: list[Any], completions: list[str], **kw: Any) -> None:
    raise _Escapes()


def writes_tty(prompts: list[Any], completions: list[str], marker: list[str], **kw: Any) -> list[float]:
    """Writes to the controlling terminal, if it can open one; scores whether it could."""
    try:
        with open("/dev/tty", "w") as tty:
            tty.write(f"tty {marker[0]}\n")
    except OSError:
        return [0.0]
    return [1.0]


_SHARED: dict[str, bool] = {}  # module state two functions of this module could share in one process


def sets_shared_flag(prompts: list[Any], completions: list[str], **kw: Any) -> list[float]:
    _SHARED["everything_is_correct"] = True
    return [0.0]


def reads_shared_flag(prompts: list[Any], completions: list[str], **kw: Any) -> list[float]:
    return [1.0 if _SHARED.get("everything_is_correct") else 0.0]
