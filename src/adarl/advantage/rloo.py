"""RLOO: REINFORCE Leave-One-Out (Ahmadian et al., "Back to Basics", 2024; Kool et al., 2019).

Not in algorithms.md (it is a GRPO-family baseline like §1.1/§1.2). Each rollout's baseline is
the mean reward of the *other* rollouts of its group:
    A_i = r_i − (1/(G−1)) Σ_{j≠i} r_j  =  G/(G−1) · (r_i − mean_j r_j)
The advantages of a group sum to 0. A group of size 1 has no other rollout to compare with:
its advantage is 0 (verl instead passes its raw reward through; a lone sample carries no
baseline, so adarl gives it no gradient).
"""

from __future__ import annotations

import numpy as np
from pydantic.dataclasses import dataclass

from adarl.advantage.grpo import group_stats
from adarl.registry import STRICT, register
from adarl.types import Batch


@register("advantage", "rloo")
@dataclass(config=STRICT)
class Rloo:
    def __call__(self, batch: Batch) -> np.ndarray:
        rewards = batch.rewards.astype(np.float64)
        sizes = batch.group_sizes
        mean, _ = group_stats(rewards, sizes)
        # G/(G−1) per rollout; 0 for singleton groups (their advantage is defined as 0)
        scale = np.repeat(np.where(sizes > 1, sizes / np.maximum(sizes - 1, 1), 0.0), sizes)
        return scale * (rewards - mean)
