"""ADHint's advantage (algorithms.md §5.3 c): a group that holds hinted rollouts (a `hint` span
first, hints/adhint.py) is two sub-groups, each normalised against its own statistics,

    A_i = (r_i − mean_S r) / (std_S r + ε)    for S the rollout's sub-group (hinted or plain)

and the hinted sub-group's advantages are scaled by (1 − acc_hint + acc_plain), acc the sub-groups'
accuracies: a success that needed a hint counts for less. A group without hinted rollouts is plain
GRPO. std is unbiased, as in GRPO; a sub-group of equal rewards gets exactly 0.
"""

from __future__ import annotations

import numpy as np
from pydantic.dataclasses import dataclass

from adarl.advantage.base import group_segments
from adarl.advantage.grpo import group_stats
from adarl.registry import STRICT, register
from adarl.types import Batch


@register("advantage", "adhint")
@dataclass(config=STRICT)
class AdHintAdvantage:
    eps: float = 1e-6

    def __call__(self, batch: Batch) -> np.ndarray:
        rewards = batch.rewards.astype(np.float64)
        adv = np.zeros(len(rewards))
        rollouts = batch.rollouts
        for g, start in zip(batch.groups, group_segments(batch.group_sizes), strict=True):
            hinted = np.array([r.opens_with_hint for r in rollouts[start:start + g.size]])
            correct = g.correct if g.correct is not None else np.zeros(g.size)
            parts = [hinted, ~hinted] if hinted.any() else [~hinted]
            for part in parts:
                idx = start + np.flatnonzero(part)
                if not len(idx):
                    continue
                mean, std = group_stats(rewards[idx], np.array([len(idx)]))
                adv[idx] = (rewards[idx] - mean) / (std + self.eps)
            if hinted.any() and (~hinted).any():
                scale = 1.0 - float(correct[hinted].mean()) + float(correct[~hinted].mean())
                adv[start + np.flatnonzero(hinted)] *= scale
        return adv
