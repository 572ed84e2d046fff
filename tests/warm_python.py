"""`python -m MODULE ...` from a warm parent: one import of torch and transformers serving many processes.

A cold `python -m adarl.cli train` on the tiny model spends most of its life importing torch, transformers,
pandas and the rest (about 3-5 s of CPU on 2 cores) before its first step; a test that starts thirty of them
(the SIGKILL crash trials, tests/train/test_crash.py) spends minutes on imports alone. `WarmPython` starts
one server process that imports those libraries once, then forks a child for each run. The child is a real
process of its own: its own pid, environment, working directory and standard streams, its own exit status,
and a SIGKILL (ADARL_TEST_KILL) ends it and nothing else. It runs the module as `python -m` does
(`runpy.run_module(..., run_name="__main__")`, the working directory and PYTHONPATH first on sys.path), then
ends as an interpreter does: non-daemon threads joined, atexit handlers run, streams flushed.

The server imports third-party libraries only, and no code runs in it (no torch op, no thread started), so a
fork copies nothing that a fresh process would not have: adarl's own modules are imported by each child,
after its environment is set, so what they read at import (ADARL_TEST_KILL in train/checkpoint.py) is the
child's. Libraries that read the environment at import (HF_HUB_OFFLINE, OMP_NUM_THREADS) read the server's,
which is the suite's (tests/conftest.py) with OMP_NUM_THREADS=1, what every caller here sets.

Use it through the session fixture `warm_python` (tests/conftest.py): `warm_python.run_module("adarl.cli",
["train", ...], env=env, cwd=ROOT, timeout=300)` answers a `subprocess.CompletedProcess` like
`subprocess.run([sys.executable, "-m", "adarl.cli", "train", ...], stdout=PIPE, stderr=STDOUT, text=True)`;
`run_script(path, args, ...)` is `python path args`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

#: imported once by the server (what `adarl train` on the tiny model imports, less adarl itself)
PRELOAD = ("numpy", "pandas", "pyarrow", "pyarrow.parquet", "yaml", "pydantic", "typer", "rich", "jinja2", "sympy",
           "matplotlib", "torch", "torch.nn.functional", "torch.distributed", "torch.utils.tensorboard",
           "safetensors.torch", "tokenizers", "huggingface_hub", "accelerate", "transformers",
           "transformers.models.llama.modeling_llama", "transformers.models.auto.modeling_auto",
           "transformers.models.auto.tokenization_auto")


class WarmPython:
    """A client of one warm server (one run at a time)."""

    def __init__(self) -> None:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "ADARL_TEST_OWNER")}
        env["OMP_NUM_THREADS"] = "1"
        self._proc = subprocess.Popen([sys.executable, "-u", __file__, "--serve"], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, env=env, text=True, cwd="/")
        ready = self._proc.stdout.readline()
        if ready.strip() != "ready":
            raise RuntimeError(f"the warm python server did not start: {ready!r}")

    def run_module(self, module: str, args: list[str], *, env: dict[str, str], cwd: str | Path,
                   timeout: float, stderr_apart: bool = False) -> subprocess.CompletedProcess:
        """`python -m module *args` in `cwd` with exactly `env`, as text: stdout and stderr together (as
        `stderr=subprocess.STDOUT`), or apart with `stderr_apart` (as `capture_output=True`)."""
        return self._run({"module": module}, [sys.executable, "-m", module], args, env, cwd, timeout, stderr_apart)

    def run_script(self, script: str | Path, args: list[str], *, env: dict[str, str], cwd: str | Path,
                   timeout: float, stderr_apart: bool = False) -> subprocess.CompletedProcess:
        """`python script *args`, as `run_module` (the script's folder first on sys.path, as python puts it)."""
        script = str(Path(script).resolve())
        return self._run({"script": script}, [sys.executable, script], args, env, cwd, timeout, stderr_apart)

    def _run(self, what: dict, head: list[str], args: list[str], env: dict[str, str], cwd: str | Path,
             timeout: float, stderr_apart: bool) -> subprocess.CompletedProcess:
        with tempfile.TemporaryDirectory() as tmp:
            out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
            request = {**what, "args": [str(a) for a in args], "env": env, "cwd": str(cwd), "out": str(out),
                       "err": str(err if stderr_apart else out), "timeout": timeout}
            out.touch()
            err.touch()
            self._proc.stdin.write(json.dumps(request) + "\n")
            self._proc.stdin.flush()
            answer = json.loads(self._proc.stdout.readline())
            stdout = out.read_text(errors="replace")
            stderr = err.read_text(errors="replace") if stderr_apart else None
        argv = [*head, *request["args"]]
        if answer["timed_out"]:
            raise subprocess.TimeoutExpired(argv, timeout, output=stdout, stderr=stderr)
        return subprocess.CompletedProcess(argv, answer["returncode"], stdout=stdout, stderr=stderr)

    def close(self) -> None:
        self._proc.stdin.close()  # the server's loop ends
        self._proc.wait(timeout=30)
        self._proc.stdout.close()


# ---------------------------------------------------------------- the server side


def _child(request: dict) -> None:
    """In the forked child: become `python -m module args` and end as an interpreter ends. Never returns."""
    code = 1
    try:
        for target, path in ((1, request["out"]), (2, request["err"])):
            fd = os.open(path, os.O_WRONLY | os.O_APPEND)  # the same file for both: appends interleave as a pipe
            os.dup2(fd, target)
            os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        sys.stdin = open(0, closefd=False)  # noqa: SIM115
        sys.stdout = open(1, "w", closefd=False, buffering=1)  # noqa: SIM115
        sys.stderr = open(2, "w", closefd=False, buffering=1)  # noqa: SIM115
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        paths = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
        first = str(Path(request["script"]).parent) if "script" in request else os.getcwd()
        sys.path[:0] = [first, *paths]  # what `python script` / `python -m` puts first
        import random

        import numpy as np

        random.seed()  # a fresh process draws its own seeds; the fork copied the server's
        np.random.seed()
        import runpy

        try:
            if "script" in request:
                sys.argv = [request["script"], *request["args"]]
                runpy.run_path(request["script"], run_name="__main__")
            else:
                sys.argv = [request["module"], *request["args"]]
                runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            if e.code is None:
                code = 0
            elif isinstance(e.code, int):
                code = e.code
            else:
                print(e.code, file=sys.stderr)
                code = 1
        except BaseException:  # noqa: BLE001
            import traceback

            traceback.print_exc()
            code = 1
        import atexit
        import threading

        threading._shutdown()  # what the interpreter does at exit: join non-daemon threads, then atexit
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def _serve() -> None:
    import importlib
    import select
    import signal

    sys.path[:] = [p for p in sys.path if p and Path(p).resolve() != Path(__file__).resolve().parent]
    for name in PRELOAD:
        importlib.import_module(name)
    control = sys.stdout
    control.write("ready\n")
    control.flush()
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(request)
        pidfd = os.pidfd_open(pid)
        timed_out = not select.select([pidfd], [], [], request["timeout"])[0]
        if timed_out:
            os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        os.close(pidfd)
        control.write(json.dumps({"returncode": os.waitstatus_to_exitcode(status), "timed_out": timed_out}) + "\n")
        control.flush()


if __name__ == "__main__" and sys.argv[1:] == ["--serve"]:
    _serve()
