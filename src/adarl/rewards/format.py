"""Format reward: does the completion have the required shape?"""

from __future__ import annotations

import re

DEFAULT_PATTERN = r"<answer>.*?</answer>"


def compile_pattern(pattern: str | None) -> re.Pattern[str]:
    """The pattern compiled with DOTALL; a ValueError names a malformed one."""
    try:
        return re.compile(DEFAULT_PATTERN if pattern is None else pattern, re.DOTALL)
    except re.error as exc:
        raise ValueError(f"invalid format pattern {pattern!r}: {exc}") from None


def score(completion: str, pattern: str | None = None) -> float:
    """1.0 if ``re.search(pattern, completion, re.DOTALL)`` matches, else 0.0.

    The default pattern (an ``<answer>...</answer>`` block) is checked with plain string search,
    which gives the same answer in linear time; a custom pattern runs as a regex.
    """
    if pattern is None or pattern == DEFAULT_PATTERN:
        start = completion.find("<answer>")
        return 1.0 if start >= 0 and completion.find("</answer>", start + len("<answer>")) >= 0 else 0.0
    return 1.0 if compile_pattern(pattern).search(completion) else 0.0


def reward(prompts: list, completions: list[str], pattern: str | None = None, **columns: list) -> list[float]:
    """TRL's reward signature (as user functions have): 1.0 per completion that matches `pattern`."""
    return [score(c, pattern) for c in completions]
