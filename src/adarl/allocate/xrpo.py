"""XRPO uncertainty-reduction allocation (§2.2a).

Phase 0 gives every prompt n_0 rollouts. The rest of the step's rollouts (n·k in all, or the
budget's allowance) go out in chunks to the prompt with the highest priority, recomputed
after each chunk:
    h_q(n) = t_{1−α/2, n−1} · s_q / sqrt(n)        Student-t CI half-width of the mean reward
    Δ_q    = h_q(n_q) − h_q(n_q + 1)               expected shrink from one more rollout
    φ_q    = λ·sqrt(log(1+T)/n_q)  ("sqrt")  or  λ·log(1+T)/n_q  ("linear")
    Π_q    = Δ_q + φ_q
n_q and s_q are the prompt's reward count and sample std over its whole history (the
difficulty store, which already holds phase 0); T is the training step. Constants (`_guess`
where the paper is silent): α = 0.05, λ = 1, n_0 = n/2, chunk = 2.
"""

from __future__ import annotations

import heapq
import math
from typing import Any, Literal

from pydantic import Field
from pydantic.dataclasses import dataclass

from adarl.allocate.base import Stateless, fit
from adarl.budget import Budget
from adarl.registry import STRICT, register
from adarl.select.store import DifficultyStore
from adarl.stats import t_quantile
from adarl.types import Group, Problem, PromptId


def half_width(n: int, std: float, alpha: float) -> float:
    return 0.0 if n < 2 else t_quantile(1 - alpha / 2, n - 1) * std / math.sqrt(n)


@register("allocate", "xrpo")
@dataclass(config=STRICT)
class Xrpo(Stateless):
    n: int = Field(8, gt=0)  # mean rollouts per prompt: the step spends n·k in all
    n0: int | None = Field(None, gt=0)  # phase 0 rollouts per prompt (default n/2)
    chunk: int = Field(2, gt=0)
    alpha: float = Field(0.05, gt=0.0, lt=1.0)
    bonus_scale: float = Field(1.0, ge=0.0)  # λ
    bonus: Literal["sqrt", "linear"] = "sqrt"

    def priority(self, n: int, std: float, step: int) -> float:
        delta = half_width(n, std, self.alpha) - half_width(n + 1, std, self.alpha)
        explore = math.log(1 + step) / max(n, 1)
        phi = self.bonus_scale * (math.sqrt(explore) if self.bonus == "sqrt" else explore)
        return delta + phi

    def plan(self, problems: list[Problem], store: DifficultyStore, budget: Budget) -> dict[PromptId, int]:
        self._total = self.n * len(problems)
        self._phase = 0
        n0 = self.n0 or max(2, self.n // 2)
        return fit({p.id: n0 for p in problems}, budget, store)

    def more(self, groups: list[Group], store: DifficultyStore, budget: Budget) -> dict[PromptId, int]:
        if self._phase != 0:
            return {}
        self._phase = 1
        remaining = self._total - sum(g.size for g in groups)
        left = budget.step_rollouts_left()
        if left is not None:
            remaining = min(remaining, left)
        idx = [store.index[g.problem.id] for g in groups]
        counts = {g.problem.id: int(store.reward_n[i]) for g, i in zip(groups, idx, strict=True)}
        stds = {g.problem.id: float(s) for g, s in zip(groups, store.reward_std(idx), strict=True)}
        extra = dict.fromkeys(counts, 0)
        heap = [(-self.priority(counts[q], stds[q], store.step), q) for q in counts]
        heapq.heapify(heap)
        while remaining >= 1 and heap:
            _, q = heapq.heappop(heap)
            give = min(self.chunk, remaining)
            extra[q] += give
            remaining -= give
            heapq.heappush(heap, (-self.priority(counts[q] + extra[q], stds[q], store.step), q))
        granted = fit(extra, budget, store)
        self._stats = {"phase1_rollouts": float(sum(granted.values())),
                       "phase1_prompts": float(sum(1 for v in granted.values() if v))}
        return granted

    def metrics(self) -> dict[str, Any]:
        return dict(getattr(self, "_stats", {}))
