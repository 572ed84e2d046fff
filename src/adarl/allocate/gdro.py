"""Rollout-GDRO: square-root allocation across difficulty bins with a shadow price (§2.4).

Minimising Σ_g w_g σ²_g / n_g at a fixed mean rollout count gives the square-root rule
    n_g = clip( round( sqrt(w_g σ²_g / μ) ), n_min, n_max ),   σ²_g = p̄_g (1 − p̄_g)
with p̄_g the mean pass estimate of this step's bin-g prompts and w_g the Prompt-GDRO weights
(uniform without that selector). The shadow price μ follows dual ascent on the budget so the
mean count tracks N̄. adarl takes the ascent step in log μ (μ ← μ·exp(η_μ (mean n − N̄)/N̄)):
μ's natural scale is ~1e-3, where the additive step η_μ = 0.01 of the reading overshoots.
Constants `_guess`: n_min = 4, n_max = 32, N̄ = 16 (here: `n_mean`, default 8), η_μ = 0.5.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from pydantic import Field
from pydantic.dataclasses import dataclass

from adarl.allocate.base import OneRound, fit
from adarl.budget import Budget
from adarl.registry import STRICT, register
from adarl.select.gdro import difficulty_bins
from adarl.select.store import DifficultyStore
from adarl.types import Problem, PromptId


@register("allocate", "gdro")
@dataclass(config=STRICT)
class RolloutGdro(OneRound):
    n_mean: float = Field(8.0, gt=0)  # N̄
    n_min: int = Field(4, gt=0)
    n_max: int = Field(32, gt=0)
    bins: int = Field(5, gt=1)
    k: int = Field(8, gt=0)
    price_lr: float = Field(0.5, gt=0)  # η_μ (log-space)

    def __post_init__(self) -> None:
        # μ at which a uniform-weight bin of maximal variance gets exactly N̄
        self.price = 0.25 / (self.bins * self.n_mean**2)
        self._stats: dict[str, float] = {}

    def plan(self, problems: list[Problem], store: DifficultyStore, budget: Budget) -> dict[PromptId, int]:
        idx = np.array([store.index[p.id] for p in problems])
        bins = difficulty_bins(store, idx, self.bins, self.k)
        weights = store.gdro_weights if store.gdro_weights is not None else np.full(self.bins, 1.0 / self.bins)
        if len(weights) != self.bins:
            raise ValueError(f"Rollout-GDRO has {self.bins} bins but Prompt-GDRO's weights have {len(weights)}: "
                             "set allocate.bins to select.bins")
        p = store.pass_estimate(idx)
        counts = np.zeros(len(idx), dtype=np.int64)
        for g in np.unique(bins):
            inside = bins == g
            pbar = float(p[inside].mean())
            var = max(pbar * (1 - pbar), 1e-4)
            counts[inside] = np.clip(round(np.sqrt(weights[g] * var / self.price)), self.n_min, self.n_max)
        mean_n = float(counts.mean()) if len(counts) else 0.0
        self.price *= float(np.exp(self.price_lr * (mean_n - self.n_mean) / self.n_mean))
        self._stats = {"mean_rollouts": mean_n, "shadow_price": self.price}
        return fit({pr.id: int(n) for pr, n in zip(problems, counts, strict=True)}, budget, store)

    def metrics(self) -> dict[str, Any]:
        return dict(self._stats)

    def state_dict(self) -> dict[str, Any]:
        return {"price": self.price}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.price = state["price"]
