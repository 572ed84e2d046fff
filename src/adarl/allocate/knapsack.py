"""Knapsack-RL: the step's rollouts as a knapsack over its prompts (algorithms.md §2.8; liziniu/KnapsackRL
`exploration_utils.py::sampling_budget_by_knapsack`, the released code this module follows).

A prompt q with estimated success rate p is an item whose value with N rollouts is
    ProbNonZeroGrad(N, p) = 1 − p^N − (1 − p)^N           (its group is not all-equal)
    InfoGain(p)           = p (1 − p)²                     (peaks at p = 1/3)
    Value(N, p)           = ProbNonZeroGrad(N, p) · InfoGain(p),   cost N
and the step's total is uniform's, T = n·B. As the released code splits it:
    p̂ unknown (never seen, or fewer than `min_buffer_length` outcomes)  → N = n
    0 < p̂ < 1 ("effective") → min_n;  p̂ = 0 → negative_n;  p̂ = 1 → positive_n;   R = T − Σ N
    no effective prompt: R evenly over the p̂ = 0 prompts (none: every prompt gets n)
    fallback: if Σ_eff ⌊min(max_n, c_q)⌋ < R, with c_q = log(1 − α)/log(max(p̂, 1 − p̂)) the rollouts that
              see both outcomes with probability α ("expectation": 1/(p̂(1 − p̂)) − 1), the excess goes
              evenly to the p̂ = 0 prompts (none: to the other non-effective ones) and R := that sum
    DP: extra k_q ∈ {0, …, max_n − min_n} per effective prompt, Σ k_q = R (or the most the ranges hold),
        maximising Σ_{k_q ≥ 1} Value(min_n + k_q, p̂_q): as in the code a prompt given no extra adds 0,
        not Value(min_n); ties go to the smaller k. What the ranges cannot hold is spread evenly.
p̂_q is the mean correctness of the prompt's latest group (`epoch_estimation`); with `robust` and that
group smaller than `reward_buffer_length`, the mean of its last `reward_buffer_length` outcomes over
visits. adarl reads correctness (the 0/1 column) where the code reads the reward score, and counts every
outcome recorded as the record's count. Spread remainders go to the first prompts in the step's order.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import numpy as np
from pydantic import Field, model_validator
from pydantic.dataclasses import dataclass

from adarl.allocate.base import OneRound, fit
from adarl.budget import Budget
from adarl.registry import STRICT, register
from adarl.select.store import DifficultyStore
from adarl.types import Group, Problem, PromptId


def value(n: int, p: float) -> float:
    """Value(N, p) = (1 − p^N − (1 − p)^N) · p (1 − p)²."""
    return (1.0 - p**n - (1.0 - p) ** n) * p * (1.0 - p) ** 2


def _spread(total: int, ids: list[PromptId], counts: dict[PromptId, int]) -> None:
    """`total` evenly over `ids`, the remainder one each to the first."""
    for i, q in enumerate(ids):
        counts[q] += total // len(ids) + (1 if i < total % len(ids) else 0)


def solve(rates: list[float], min_n: int, max_extra: int, budget: int) -> list[int]:
    """The DP of the released code: extra rollouts k_q ≤ max_extra with Σ k_q = min(budget, the ranges'
    total), maximising Σ_{k_q ≥ 1} Value(min_n + k_q, p_q); the rest spread evenly."""
    extra = [0] * len(rates)
    if budget <= 0 or not rates:
        return extra
    usable = min(budget, len(rates) * max_extra)
    top = min(max_extra, usable)
    best = np.full(usable + 1, -np.inf)  # best[w]: the most value of the items so far at exactly w extra
    best[0] = 0.0
    choices = np.zeros((len(rates), usable + 1), dtype=np.int64)
    for i, p in enumerate(rates):
        gain = np.array([0.0] + [value(min_n + k, p) for k in range(1, top + 1)])  # k = 0: the item adds nothing
        # candidate[w, k] = best[w − k] + gain[k] (−inf where w < k)
        padded = np.concatenate([np.full(top, -np.inf), best])
        candidate = np.lib.stride_tricks.sliding_window_view(padded, top + 1)[:, ::-1] + gain
        choices[i] = np.argmax(candidate, axis=1)  # the first maximum: ties keep the smaller k, as the code
        best = candidate[np.arange(usable + 1), choices[i]]
    w = usable
    for i in range(len(rates) - 1, -1, -1):
        extra[i] = int(choices[i, w])
        w -= extra[i]
    left = budget - usable
    for i in range(len(rates)):
        extra[i] += left // len(rates) + (1 if i < left % len(rates) else 0)
    return extra


@register("allocate", "knapsack")
@dataclass(config=STRICT)
class Knapsack(OneRound):
    n: int = Field(8, gt=0)  # uniform's group size: the step's total is n·B; unknown prompts get n
    min_n: int = Field(2, gt=0)  # rollouts of an effective prompt before the DP
    max_n: int = Field(128, gt=0)  # the most a prompt reaches through the DP
    negative_n: int | None = Field(None, ge=0)  # p̂ = 0 (None: min_n)
    positive_n: int | None = Field(None, ge=0)  # p̂ = 1 (None: min_n)
    alpha: float = Field(0.9, gt=0.0, lt=1.0)  # the fallback's confidence α
    cost_estimation: Literal["probability", "expectation"] = "probability"
    fallback: bool = True  # allow_fallback
    robust: bool = False  # robust_epoch_estimation
    reward_buffer_length: int = Field(16, gt=0)
    min_buffer_length: int = Field(8, ge=0)  # outcomes recorded before p̂ is trusted

    @model_validator(mode="after")
    def _range(self) -> Knapsack:
        if self.min_n > self.max_n:
            raise ValueError(f"knapsack min_n ({self.min_n}) must not exceed max_n ({self.max_n})")
        return self

    def __post_init__(self) -> None:
        # per prompt: [latest group's mean, its size, outcomes recorded, the last reward_buffer_length outcomes]
        self.records: dict[PromptId, list[Any]] = {}
        self._recorded = True
        self._stats: dict[str, float] = {}

    def estimate(self, q: PromptId) -> float | None:
        """p̂_q, or None while unknown."""
        record = self.records.get(q)
        if record is None or record[2] < self.min_buffer_length:
            return None
        latest, size, _, recent = record
        return float(np.mean(recent)) if self.robust and size < self.reward_buffer_length else latest

    def cost(self, p: float) -> float:
        if self.cost_estimation == "probability":
            return math.log(1.0 - self.alpha) / math.log(max(p, 1.0 - p))
        return 1.0 / (p * (1.0 - p)) - 1.0

    def allocate(self, ids: list[PromptId]) -> dict[PromptId, int]:
        """The released code's split of T = n·|ids| (module docstring)."""
        negative_n = self.min_n if self.negative_n is None else self.negative_n
        positive_n = self.min_n if self.positive_n is None else self.positive_n
        counts, rates = {}, {}
        for q in ids:
            p = self.estimate(q)
            counts[q] = self.n if p is None else self.min_n if 0.0 < p < 1.0 else negative_n if p == 0.0 \
                else positive_n
            if p is not None:
                rates[q] = p
        left = self.n * len(ids) - sum(counts.values())
        effective = [q for q, p in rates.items() if 0.0 < p < 1.0]
        hopeless = [q for q, p in rates.items() if p == 0.0]
        self._stats = {"fallback": 0.0, "fallback_effective_ratio": 1.0, "effective_prompts": float(len(effective)),
                       "unknown_prompts": float(len(ids) - len(rates))}
        if left > 0 and not effective:
            if hopeless:
                _spread(left, hopeless, counts)
            else:
                counts = dict.fromkeys(ids, self.n)
            return counts
        estimated = sum(int(min(self.max_n, self.cost(rates[q]))) for q in effective)
        others = hopeless or [q for q in ids if q not in effective]
        if self.fallback and estimated < left and others:
            self._stats["fallback"], self._stats["fallback_effective_ratio"] = 1.0, estimated / left
            _spread(left - estimated, others, counts)
            left = estimated
        for q, k in zip(effective, solve([rates[q] for q in effective], self.min_n, self.max_n - self.min_n, left),
                        strict=True):
            counts[q] += k
        return counts

    def plan(self, problems: list[Problem], store: DifficultyStore, budget: Budget) -> dict[PromptId, int]:
        self._recorded = False
        return fit(self.allocate([p.id for p in problems]), budget, store)

    def more(self, groups: list[Group], store: DifficultyStore, budget: Budget) -> dict[PromptId, int]:
        if not self._recorded:  # one stage: its groups update each prompt's record
            self._recorded = True
            for g in groups:
                outcomes = [float(c) for c in g.correct]
                _, _, count, recent = self.records.get(g.problem.id, [0.0, 0, 0, []])
                self.records[g.problem.id] = [float(np.mean(outcomes)), g.size, count + g.size,
                                             (recent + outcomes)[-self.reward_buffer_length:]]
            sizes = [g.size for g in groups] or [0]
            self._stats["rollouts_per_prompt_max"] = float(max(sizes))
        return {}

    def metrics(self) -> dict[str, Any]:
        return dict(self._stats)

    def state_dict(self) -> dict[str, Any]:
        return {"records": {q: list(r[:3]) + [list(r[3])] for q, r in self.records.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.records = {q: list(r[:3]) + [list(r[3])] for q, r in state["records"].items()}
