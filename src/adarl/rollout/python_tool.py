"""A Python tool for the agent loop: the model's code runs in the code sandbox (rewards/sandbox).

    environment: python      one tool, `python(code)`: run the code, get back its stdout, its
                             stderr and, when it raised or passed its limits, the error

Each call is a fresh program in the sandbox (namespaces, a filesystem jail, a private uid,
seccomp, CPU / wall-clock / memory / file / process caps: rewards/sandbox/api.py); nothing
carries over from one call to the next, so the code must define everything it uses. The value
of a last bare expression is printed, as a notebook cell does (`sum(range(10))` shows 45).

What comes back is bounded: stdout's first MAX_STDOUT_CHARS characters, stderr's last
MAX_STDERR_CHARS (a traceback's end is what matters), an error line of at most MAX_ERROR_CHARS;
each cut is marked. A call whose code raised, exited non-zero, ran out of memory, was killed or
passed the time limit is a tool *error*: the tool raises `ExecutionError` with that text, which
the agent loop shows the model and records as a failed tool turn (`agent/errors/tool_error`,
the span's status "error", which RoC's p_err and CLEANER read). A sandbox that could not start
(its launcher died, the jail could not be built) is the environment's failure, not the code's:
the tool raises `EnvironmentFailure` and the rollout is censored, never scored.

Both parsers reach the tool: `parser: python` turns a fenced ```python block into a call of
`python` with that code; `parser: tool_call` takes {"name": "python", "arguments": {"code": ...}}.
Every problem row's `code` column, when it has one, is the tool's `demonstration` (SFT cold start).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from adarl.rewards import sandbox
from adarl.rollout.agent.environments import EnvironmentFailure
from adarl.rollout.agent.parsers import ToolCall

MAX_CODE_CHARS = 20_000  # longer code is refused (a tool error) before anything runs
MAX_STDOUT_CHARS = 4_000
MAX_STDERR_CHARS = 2_000
MAX_ERROR_CHARS = 500
_CUT = " ...[cut]"

# The sandbox's program: reads the model's code from stdin, runs it as a notebook cell does (the
# value of a last bare expression is printed), and on an exception prints a traceback of the
# code's own frames, then the error as its last stderr line, and exits with ERROR_EXIT.
ERROR_EXIT = 86
RUNNER = r"""
import ast, linecache, sys, traceback

source = sys.stdin.buffer.read().decode("utf-8", "replace")
sys.stdin = open("/dev/null")
linecache.cache["<code>"] = (len(source), None, source.splitlines(True), "<code>")
namespace = {"__name__": "__main__", "__builtins__": __builtins__}
try:
    tree = ast.parse(source, "<code>")
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    exec(compile(tree, "<code>", "exec"), namespace)
    if last is not None:
        value = eval(compile(ast.Expression(last.value), "<code>", "eval"), namespace)
        if value is not None:
            print(repr(value))
except SystemExit:
    raise
except BaseException as exc:
    sys.stdout.flush()
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != "<code>":
        tb = tb.tb_next
    report = traceback.TracebackException(type(exc), exc, tb)
    frames = list(report.stack.format())[-10:]
    context = list(report.format_exception_only())[:-1]  # a SyntaxError's line and caret
    message = " ".join(str(exc).split())[:400]
    error = type(exc).__name__ + (": " + message if message else "")
    head = "Traceback (most recent call last):\n" if frames else ""
    sys.stderr.write(head + "".join(frames) + "".join(context) + error + "\n")
    sys.stderr.flush()
    sys.exit(ERROR_EXIT)
""".replace("ERROR_EXIT", str(ERROR_EXIT))


class ExecutionError(Exception):
    """The model's code failed (raised, timed out, ran out of memory): a tool error the model reads."""


@dataclass
class PythonResult:
    """One run: what the code printed, and the error (None when it ran to its end)."""

    stdout: str
    stderr: str
    error: str | None

    def text(self) -> str:
        """The tool's answer: the error line first, then stdout and stderr (each only when not empty; their
        last newline dropped)."""
        parts = [] if self.error is None else [self.error]
        stdout, stderr = self.stdout.rstrip("\n"), self.stderr.rstrip("\n")
        if stdout:
            parts.append(stdout if self.error is None and not stderr else "stdout:\n" + stdout)
        if stderr:
            parts.append("stderr:\n" + stderr)
        return "\n".join(parts) if parts else "(no output)"


def _head(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + _CUT


def _tail(text: str, limit: int) -> str:
    return text if len(text) <= limit else "[cut]... " + text[-limit:]


def run_python(code: str, timeout_s: float = 5.0, memory_mb: int = 512) -> PythonResult:
    """Run `code` in the sandbox (`RUNNER`); EnvironmentFailure when the sandbox itself failed."""
    if len(code) > MAX_CODE_CHARS:
        return PythonResult("", "", f"the code is longer than {MAX_CODE_CHARS} characters")
    result = sandbox.run_code(RUNNER, timeout_s=timeout_s, memory_mb=memory_mb, max_file_mb=8, max_procs=16,
                              stdin=code.encode("utf-8", "replace"), max_output_bytes=64 << 10)
    if result.status == "sandbox_error":
        raise EnvironmentFailure(f"the code sandbox failed: {result.reason}")
    stdout, stderr = result.stdout, result.stderr
    error: str | None = None
    if result.status == "timeout":
        error = f"TimeoutError: the code ran past the {timeout_s:g} s limit ({result.reason})"
    elif result.status == "killed":
        error = f"the code was killed ({result.reason})"
    elif result.status == "error" and result.returncode == ERROR_EXIT:
        lines = stderr.rstrip("\n").rsplit("\n", 1)
        if not result.truncated:  # the runner's last line is the error
            stderr, error = (lines[0] if len(lines) == 2 else ""), lines[-1]
        else:
            error = "the code raised an exception (see stderr)"
        if error.startswith("MemoryError"):
            error += f" (the memory limit is {memory_mb} MB)"
    elif result.status == "error":
        error = f"SystemExit: the code exited with status {result.returncode}"
    return PythonResult(_head(stdout, MAX_STDOUT_CHARS), _tail(stderr, MAX_STDERR_CHARS),
                        None if error is None else _head(error, MAX_ERROR_CHARS))


class PythonInterpreter:
    """A built-in environment with one tool, `python(code)` (see the module docstring). The limits are
    class attributes: subclass to change them (and keep `rollout.agent.tool_timeout_s` above TIMEOUT_S
    plus a second of start-up, else a slow program censors the rollout instead of failing it)."""

    TIMEOUT_S = 5.0  # wall-clock and CPU seconds of one call
    MEMORY_MB = 512  # address space of the program

    def reset(self, **row: Any) -> None:
        return None

    def demonstration(self, code: str = "", **row: Any) -> list[ToolCall] | None:
        """The problem's gold `code` column as one call (for SFT cold start); None without one."""
        return [ToolCall("python", {"code": code})] if code else None

    def python(self, code: str) -> str:
        """Run Python code in a fresh sandbox (no files, no network); returns what it prints."""
        if not isinstance(code, str):
            raise ExecutionError(f"code must be a string, not {type(code).__name__}")
        result = run_python(code, self.TIMEOUT_S, self.MEMORY_MB)
        if result.error is not None:
            raise ExecutionError(result.text())
        return result.text()
