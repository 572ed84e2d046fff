"""SEELE: a per-problem hint length fitted by item response theory so that hinted accuracy lands
near 0.5 (Li et al. 2025, "Staying in the Sweet Spot: Responsive Reasoning Evolution via
Capability-Adaptive Hint Scaffolding"; algorithms.md §5.2, from the abstract).

For a group where every rollout failed, R rounds (default 3) of m rollouts each (default: the
group's size over R) are sampled with the first λ of a worked solution as the beginning of the
answer (a `hint` span). Round 1 uses λ_1 = 0.5. After each round the accuracies seen so far for
that problem, (λ_j, k_j of m_j), with the plain group as the point (0, 0 of G), are fitted by a
one-parameter logistic curve with fixed slope a = 10,

    acc(λ) = σ(a·(λ − b)),   b maximising Σ_j log Binomial(k_j; m_j, acc(λ_j))

(the likelihood equation Σ_j m_j·σ(a(λ_j − b)) = Σ_j k_j, solved by bisection), and the next round
uses the λ the curve gives the target accuracy 0.5: λ = b + logit(0.5)/a = b, clipped to [0, 1].
Every round's rollouts join the group, which trains as one group. The fitted b is kept per problem
(the state) and seeds the problem's first round when it fails again in a later step.
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np
from pydantic import Field
from pydantic.dataclasses import dataclass

from adarl.hints.base import HintPlan, all_failed, prefix_of
from adarl.registry import STRICT, register
from adarl.types import Group


def fit_difficulty(points: list[tuple[float, int, int]], slope: float) -> float:
    """b of acc(λ) = σ(slope·(λ − b)) by maximum likelihood over (λ, successes, trials) points;
    ±inf when every point failed / succeeded (the curve can be placed anywhere beyond them)."""
    k = sum(s for _, s, _ in points)
    m = sum(t for _, _, t in points)
    if k == 0:
        return math.inf
    if k == m:
        return -math.inf

    def excess(b: float) -> float:  # expected successes minus observed: decreasing in b
        return sum(t / (1.0 + math.exp(-slope * (lam - b))) for lam, _, t in points) - k

    lo, hi = -10.0, 10.0
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if excess(mid) > 0 else (lo, mid)
    return (lo + hi) / 2


@register("hints", "seele")
@dataclass(config=STRICT)
class Seele:
    source: Literal["solution", "hint", "answer"] = "solution"
    rounds: int = Field(3, ge=1, le=64)
    first_ratio: float = Field(0.5, ge=0.0, le=1.0)  # λ_1
    slope: float = Field(10.0, gt=0.0, le=1000.0)  # a
    target: float = Field(0.5, gt=0.0, lt=1.0)  # acc*
    per_round: int | None = Field(None, ge=1, le=4096)  # m; None: the group's size over the rounds

    def __post_init__(self) -> None:
        self.points: dict[str, list[tuple[float, int, int]]] = {}  # this step's (λ, k, m) per problem
        self.difficulty: dict[str, float] = {}  # fitted b per problem, across steps

    def ratio(self, pid: str) -> float:
        b = self.difficulty.get(pid)
        if b is None:
            return self.first_ratio
        return float(np.clip(b + math.log(self.target / (1 - self.target)) / self.slope, 0.0, 1.0))

    def plan(self, groups: list[Group], round_: int) -> list[HintPlan]:
        if round_ == 0:
            self.points = {g.problem.id: [(0.0, 0, g.size)] for g in groups if all_failed(g)}
        out = []
        for g in groups:
            text = g.problem.info(self.source)
            if g.problem.id not in self.points or text is None or round_ >= self.rounds:
                continue
            lam = self.ratio(g.problem.id)
            n = self.per_round or max(1, self.points[g.problem.id][0][2] // self.rounds)
            out.append(HintPlan(g.problem, n, prefix_of(text, lam), "prefix", replace=False, ratio=lam))
        return out

    def observe(self, plans: list[HintPlan], groups: list[Group]) -> None:
        for plan, g in zip(plans, groups, strict=True):
            self.points[plan.problem.id].append((plan.ratio, int(g.correct.sum()), g.size))
            self.difficulty[plan.problem.id] = fit_difficulty(self.points[plan.problem.id], self.slope)

    def metrics(self) -> dict[str, float]:
        fitted = [b for b in self.difficulty.values() if math.isfinite(b)]
        return {"seele/difficulty_mean": float(np.mean(fitted))} if fitted else {}

    def state_dict(self) -> dict:
        return {"difficulty": dict(self.difficulty)}

    def load_state_dict(self, state: dict) -> None:
        self.difficulty = {k: float(v) for k, v in state["difficulty"].items()}
