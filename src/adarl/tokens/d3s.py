"""D^3S: Dynamic Dual-level Down-Sampling (algorithms.md §4.4).

Schedule (cosine, `_guess`):  f(p) = f_0 + (1 − f_0)·(1 − cos(π·min(p / p_full, 1)))/2
    f_0 = `f0` (0.25) at progress 0, 1.0 from progress p_full = `full_at` (0.6) on.

Sample level (maximise Var(A) within a group): of a group's G live rollouts (those with a
non-zero weight left) keep k = min(G, max(2, ⌈f·G⌉)); a group of G ≤ 2 keeps everything.
    positives A_i > 0, largest first;  negatives A_i < 0, smallest first
    take ⌈k/2⌉ positives and ⌊k/2⌋ negatives; if one side is short, fill from the other side's
    extremes; rollouts with A_i = 0 fill last. Ties go to the earlier rollout.
Dropped rollouts get all-zero weights (they leave the mini-batch). `recompute_adv` recomputes GRPO
advantages (algorithms.md §1.1, ε = 1e-6) on each group's kept rollouts and *replaces
batch.advantages* with a new array (dropped rollouts keep their old value; they never train).

Token level: over the batch's kept tokens (non-zero weight after the sample level)
    s_{i,t} = |A_{i,t}|·H_{i,t},   A_{i,t} = A_i·w_{i,t}  (= |A_i|·H_{i,t} for 0/1 weights)
keep the top f fraction, m = ⌈f·n⌉ of n, plus every token tied with the m-th largest score;
the rest get 0, which also removes them from the loss's normalisation count.
"""

from __future__ import annotations

import math

import numpy as np
from pydantic import Field
from pydantic.dataclasses import dataclass

from adarl.advantage.base import group_segments
from adarl.advantage.grpo import Grpo, group_stats
from adarl.registry import STRICT, register
from adarl.tokens.high_entropy import checked_entropies, top_fraction_masks
from adarl.types import Batch


def cosine_fraction(progress: float, f0: float, full_at: float) -> float:
    """f(p): cosine from f0 at progress 0 up to 1 at progress `full_at`, 1 after."""
    x = min(max(progress / full_at, 0.0), 1.0)
    return f0 + (1.0 - f0) * (1.0 - math.cos(math.pi * x)) / 2.0


def max_variance_subset(advantages: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k rollouts §4.4 keeps: ⌈k/2⌉ top positives, ⌊k/2⌋ bottom negatives, filled."""
    high = [i for i in np.argsort(-advantages, kind="stable") if advantages[i] > 0]
    low = [i for i in np.argsort(advantages, kind="stable") if advantages[i] < 0]
    zero = [i for i in range(advantages.size) if advantages[i] == 0]
    n_high, n_low = min(math.ceil(k / 2), len(high)), min(k // 2, len(low))
    short = k - n_high - n_low
    extra = min(short, len(high) - n_high)  # negatives ran out: more positives
    n_high, short = n_high + extra, short - extra
    extra = min(short, len(low) - n_low)  # positives ran out: more negatives
    n_low, short = n_low + extra, short - extra
    return np.array(high[:n_high] + low[:n_low] + zero[:short], dtype=np.int64)


@register("tokens", "d3s")
@dataclass(config=STRICT)
class D3s:
    f0: float = Field(0.25, gt=0.0, le=1.0)  # f_0, the fraction kept at progress 0
    full_at: float = Field(0.6, gt=0.0)  # progress at which f reaches 1
    sample_level: bool = True
    token_level: bool = True
    recompute_adv: bool = False  # d3s_recompute_adv_guess; True rewrites batch.advantages

    def __post_init__(self) -> None:
        if self.recompute_adv and not self.sample_level:
            raise ValueError("d3s: recompute_adv=true needs sample_level=true (nothing is dropped to recompute over)")

    @property
    def needs_entropy(self) -> bool:
        return self.token_level

    def fraction(self, progress: float) -> float:
        return cosine_fraction(progress, self.f0, self.full_at)

    def __call__(self, batch: Batch, weights: list[np.ndarray], progress: float) -> list[np.ndarray]:
        if batch.advantages is None:
            raise ValueError("d3s needs batch.advantages: run it after the advantage stage")
        if not (len(weights) == len(batch.advantages) == len(batch)):
            raise ValueError(f"d3s got {len(weights)} weight arrays and {len(batch.advantages)} advantages "
                             f"for a batch of {len(batch)} rollouts")
        weights = [np.asarray(w, dtype=np.float64) for w in weights]
        f = self.fraction(progress)
        kept = np.array([bool(np.any(w != 0)) for w in weights], dtype=bool)
        if self.sample_level:
            kept = self._select_rollouts(np.asarray(batch.advantages, dtype=np.float64), kept, batch.group_sizes, f)
            if self.recompute_adv:
                batch.advantages = self._recomputed(batch, kept)
        live = [(w != 0) & keep for w, keep in zip(weights, kept, strict=True)]
        if self.token_level:
            entropies = checked_entropies(batch, weights)
            scores = [np.abs(a * w) * h for a, w, h in zip(batch.advantages, weights, entropies, strict=True)]
            live = top_fraction_masks(scores, live, f)
        return [np.where(alive, w, 0.0) for w, alive in zip(weights, live, strict=True)]

    @staticmethod
    def _select_rollouts(advantages: np.ndarray, live: np.ndarray, sizes: np.ndarray, f: float) -> np.ndarray:
        kept = np.zeros_like(live)
        for start, size in zip(group_segments(sizes), sizes, strict=True):
            members = start + np.flatnonzero(live[start:start + size])  # G = the group's live rollouts
            k = min(members.size, max(2, math.ceil(f * members.size - 1e-9)))
            kept[members[max_variance_subset(advantages[members], k)]] = True
        return kept

    @staticmethod
    def _recomputed(batch: Batch, kept: np.ndarray) -> np.ndarray:
        """GRPO advantages on each group's kept rollouts; the others keep their old value."""
        advantages = np.array(batch.advantages, dtype=np.float64)  # a copy: the old array is left as it was
        sizes = np.bincount(batch.group_index[kept], minlength=len(batch.groups))
        sizes = sizes[sizes > 0]
        if sizes.size:
            rewards = batch.rewards.astype(np.float64)[kept]
            mean, std = group_stats(rewards, sizes)
            advantages[kept] = (rewards - mean) / (std + Grpo().eps)
        return advantages
