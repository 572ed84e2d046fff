"""Arithmetic too large to do in the head, for the Python tool (rollout/python_tool.py).

    task: {source: compute}                         every kind below, in turn
    task: {source: compute, params: {kinds: [sum, modpow]}}

    sum         the sum of 12-20 numbers of 4-6 digits
    product     the product of three numbers of 3-5 digits
    modpow      a^b mod m, with b in the thousands
    digits      how many times a digit appears in 2^k, k from 200 to 600
    divisible   how many integers from 1 to N (10^4 to 10^6) are divisible by a or by b

Each answer is an integer (score it with `short_answer`, `extract: last_number`, `match: numeric`).
Each problem's row carries the `code` that computes it (one print), the Python tool's
`demonstration` for an SFT cold start. Seeded by `task.data_seed`; `task.size + task.eval_size`
distinct problems, split by the shared held-out rule.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any

from adarl.tasks.base import problem_id, render_prompt
from adarl.tasks.reasoning_gym import derive_seed
from adarl.types import Problem

Generated = tuple[str, str, int]  # (question, code, answer)


def _sum(rng: random.Random) -> Generated:
    numbers = [rng.randint(1000, 999_999) for _ in range(rng.randint(12, 20))]
    listed = ", ".join(map(str, numbers))
    return f"What is the sum of these numbers: {listed}?", f"print(sum([{listed}]))", sum(numbers)


def _product(rng: random.Random) -> Generated:
    a, b, c = (rng.randint(100, 99_999) for _ in range(3))
    return f"What is {a} * {b} * {c}?", f"print({a} * {b} * {c})", a * b * c


def _modpow(rng: random.Random) -> Generated:
    a, b, m = rng.randint(2, 999), rng.randint(1000, 99_999), rng.randint(97, 99_991)
    return (f"What is the remainder of {a} to the power {b} divided by {m}?", f"print(pow({a}, {b}, {m}))",
            pow(a, b, m))


def _digits(rng: random.Random) -> Generated:
    k, d = rng.randint(200, 600), rng.randint(0, 9)
    return (f"How many times does the digit {d} appear in the decimal digits of 2 to the power {k}?",
            f"print(str(2 ** {k}).count('{d}'))", str(2**k).count(str(d)))


def _divisible(rng: random.Random) -> Generated:
    n, a, b = rng.randint(10_000, 1_000_000), rng.randint(3, 60), rng.randint(3, 60)
    if a == b:
        b += 1
    count = n // a + n // b - n // math.lcm(a, b)  # inclusion-exclusion
    return (f"How many integers from 1 to {n} are divisible by {a} or by {b}?",
            f"print(sum(1 for i in range(1, {n} + 1) if i % {a} == 0 or i % {b} == 0))", count)


KINDS: dict[str, Callable[[random.Random], Generated]] = {
    "sum": _sum, "product": _product, "modpow": _modpow, "digits": _digits, "divisible": _divisible}


def compute(cfg: Any) -> list[Problem]:
    """`task.source: compute` (see the module docstring)."""
    kinds = (cfg.params or {}).get("kinds", list(KINDS))
    if (not isinstance(kinds, list) or not kinds
            or any(not isinstance(k, str) or k not in KINDS for k in kinds)):
        raise ValueError(f"task.params.kinds {kinds!r}: expected a non-empty list of {', '.join(KINDS)}")
    rng = random.Random(derive_seed(cfg.data_seed, "compute"))
    out: list[Problem] = []
    for i in range(cfg.size + cfg.eval_size):
        kind = kinds[i % len(kinds)]
        question, code, answer = KINDS[kind](rng)
        text = f"{question} Reply with only the final number."
        out.append(Problem(id=problem_id(text), prompt=render_prompt(text, cfg), answer=str(answer),
                           columns={"kind": kind, "code": code}))
    return out
