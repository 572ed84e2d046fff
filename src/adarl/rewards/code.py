"""Code rewards: run the program a completion writes against the problem's tests, in the sandbox.

The problem's columns carry the tests: ``test`` (Python source that raises, or exits non-zero,
when the program is wrong), optionally ``entry_point`` (the function under test; when ``test``
defines ``check``, ``check(entry_point)`` is called, as in HumanEval) and ``prompt_code`` (code
given in the prompt: imports, helpers and the function's signature and docstring).

The program is the last fenced code block of the completion (```` ```python ````, ```` ```py ````
or a bare fence), else the raw completion. If it defines ``entry_point`` it replaces the stub in
``prompt_code`` (the prompt is run first, so its imports and helpers exist); otherwise it is read
as the continuation of ``prompt_code`` (the function's body), as HumanEval's own harness does.

Scoring runs `sandbox.run_code` from a reward worker: 1.0 iff the tests pass. The sandbox's
program is a judge (`JUDGE`) that runs the prompt's code and the tests; the model's code runs
in a second process, the solver, which the judge calls for every function the tests use, with
arguments and results crossing a pipe as plain data (`marshal`: None, numbers, strings, bytes,
tuples, lists, dicts, sets). The judge exits 0 only past the tests. There is no secret to steal:
the model's code never runs in the judge's process, cannot read its memory (the judge is not
dumpable; the sandbox refuses ptrace), and cannot read the tests (the judge forks the solver
before it reads them from its stdin). An object whose ``__eq__`` always returns True is not plain data, so
it fails too. A wrong, crashing, hanging or memory-hungry program scores 0.0 (a wrong answer,
not a verifier failure); only a sandbox that cannot start raises `ScoringFailure`: the rollout is
censored (left out of its group, counted in `reward_censored`), never scored 0.

Limits of the split: the tests can pass only plain data to the model's functions and get only
plain data back (a test that passes a lambda, or expects a generator or an instance of the
model's class, fails); a global of the model's program that the prompt also defines keeps the
prompt's definition (except ``entry_point``), and one named like a builtin (``abs``, ``len``)
is not seen by the tests; and the model can still special-case inputs it has memorised.
"""

from __future__ import annotations

import re
from typing import Any

from adarl.rewards import sandbox
from adarl.rewards.callable import ScoringFailure

MAX_PROGRAM_CHARS = 100_000  # longer completions are cut (the sandbox needs no more to say "wrong")

_FENCE = re.compile(r"```[ \t]*(?P<lang>[\w+-]*)[ \t]*\r?\n(?P<body>.*?)(?:```|\Z)", re.DOTALL)
_PYTHON_LANGS = {"python", "python3", "py", "py3", ""}


def extract_program(completion: str) -> str:
    """The program in a completion: the last Python (or untagged) fenced block, else the whole text.

    An unclosed final fence (a completion cut at the token limit) still counts as a block.
    """
    blocks = [(m["lang"].lower(), m["body"]) for m in _FENCE.finditer(completion)]
    python = [body for lang, body in blocks if lang in _PYTHON_LANGS]
    if python:
        return python[-1]
    return completion


def defines(program: str, name: str) -> bool:
    """Whether `program` has a top-level ``def name(`` (or ``async def``)."""
    return re.search(rf"^(?:async\s+)?def\s+{re.escape(name)}\s*\(", program, re.MULTILINE) is not None


def build_solution(completion: str, columns: dict[str, Any]) -> str:
    """The model's side of the test program: the prompt's code, then the model's code."""
    program = extract_program(completion[:MAX_PROGRAM_CHARS])
    prompt_code = str(columns.get("prompt_code") or "")
    entry_point = columns.get("entry_point")
    if entry_point and prompt_code and not defines(program, str(entry_point)):
        return prompt_code + program  # a body continuing the prompt's function
    if prompt_code:
        return prompt_code + "\n\n" + program
    return program


