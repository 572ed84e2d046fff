"""VADE: variance-aware prompt selection by Thompson sampling on Beta posteriors (§2.3).

For each of M·B uniformly drawn candidates q:  p̃_q ~ Beta(α_q, β_q),
score_q = p̃_q (1 − p̃_q)  (the Bernoulli variance: the expected GRPO signal), take the top B.
Posteriors decay on two scales (short: each use; long: γ_l^Δt for Δt unseen steps). The store
applies them; this selector owns the factors (`store_decay`), which the trainer gives the store.
Constants are adarl's reading of the abstract: γ_s = 0.5, γ_l = 0.99, M = 4 (all `_guess`).
"""

from __future__ import annotations

import numpy as np
from pydantic import Field
from pydantic.dataclasses import dataclass

from adarl.registry import STRICT, register
from adarl.select.base import Stateless, candidates
from adarl.select.store import DifficultyStore


@register("select", "vade")
@dataclass(config=STRICT)
class Vade(Stateless):
    gamma_short: float = Field(0.5, gt=0.0, le=1.0)
    gamma_long: float = Field(0.99, gt=0.0, le=1.0)
    pool: float = Field(4.0, ge=1.0)  # M: candidates per selected prompt

    def store_decay(self) -> tuple[float, float]:
        return self.gamma_short, self.gamma_long

    def select(self, store: DifficultyStore, k: int, rng: np.random.Generator) -> list[int]:
        pool = candidates(store, int(np.ceil(self.pool * k)), rng)
        alpha, beta = store.posterior(pool)
        p = rng.beta(alpha, beta)
        score = p * (1.0 - p)
        k = min(k, len(pool))
        top = np.argpartition(-score, k - 1)[:k]
        return pool[top[np.argsort(-score[top])]].tolist()
