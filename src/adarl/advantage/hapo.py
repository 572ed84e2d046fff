"""HAPO token-level group average advantage (algorithms.md §4.2(b); starriver030515/HAPO core_algos).

Group statistics are taken over tokens, so each rollout's reward counts once per completion token:
    μ_g = Σ_i |o_i|·r_i / Σ_i |o_i|                       length-weighted mean
    σ_g = sqrt( Σ_i |o_i|·(r_i − μ_g)² / Σ_i |o_i| )      length-weighted population std
    A_i = (r_i − μ_g) / (σ_g + 1e-6)
If any |A_i| ≥ 5 in a group, that whole group falls back to the GRPO advantage (§1.1). A group
whose rollouts have no tokens at all has no token statistics and falls back to GRPO too. A group
of size 1 has μ_g = r_i, σ_g = 0, so A_i = 0.
"""

from __future__ import annotations

import numpy as np
from pydantic import Field
from pydantic.dataclasses import dataclass

from adarl.advantage.base import equal_groups, group_segments
from adarl.advantage.grpo import Grpo
from adarl.registry import STRICT, register
from adarl.types import Batch


@register("advantage", "hapo")
@dataclass(config=STRICT)
class Hapo:
    eps: float = Field(1e-6, ge=0.0)
    fallback_threshold: float = Field(5.0, gt=0.0)  # any |A_i| ≥ this in a group → GRPO for the group

    def __call__(self, batch: Batch) -> np.ndarray:
        rewards = batch.rewards.astype(np.float64)
        if rewards.size == 0:
            return rewards
        sizes = batch.group_sizes
        starts = group_segments(sizes)
        tokens = np.array([len(r) for r in batch.rollouts], dtype=np.float64)  # |o_i|
        total = np.add.reduceat(tokens, starts)
        no_tokens = np.repeat(total == 0, sizes)
        total = np.maximum(total, 1.0)
        mu = np.repeat(np.add.reduceat(tokens * rewards, starts) / total, sizes)  # μ_g
        var = np.add.reduceat(tokens * (rewards - mu) ** 2, starts) / total
        sigma = np.repeat(np.sqrt(var), sizes)  # σ_g
        adv = (rewards - mu) / (sigma + self.eps)
        exploded = np.maximum.reduceat(np.abs(adv), starts) >= self.fallback_threshold
        fallback = np.repeat(exploded, sizes) | no_tokens
        if fallback.any():
            adv = np.where(fallback, Grpo(eps=self.eps)(batch), adv)
        return np.where(equal_groups(rewards, sizes), 0.0, adv)  # no float residue in equal groups
