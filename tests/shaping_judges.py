"""Module-level FAPO judges for tests/objectives/test_shaping.py (pool workers import them by reference)."""

from __future__ import annotations

import time
from typing import Any


def flawed_if_marked(prompt: Any, completion: str, answer: Any) -> bool:
    """Flawed when the completion says FLAW; raises on 'bad', sleeps on 'sleep', returns a str on 'str'."""
    if "bad" in completion:
        raise ValueError("judge failed")
    if "sleep" in completion:
        time.sleep(60)
    if "str" in completion:
        return "yes"  # type: ignore[return-value]  # not a bool: counted as an error
    return "FLAW" in completion and str(answer) in completion
