"""Module-level functions for tests/rewards/test_rewards.py (workers import them by reference)."""

from __future__ import annotations

import os
import time
from typing import Any


def length_reward(prompts: list[Any], completions: list[str], **columns: Any) -> list[float]:
    """A TRL-style reward: the completion's length divided by 10."""
    return [len(c) / 10 for c in completions]


def answer_in_completion(prompts: list[Any], completions: list[str], answer: list[Any],
                         **columns: Any) -> list[float]:
    """1.0 when the answer column appears in the completion, plus the `bonus` column if any."""
    bonus = columns.get("bonus", [0.0] * len(completions))
    return [float(str(a) in c) + float(b) for c, a, b in zip(completions, answer, bonus, strict=True)]


def raising_reward(prompts: list[Any], completions: list[str], **columns: Any) -> list[float]:
    """Fails on completions containing 'bad', scores the rest 1.0."""
    if any("bad" in c for c in completions):
        raise ValueError("bad completion")
    return [1.0] * len(completions)


def nan_reward(prompts: list[Any], completions: list[str], **columns: Any) -> list[float]:
    return [float("nan")] * len(completions)


def string_reward(prompts: list[Any], completions: list[str], **columns: Any) -> list[Any]:
    return ["high"] * len(completions)


def sleepy_reward(prompts: list[Any], completions: list[str], **columns: Any) -> list[float]:
    """Sleeps forever on completions containing 'sleep'."""
    if any("sleep" in c for c in completions):
        sleep_forever()
    return [1.0] * len(completions)


def crashing_reward(prompts: list[Any], completions: list[str], **columns: Any) -> list[float]:
    """Kills its own process on completions containing 'crash'."""
    if any("crash" in c for c in completions):
        os._exit(1)
    return [1.0] * len(completions)


not_callable = 42


# -------------------------------------------------------------- plain functions for WorkerPool.map


def add(a: float, b: float) -> float:
    return a + b


def fail(message: str) -> None:
    raise RuntimeError(message)


def sleep_forever() -> None:
    while True:
        time.sleep(60)


def exit_hard(code: int = 1) -> None:
    os._exit(code)


def allocate(n_bytes: int) -> int:
    """Allocate and touch n_bytes; returns the size (or raises MemoryError under a cap)."""
    block = bytearray(n_bytes)
    return len(block)


def loaded(names: tuple[str, ...]) -> list[str]:
    """Which of these modules the worker has imported."""
    import sys

    return [n for n in names if n in sys.modules]


def getpid() -> int:
    return os.getpid()


def unpicklable_result() -> Any:
    return lambda: None


def unscorable_reward(prompts: list[Any], completions: list[str], down: list[Any] | None = None,
                      **columns: Any) -> list[float]:
    """The service it scores with is down for problems whose `down` column is true (`ScoringFailure`: the
    rollout is censored); a completion containing 'wrong' scores 0, any other 1."""
    from adarl.rewards import ScoringFailure

    if down and down[0]:
        raise ScoringFailure("the scoring service is down")
    return [0.0 if "wrong" in c else 1.0 for c in completions]


def timed_math_score(completion: str, answer: str) -> tuple[float, float]:
    """adarl's math score of `completion` and the seconds it took, measured in the worker."""
    import time

    from adarl.rewards import math

    start = time.perf_counter()
    value = math.score(completion, answer, timeout_s=60)
    return value, time.perf_counter() - start