def _checks(columns: dict[str, Any]) -> bool:
    return bool(columns.get("entry_point")) and defines(str(columns.get("test") or ""), "check")


def build_program(completion: str, columns: dict[str, Any]) -> str:
    """The whole test program as one file: the solution, the tests, ``check(entry_point)``.

    What `JUDGE` runs, with the tests and the solution split over two processes.
    """
    parts = [build_solution(completion, columns), str(columns.get("test") or "")]
    if _checks(columns):
        parts.append(f"check({columns['entry_point']})")
    return "\n\n".join(parts) + "\n"


# The judge: the sandbox's program. It forks the solver first, while its memory holds nothing of
# the problem; only then does it read the problem (solution, tests, prompt) from stdin. The
# solver runs the model's code and answers the judge's calls. Messages are an 8-byte length and
# a `marshal` payload: plain data only (marshal runs no code and builds no instance of the
# program's classes). Requests: (name, args, kwargs); replies: ("ok", value) or ("raise",
# exception type name, message); first, after the solution ran: ("ready", {name: ("call",) or
# ("value", v)}).
JUDGE = r"""
import builtins
import marshal
import os
import sys

_PLAIN = (type(None), bool, int, float, complex, str, bytes, type(...))


def _channel(read_fd, write_fd):
    def read(n):
        buf = b""
        while len(buf) < n:
            chunk = os.read(read_fd, n - len(buf))
            if not chunk:
                raise EOFError("the other process ended")
            buf += chunk
        return buf

    def send(obj):
        data = marshal.dumps(obj)
        data = len(data).to_bytes(8, "little") + data
        while data:
            data = data[os.write(write_fd, data):]

    def recv():
        size = int.from_bytes(read(8), "little")
        if size > 1 << 28:
            raise RuntimeError("the other process sent too much data")
        return marshal.loads(read(size))

    return send, recv


def _solve(read_fd, write_fd):
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # the judge's stdin (the problem) is not ours
    send, recv = _channel(read_fd, write_fd)
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        exec(compile(recv(), "solution.py", "exec"), namespace)
    except BaseException as exc:
        import traceback

        traceback.print_exc()
        send(("failed", type(exc).__name__))
        return
    names = {}
    for key, value in list(namespace.items()):
        if key.startswith("__"):
            continue
        if callable(value):
            names[key] = ("call",)
            continue
        try:
            marshal.dumps(value)
        except (ValueError, TypeError):
            continue
        names[key] = ("value", value)
    send(("ready", names))
    while True:
        try:
            name, args, kwargs = recv()
        except EOFError:
            return
        try:
            reply = ("ok", namespace[name](*args, **kwargs))
        except BaseException as exc:
            reply = ("raise", type(exc).__name__, str(exc)[:2000])
        try:
            send(reply)
        except (ValueError, TypeError) as exc:  # not plain data: no exception a test could expect
            send(("unplain", str(exc)))


def _fail(message):
    # A broken answer ends the judge at once: an exception here could be one a test expects.
    sys.stderr.write(f"judge: {message}\n")
    sys.stderr.flush()
    os._exit(1)


def _plain(value, depth=0):
    kind = type(value)
    if depth > 100:
        _fail("the solution returned data nested too deep")
    if kind in _PLAIN:
        return value
    if kind in (tuple, list, set, frozenset):
        for item in value:
            _plain(item, depth + 1)
        return value
    if kind is dict:
        for key, item in value.items():
            _plain(key, depth + 1)
            _plain(item, depth + 1)
        return value
    _fail(f"the solution returned a {kind.__name__}, not plain data")


def _judge():
    to_r, to_w = os.pipe()
    from_r, from_w = os.pipe()
    if os.fork() == 0:
        try:
            os.close(to_w)
            os.close(from_r)
            _solve(to_r, from_w)
        finally:
            sys.stdout.flush()
            os._exit(0)
    os.close(to_r)
    os.close(from_w)
    import ctypes

    # Not dumpable: the solver runs as our uid, but cannot ptrace us or read our /proc files.
    ctypes.CDLL(None).prctl(4, ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0))
    data = b""
    while chunk := os.read(0, 1 << 20):
        data += chunk
    solution, test, prompt, entry, check = marshal.loads(data)
    del data
    send, receive = _channel(from_r, to_w)

    def recv():
        try:
            return receive()
        except Exception as exc:
            _fail(f"no answer from the solution's process ({type(exc).__name__}: {exc})")

    def remote(name):
        def call(*args, **kwargs):
            send((name, args, kwargs))
            reply = recv()
            if type(reply) is tuple and len(reply) == 2 and reply[0] == "ok":
                return _plain(reply[1])
            if type(reply) is tuple and len(reply) == 3 and reply[0] == "raise":
                exc = getattr(__builtins__, str(reply[1]), None)
                if not (isinstance(exc, type) and issubclass(exc, Exception)):
                    exc = RuntimeError
                raise exc(str(reply[2]))
            if type(reply) is tuple and len(reply) == 2 and reply[0] == "unplain":
                _fail(f"the solution returned no plain data ({str(reply[1])[:200]})")
            _fail(f"the solution's process answered out of turn: {str(reply)[:200]}")

        call.__name__ = call.__qualname__ = str(name)
        return call

    send(solution)
    ready = recv()
    if type(ready) is not tuple or len(ready) != 2 or ready[0] != "ready" or type(ready[1]) is not dict:
        _fail("the solution did not run to its end")
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    exec(compile(prompt, "prompt.py", "exec"), namespace)
    for name, item in ready[1].items():
        if type(name) is not str or (name != entry and (name in namespace or hasattr(builtins, name))):
            continue  # the prompt's helpers stay the prompt's, and the builtins the tests use stay builtins
        if item == ("call",):
            namespace[name] = remote(name)
        elif type(item) is tuple and len(item) == 2 and item[0] == "value":
            namespace[name] = _plain(item[1])
    exec(compile(test, "test.py", "exec"), namespace)
    if check:
        namespace["check"](namespace[entry])


_judge()
"""


