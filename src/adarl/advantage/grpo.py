"""GRPO and Dr.GRPO group-relative advantages (algorithms.md §1.1, §1.2).

GRPO (Shao et al., DeepSeekMath):   A_i = (r_i − mean_j r_j) / (std_j r_j + ε),  std unbiased
Dr.GRPO (Liu et al., understand-r1-zero): A_i = r_i − mean_j r_j   (no std division)

Groups may have any size: statistics are segment reductions over each group's rollouts,
never a reshape to (prompts, n). A group of size 1 has mean 0 and std 1 (its advantage is
its reward, as in verl). A group of equal rewards gets advantage exactly 0.0 (`equal_groups`).
A group that carries a `baseline` (mean, std) takes it instead of its own (Reinforce-Ada's global statistics).
"""

from __future__ import annotations

import numpy as np
from pydantic.dataclasses import dataclass

from adarl.advantage.base import equal_groups, group_segments
from adarl.registry import STRICT, register
from adarl.types import Batch


def group_stats(rewards: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-rollout group mean and unbiased group std, for groups of any sizes."""
    starts = group_segments(sizes)
    sums = np.add.reduceat(rewards, starts)
    mean = sums / sizes
    mean_per = np.repeat(mean, sizes)
    sq = np.add.reduceat((rewards - mean_per) ** 2, starts)
    std = np.sqrt(sq / np.maximum(sizes - 1, 1))
    single = sizes == 1
    mean[single], std[single] = 0.0, 1.0
    mean_per, std_per = np.repeat(mean, sizes), np.repeat(std, sizes)
    # a group of equal rewards (size > 1) has mean exactly its reward and std exactly 0: r − mean = 0.0
    equal = equal_groups(rewards, sizes) & ~np.repeat(single, sizes)
    mean_per[equal], std_per[equal] = rewards[equal], 0.0
    return mean_per, std_per


def with_baselines(batch: Batch, mean: np.ndarray, std: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`mean` and `std` per rollout, taken from the group's `baseline` where it carries one (statistics
    over more samples than it keeps: Reinforce-Ada's global_stat_est)."""
    ends = np.cumsum(batch.group_sizes)
    for g, end in zip(batch.groups, ends, strict=True):
        if g.baseline is not None:
            mean[end - g.size:end], std[end - g.size:end] = g.baseline
    return mean, std


@register("advantage", "grpo")
@dataclass(config=STRICT)
class Grpo:
    eps: float = 1e-6
    scale_by_std: bool = True

    def __call__(self, batch: Batch) -> np.ndarray:
        rewards = batch.rewards.astype(np.float64)
        mean, std = with_baselines(batch, *group_stats(rewards, batch.group_sizes))
        if not self.scale_by_std:
            return rewards - mean
        return (rewards - mean) / (std + self.eps)


@register("advantage", "drgrpo")
@dataclass(config=STRICT)
class DrGrpo:
    def __call__(self, batch: Batch) -> np.ndarray:
        rewards = batch.rewards.astype(np.float64)
        mean, _ = with_baselines(batch, *group_stats(rewards, batch.group_sizes))
        return rewards - mean
