"""Math answers checked by math-verify: symbolic equivalence (``\\frac{1}{2}`` == ``0.5`` == ``1/2``).

`score` must run in the main thread of a worker process: math-verify's own timeouts use
``signal.alarm``, and a computation they cannot interrupt is the pool's to kill. math-verify
(and sympy) are imported inside the function so that importing this module stays cheap.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from adarl.rewards.short_answer import extract

MAX_CHARS = 2_000  # tail of the answer text handed to the parser


def answer_text(completion: str) -> tuple[str, bool]:
    """The text to parse: the last ``<answer>`` block if any (True), else the completion; capped."""
    tagged = extract(completion, "answer_tag")
    if tagged is not None:
        return tagged[-MAX_CHARS:], True
    return completion[-MAX_CHARS:], False


def _quiet() -> None:
    # math-verify logs every timeout at WARNING; a timeout here is just a wrong answer.
    logging.getLogger("math_verify").setLevel(logging.ERROR)


@functools.lru_cache(maxsize=1024)
def _parse_gold(answer: str, timeout_s: int) -> list[Any]:
    """The reference answer, read as a whole (inside ``\\boxed{}``) first, then by extraction."""
    from math_verify import parse

    answer = answer.strip()[:MAX_CHARS]
    whole = parse("\\boxed{" + answer + "}", parsing_timeout=timeout_s)
    return whole or parse(answer, parsing_timeout=timeout_s)


def score(completion: str, answer: str | None, timeout_s: int = 3) -> float:
    """1.0 when math-verify finds the completion's final answer equivalent to `answer`, else 0.0.

    `timeout_s` bounds each parse and each comparison (whole seconds, at least 1).
    """
    if answer is None or not str(answer).strip():
        return 0.0
    from math_verify import parse, verify

    _quiet()
    t = max(1, int(timeout_s))
    gold = _parse_gold(str(answer), t)
    if not gold:
        return 0.0
    text, tagged = answer_text(completion)
    pred = parse(text, parsing_timeout=t)
    if not pred and tagged:
        pred = parse("\\boxed{" + text + "}", parsing_timeout=t)
    if not pred:
        return 0.0
    return 1.0 if verify(gold, pred, timeout_seconds=t) else 0.0


def warm_up() -> None:
    """Pays math-verify's first-call costs in a worker's start-up, not in its first answer's timeout.

    The first LaTeX parse fills the ANTLR parser's prediction cache and the first comparison warms
    sympy: 0.7-2.7 s on a 2-core machine (the more so, the busier), 0.02-0.09 s for the same answer after. At
    the pool's default math timeout of 1-3 s a worker's first correct answer could time out and score 0.
    """
    score("<answer>x^2+2x+1</answer>", "(x+1)^2", timeout_s=60)
    score("$\\frac{1}{2} + \\sqrt{8}$", "0.5 + 2\\sqrt{2}", timeout_s=60)


def reward(prompts: list, completions: list[str], answer: list | None = None, timeout_s: int = 3,
           **columns: list) -> list[float]:
    """TRL's reward signature (as user functions have): math-verify equivalence per completion."""
    answers = answer if answer is not None else [None] * len(completions)
    return [score(c, None if a is None else str(a), timeout_s) for c, a in zip(completions, answers, strict=True)]
