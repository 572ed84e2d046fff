"""High-entropy ("forking") tokens only: "Beyond the 80/20 Rule: High-Entropy Minority Tokens
Drive Effective Reinforcement Learning for LLM Reasoning" (Wang et al. 2025).

Only the top ρ fraction of the batch's tokens by entropy keep their policy gradient:

    w'_{i,t} = w_{i,t} · 𝟙[H_{i,t} ≥ τ_ρ^B]

    B      the batch's live tokens (those whose incoming weight w_{i,t} ≠ 0; dropped tokens
           neither count nor can come back)
    m      = ⌈ρ·|B|⌉                        tokens to keep (ρ = `top`, 0.2 in the paper)
    τ_ρ^B  = the m-th largest H_{i,t} over B   (ties at τ are all kept, so ≥ m tokens survive)

Kept tokens keep their incoming weight (a HAPO-style scale survives); the others get 0. In adarl
a 0 weight also leaves `agg`'s normalisation count (tokens/base.py), so the loss averages over the
kept tokens only.
"""

from __future__ import annotations

import math
from typing import ClassVar

import numpy as np
from pydantic import Field
from pydantic.dataclasses import dataclass

from adarl.registry import STRICT, register
from adarl.tokens.base import batch_entropies
from adarl.types import Batch


def top_fraction_masks(scores: list[np.ndarray], live: list[np.ndarray], fraction: float) -> list[np.ndarray]:
    """Per rollout, which live tokens are among the top `fraction` of all live scores of the batch.

    Keeps m = ⌈fraction·n⌉ of the n live tokens (at least 1 when n > 0), plus every token tied
    with the m-th largest score; dead tokens are never kept.
    """
    pooled = np.concatenate([s[alive] for s, alive in zip(scores, live, strict=True)]) if scores else np.zeros(0)
    n = pooled.size
    if n == 0:
        return [np.zeros(len(s), dtype=bool) for s in scores]
    m = min(n, max(1, math.ceil(fraction * n - 1e-9)))  # tolerance: 0.2·10 must be 2, not 3
    threshold = np.sort(pooled)[n - m]  # τ: the m-th largest
    return [alive & (s >= threshold) for s, alive in zip(scores, live, strict=True)]


def checked_entropies(batch: Batch, weights: list[np.ndarray]) -> list[np.ndarray]:
    """`batch_entropies`, checked to line up with the weights (one entropy per weighted token)."""
    entropies = batch_entropies(batch)
    if len(entropies) != len(weights):
        raise ValueError(f"got {len(weights)} weight arrays for a batch of {len(entropies)} rollouts")
    for i, (h, w) in enumerate(zip(entropies, weights, strict=True)):
        if h.shape != np.shape(w):
            raise ValueError(f"rollout {i} has {h.size} entropies but {np.size(w)} token weights; they must match")
    return entropies


@register("tokens", "high_entropy")
@dataclass(config=STRICT)
class HighEntropy:
    top: float = Field(0.2, gt=0.0, le=1.0)  # ρ, the fraction of the batch's live tokens kept
    needs_entropy: ClassVar[bool] = True

    def __call__(self, batch: Batch, weights: list[np.ndarray], progress: float) -> list[np.ndarray]:
        entropies = checked_entropies(batch, weights)
        weights = [np.asarray(w, dtype=np.float64) for w in weights]
        live = [w != 0 for w in weights]
        keep = top_fraction_masks(entropies, live, self.top)
        return [np.where(k, w, 0.0) for w, k in zip(weights, keep, strict=True)]
