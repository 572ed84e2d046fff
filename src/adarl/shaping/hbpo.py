"""HBPO budget-aware reward (algorithms.md §6.1; ZJU-REAL/HBPO `rllm/rewards/math_reward.py`, arXiv 2507.15844).

Each rollout was generated under a token budget b, stated in its text ("I will answer the question
within {b} tokens"; the code's "with {b} tokens" is accepted too). With n = |o| completion tokens,
L_max = `max_len`, α = 1/L_max:
    f_1(n, b) = β·cos(π n / (2 L_max)) − α·|n − b|
    f_2(b)    = β·cos(π b / (2 L_max))
    R = f_1(n, b)  if correct and b < n ≤ L_max
    R = f_2(b)     if correct and n ≤ b
    R = 0          otherwise
form="min" uses the released code's min(f_1, f_2) for every correct n ≤ L_max instead; it differs
from the piecewise form only when n ≤ b and f_1 < f_2 (short budgets). A rollout with no budget
in its text gets β·cos(π n / (2 L_max)) when correct (the code's no-match branch), unless
`default_budget` is set. L_max defaults to §6.1's 4096 (HBPO's context), not to max_new_tokens,
so that the "hbpo" advantage's f_2 (which never sees max_new_tokens) uses the same L_max.

Shaping only adds columns, so the "hbpo" column is R − (sum of the columns already there): the
row sum a rollout trains on becomes R, while `Group.correct` and the verifier columns stay.
"""

from __future__ import annotations

from typing import ClassVar, Literal

import numpy as np
from pydantic import Field
from pydantic.dataclasses import dataclass

from adarl.registry import STRICT, register
from adarl.sentences import parse_budget
from adarl.shaping.base import add_column
from adarl.types import Group


def f1(n: np.ndarray, b: np.ndarray, beta: float, max_len: int) -> np.ndarray:
    """f_1(n, b) = β·cos(π n / 2L_max) − |n − b| / L_max."""
    return beta * np.cos(np.pi * n / (2 * max_len)) - np.abs(n - b) / max_len


def f2(b: np.ndarray, beta: float, max_len: int) -> np.ndarray:
    """f_2(b) = β·cos(π b / 2L_max): the reward of a correct answer that stays within its budget."""
    return beta * np.cos(np.pi * np.asarray(b, dtype=np.float64) / (2 * max_len))


def budget_reward(n: np.ndarray, budget: np.ndarray, correct: np.ndarray, beta: float, max_len: int,
                  form: Literal["piecewise", "min"] = "piecewise") -> np.ndarray:
    """R_HBPO per rollout; `budget` is NaN where the text states none."""
    n = np.asarray(n, dtype=np.float64)
    b = np.asarray(budget, dtype=np.float64)
    has_budget = ~np.isnan(b)
    b = np.where(has_budget, b, 0.0)
    over, within = f1(n, b, beta, max_len), f2(b, beta, max_len)
    budgeted = np.minimum(over, within) if form == "min" else np.where(n > b, over, within)
    reward = np.where(has_budget, budgeted, beta * np.cos(np.pi * n / (2 * max_len)))
    return np.where((np.asarray(correct) > 0.5) & (n <= max_len), reward, 0.0)


@register("shaping", "hbpo")
@dataclass(config=STRICT)
class HbpoReward:
    column: ClassVar[str] = "hbpo"
    beta: float = Field(4.0, gt=0.0)  # β
    max_len: int = Field(4096, gt=0)  # L_max (α = 1/L_max)
    default_budget: int | None = Field(None, gt=0)  # b for rollouts whose text states none; None: cos-only
    form: Literal["piecewise", "min"] = "piecewise"

    def __call__(self, groups: list[Group], max_new_tokens: int) -> None:
        for group in groups:
            if group.correct is None or group.rewards is None:
                raise ValueError(f"group {group.problem.id} must be verified before hbpo shaping")
            n = np.array([len(r) for r in group.rollouts], dtype=np.float64)
            budget = np.array([self.budget(r.text) for r in group.rollouts], dtype=np.float64)
            target = budget_reward(n, budget, group.correct, self.beta, self.max_len, self.form)
            add_column(group, self.column, target - group.rewards.sum(axis=1))

    def budget(self, text: str) -> float:
        b = parse_budget(text)
        if b is None:
            b = self.default_budget
        return np.nan if b is None else float(b)