def judge_input(completion: str, columns: dict[str, Any]) -> bytes:
    """What `JUDGE` reads from stdin: the solution, the tests, the prompt's code, the entry point,
    and whether to call ``check(entry_point)``."""
    import marshal

    return marshal.dumps((build_solution(completion, columns), str(columns.get("test") or ""),
                          str(columns.get("prompt_code") or ""), str(columns.get("entry_point") or ""),
                          _checks(columns)))


def run(completion: str, columns: dict[str, Any], timeout_s: float = 5.0,
        memory_mb: int = 512) -> tuple[bool, sandbox.SandboxResult]:
    """Run a completion's tests in the sandbox (`JUDGE`): (passed, the sandbox's result)."""
    result = sandbox.run_code(JUDGE, timeout_s=timeout_s, memory_mb=memory_mb, max_file_mb=16, max_procs=16,
                              stdin=judge_input(completion, columns))
    return result.status == "ok", result


def score(completion: str, columns: dict[str, Any], timeout_s: float = 5.0, memory_mb: int = 512) -> float:
    """1.0 when the completion passes the problem's tests in the sandbox, else 0.0."""
    if not columns.get("test"):
        raise ValueError("a code reward needs the problem's 'test' column")
    passed, result = run(completion, columns, timeout_s, memory_mb)
    if result.status == "sandbox_error":  # the launcher died, not the program: censored, never a 0
        raise ScoringFailure(f"code sandbox failed: {result.reason}")
    return 1.0 if passed else 0.0


def reward(prompts: list, completions: list[str], timeout_s: float = 5.0, memory_mb: int = 512,
           **columns: list) -> list[float]:
    """TRL's reward signature (as user functions have): 1.0 per completion whose program passes the
    problem's `test` column (with its `entry_point`), run in the sandbox."""
    return [score(c, {k: v[i] for k, v in columns.items()}, timeout_s, memory_mb) for i, c in enumerate(completions)]
