"""REINFORCE++ with a global batch baseline (Hu et al., "REINFORCE++", arXiv 2501.03262).

Not in algorithms.md. The outcome-reward, no-KL form of OpenRLHF/verl, at sequence level:
    REINFORCE++:            a_i = r_i − mean_{batch} r
    REINFORCE++-baseline:   a_i = r_i − mean_{j ∈ group(i)} r_j        (group_baseline=True)
    whitening (default on): A_i = (a_i − mean_{batch} a) / (std_{batch} a + ε),   ε = 1e-6
std is the population std over the batch's rollouts. OpenRLHF/verl whiten over *tokens* (each
token carries its sequence's return), which weights long responses more; adarl whitens over
rollouts, one value per rollout, like every other estimator here. With group_baseline a group
of size 1 is its own baseline (a_i = 0).
"""

from __future__ import annotations

import numpy as np
from pydantic import Field
from pydantic.dataclasses import dataclass

from adarl.advantage.grpo import group_stats
from adarl.registry import STRICT, register
from adarl.types import Batch


@register("advantage", "reinforce_pp")
@dataclass(config=STRICT)
class ReinforcePP:
    group_baseline: bool = False  # REINFORCE++-baseline: subtract the group mean first
    whiten: bool = True
    eps: float = Field(1e-6, ge=0.0)

    def __call__(self, batch: Batch) -> np.ndarray:
        rewards = batch.rewards.astype(np.float64)
        if rewards.size == 0:
            return rewards
        if self.group_baseline:
            sizes = batch.group_sizes
            mean, _ = group_stats(rewards, sizes)
            single = np.repeat(sizes == 1, sizes)
            a = np.where(single, 0.0, rewards - mean)  # group_stats gives singletons mean 0: use r_i itself
        else:
            a = rewards - rewards.mean()
        if not self.whiten:
            return a
        return (a - a.mean()) / (a.std() + self.eps)
