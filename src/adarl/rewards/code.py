"""Code rewards: run the program a completion writes against the problem's tests, in the sandbox.

The problem's columns carry the tests: ``test`` (Python source that raises, or exits non-zero,
when the program is wrong), optionally ``entry_point`` (the function under test; when ``test``
defines ``check``, ``check(entry_point)`` is called, as in HumanEval) and ``prompt_code`` (code
given in the prompt: imports, helpers and the function's signature and docstring).

The program is the last fenced code block of the completion (```` ```python ````, ```` ```py ````
or a bare fence), else the raw completion. If it defines ``entry_point`` it replaces the stub in
``prompt_code`` (the prompt is run first, so its imports and helpers exist); otherwise it is read
as the continuation of ``prompt_code`` (the function's body), as HumanEval's own harness does.

Scoring runs `sandbox.run_code` from a reward worker: 1.0 iff the program (in a small `harness`)
runs to its end, past the tests, within the time limit and exits with code 0. A wrong, crashing,
hanging or memory-hungry program scores 0.0 (a wrong answer, not a verifier failure); only a
sandbox that cannot start raises (and is counted as a reward error).

Tests run in the same interpreter as the model's code, so code written to cheat can still pass:
an object whose ``__eq__`` always returns True satisfies ``assert candidate(x) == y``, and the
harness's nonce can be found by frame introspection. The sandbox bounds the damage, not the score.
"""

from __future__ import annotations

import re
from typing import Any

from adarl.rewards import sandbox

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


def build_program(completion: str, columns: dict[str, Any]) -> str:
    """The full test program for a completion: prompt code, the model's code, the tests, the check."""
    program = extract_program(completion[:MAX_PROGRAM_CHARS])
    prompt_code = str(columns.get("prompt_code") or "")
    entry_point = columns.get("entry_point")
    test = str(columns.get("test") or "")
    if entry_point and prompt_code and not defines(program, str(entry_point)):
        source = prompt_code + program  # a body continuing the prompt's function
    elif prompt_code:
        source = prompt_code + "\n\n" + program
    else:
        source = program
    parts = [source, test]
    if entry_point and defines(test, "check"):
        parts.append(f"check({entry_point})")
    return "\n\n".join(parts) + "\n"


_HARNESS = """\
def _adarl_harness():
    import os
    import sys

    nonce = sys.stdin.readline().strip()
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)  # the nonce cannot be read again
    report = os.dup(1)
    os.dup2(devnull, 1)  # the program's own output is not the verdict
    write = os.write
    source = {source!r}
    namespace = {{"__name__": "__main__", "__builtins__": __builtins__}}
    exec(compile(source, "solution.py", "exec"), namespace)
    write(report, (nonce + "\\n").encode())


_adarl_harness()
"""


def harness(source: str) -> str:
    """A program that runs `source` and, only if it finishes, prints a nonce read from stdin.

    Exit code 0 alone is not a pass: ``sys.exit(0)`` or ``os._exit(0)`` before the tests run
    would give one. The nonce is read (and stdin closed) before the model's code runs, so that
    code cannot print it without introspecting the harness's frame.
    """
    return _HARNESS.format(source=source)


def run(completion: str, columns: dict[str, Any], timeout_s: float = 5.0,
        memory_mb: int = 512) -> tuple[bool, sandbox.SandboxResult]:
    """Run a completion's test program in the sandbox: (passed, the sandbox's result)."""
    import secrets

    nonce = secrets.token_hex(16)
    result = sandbox.run_code(harness(build_program(completion, columns)), timeout_s=timeout_s,
                              memory_mb=memory_mb, max_file_mb=16, max_procs=16, stdin=nonce + "\n")
    passed = result.status == "ok" and result.stdout.splitlines()[-1:] == [nonce]
    return passed, result


def score(completion: str, columns: dict[str, Any], timeout_s: float = 5.0, memory_mb: int = 512) -> float:
    """1.0 when the completion passes the problem's tests in the sandbox, else 0.0."""
    if not columns.get("test"):
        raise ValueError("a code reward needs the problem's 'test' column")
    passed, result = run(completion, columns, timeout_s, memory_mb)
    if result.status == "sandbox_error":
        raise RuntimeError(f"code sandbox failed: {result.reason}")
    return 1.0 if passed else 0.0
