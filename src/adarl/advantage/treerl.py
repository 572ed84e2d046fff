"""TreeRL's process supervision from the tree: each segment is credited with how much it raised the
chance of success, globally and against its parent (Hou et al. 2025, "TreeRL: LLM Reinforcement
Learning with On-Policy Tree Search", §3.2).

For a node s of a group's tree (advantage/tree.py: a run of spans held by the same leaves L(s)),
its value is the mean reward of the leaves under it, V(s) = mean_{l ∈ L(s)} r_l (V(root) is the
group's mean, the root being the prompt). Then

    GA(s) = V(s) − V(root)        (global advantage)
    LA(s) = V(s) − V(parent(s))   (local advantage; the root's children: LA = GA)
    R(s)  = (GA(s) + LA(s)) / sqrt(|L(s)|)

and every token of s carries R(s). The paper trains one sample per leaf, so a node's tokens are
trained |L(s)| times, each with R(s). adarl trains a shared span once (`trainable_masks`):
`shared: sum` (default) gives it |L(s)|·R(s) = sqrt(|L(s)|)·(GA + LA), the gradient of those
|L(s)| copies; `shared: once` gives it R(s). A leaf's own segment has |L| = 1:
R = 2·r − V(root) − V(parent). The per-rollout advantage (logs, metrics) is its own segment's R.

An unbranched group is a tree of depth 1: R_i = 2·(r_i − mean r), twice Dr.GRPO's advantage.
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np
from pydantic.dataclasses import dataclass

from adarl.advantage.base import group_segments
from adarl.advantage.tree import leaf_paths
from adarl.registry import STRICT, register
from adarl.types import Batch, Rollout


def node_credit(rollouts: list[Rollout], rewards: np.ndarray,
                shared: str = "sum") -> tuple[dict[int, float], list[float]]:
    """(id(span) -> the value its tokens train with, each leaf's own-segment R) for one tree. A tree
    of equal rewards gets exactly 0 everywhere (a float mean of equal values may not equal them)."""
    span_values: dict[int, float] = {}
    own: list[float] = []
    if np.all(rewards == rewards[0]):
        return {id(s): 0.0 for r in rollouts for s in r.spans}, [0.0] * len(rollouts)
    root = float(rewards.mean())
    for path in leaf_paths(rollouts):
        parent = root
        r_last = 0.0
        for node in path:
            v = float(rewards[list(node.leaves)].mean())
            r = ((v - root) + (v - parent)) / math.sqrt(len(node.leaves))
            total = r * len(node.leaves) if shared == "sum" else r
            for span in node.spans:
                span_values[span] = total
            parent, r_last = v, r
        own.append(r_last)
    return span_values, own


@register("advantage", "treerl")
@dataclass(config=STRICT)
class TreeRL:
    shared: Literal["sum", "once"] = "sum"

    def __call__(self, batch: Batch) -> np.ndarray:
        rewards = batch.rewards.astype(np.float64)
        rollouts = batch.rollouts
        adv = np.zeros(len(rewards))
        span_values: dict[int, float] = {}
        sizes = batch.group_sizes
        for start, size in zip(group_segments(sizes), sizes, strict=True):
            values, own = node_credit(rollouts[start:start + size], rewards[start:start + size], self.shared)
            span_values.update(values)
            adv[start:start + size] = own
        batch.span_advantages = span_values
        return adv
