"""The sentences a rollout is opened with and its reward reads back: HBPO's budget sentence
(shaping/hbpo.py, advantage/hbpo.py) and e1's effort sentence (shaping/e1.py). The recipe check
(config/rollout.py) reads a template's sentences back with the same parsers, so a template the reward
cannot read is refused when the recipe loads instead of scoring as "none stated"."""

from __future__ import annotations

import re

BUDGET_PATTERN = re.compile(r"I will answer the question with(?:in)?\s+(\d+)\s+tokens")
EFFORT_PATTERN = re.compile(r"Effort:\s*(\d+(?:\.\d+)?)")


def parse_budget(text: str) -> int | None:
    """The budget b stated in a rollout's text (first match), or None."""
    match = BUDGET_PATTERN.search(text or "")
    return int(match.group(1)) if match else None


def parse_effort(text: str) -> float | None:
    """The effort r stated in a rollout's text (first match), or None."""
    match = EFFORT_PATTERN.search(text or "")
    return float(match.group(1)) if match else None
