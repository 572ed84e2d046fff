"""TreePO's tree-based advantage: a leaf is compared with every subgroup of leaves that shares an
ancestor with it (Li et al. 2025, "TreePO: Bridging the Gap of Policy Optimization and Efficacy and
Inference Efficiency with Heuristic Tree-based Modeling"; released code
`compute_tree_reinforce_plus_plus_baseline_outcome_advantage` in multimodal-art-projection/TreePO).

For leaf i of a group (a tree) and each depth d = 0, 1, ...: the subgroup G_d(i) is the leaves that
share i's first d spans (d = 0: the whole group). Its term is

    s_{i,d} = r_i − mean_{j ∈ G_d(i)} r_j             (a subgroup of one leaf has mean 0)

kept for d = 0 always, and for d ≥ 1 only when |G_d(i)| > 1 (and, with `skip_zero_std`, when the
subgroup's rewards are not all equal). The leaf's advantage combines its terms

    group_size (default):  A_i = Σ_d |G_d(i)| · s_{i,d} / Σ_d |G_d(i)|
    average:               A_i = mean_d s_{i,d}

and the batch is whitened (default `whiten: tokens`, as the code's `masked_whiten`): every sampled
token of leaf i carries A_i, and A ← (A − mean) / sqrt(var + 1e-8) over all those tokens (var
unbiased), so a long leaf weighs more; `rollouts` whitens over leaves, `none` leaves A as it is.
A leaf's depth counts spans: a span of the record is a segment of the tree, so a subgroup that
spans several segments without forking counts once per segment, as in the code.

Shared tokens: a span shared by several leaves is trained once, with the mean advantage of the
leaves under it (`train/learner.py: token_advantages`); the code trains it once per leaf, with each
leaf's own advantage, which sums to the same gradient up to the normaliser. An unbranched group is
a tree of depth 1: A_i = r_i − mean(r), whitened over the batch (REINFORCE++-baseline).
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic.dataclasses import dataclass

from adarl.advantage.base import group_segments
from adarl.registry import STRICT, register
from adarl.types import Batch, Rollout, span_holders


def subgroup_terms(rollouts: list[Rollout], rewards: np.ndarray,
                   skip_zero_std: bool = False) -> list[list[tuple[float, int]]]:
    """Per leaf of one tree, its (s_{i,d}, |G_d(i)|) for every depth kept (see the module docstring)."""
    holders = span_holders(rollouts)
    n = len(rollouts)
    root_mean = float(rewards.mean()) if n > 1 else 0.0
    out = []
    for i, r in enumerate(rollouts):
        terms = [(float(rewards[i]) - root_mean, n)]
        for s in r.spans:
            sub = holders[id(s)]
            if len(sub) < 2:
                continue
            values = rewards[sub]
            if skip_zero_std and np.all(values == values[0]):
                continue
            terms.append((float(rewards[i] - values.mean()), len(sub)))
        out.append(terms)
    return out


@register("advantage", "treepo")
@dataclass(config=STRICT)
class TreePO:
    weighting: Literal["group_size", "average"] = "group_size"  # the code's adv_weight_strategy
    skip_zero_std: bool = False  # the code's remove_no_std_subgroup (subtree_std_ds)
    whiten: Literal["tokens", "rollouts", "none"] = "tokens"

    def __call__(self, batch: Batch) -> np.ndarray:
        rewards = batch.rewards.astype(np.float64)
        rollouts = batch.rollouts
        adv = np.zeros(len(rewards))
        sizes = batch.group_sizes
        for start, size in zip(group_segments(sizes), sizes, strict=True):
            terms = subgroup_terms(rollouts[start:start + size], rewards[start:start + size], self.skip_zero_std)
            for k, leaf in enumerate(terms):
                s = np.array([t for t, _ in leaf])
                w = np.array([g for _, g in leaf], dtype=np.float64)
                adv[start + k] = float((s * w).sum() / w.sum()) if self.weighting == "group_size" else float(s.mean())
        if self.whiten == "none" or adv.size == 0:
            return adv
        counts = np.array([max(len(r), 1) for r in rollouts], dtype=np.float64) if self.whiten == "tokens" \
            else np.ones(len(adv))
        total = counts.sum()
        mean = float((counts * adv).sum() / total)
        var = float((counts * (adv - mean) ** 2).sum() / total)
        if total > 1:
            var *= total / (total - 1)  # unbiased, as masked_var
        return (adv - mean) / np.sqrt(var + 1e-8)
