"""XRPO novelty-aware advantage sharpening (algorithms.md §2.2(c); arXiv 2510.06672, 3rd-party formula).

Correct-but-unlikely rollouts get a bonus on top of a group-relative base advantage A_i
(GRPO §1.1 or Dr.GRPO §1.2):
    s(o_i) = (1/|o_i|) Σ_t ℓ(i,t)                  mean token log-likelihood
    η_i    = exp( s(o_i) − mean_{j∈group} s(o_j) )  relative likelihood within the group
    A_i⁺   = A_i + min( max( λ_nov·(1 − η_i), 0 ), κ·A_i )   if A_i > 0,   else A_i⁺ = A_i
ℓ is the behaviour log-prob the generator recorded (`Rollout.sampled_logprobs`), standing in for §2.2's
ℓ_old (they agree for on-policy rollouts). A rollout with no tokens has no likelihood: it gets
η = 1 (no bonus) and is left out of its group's mean s. A group of size 1 has η = 1.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import Field
from pydantic.dataclasses import dataclass

from adarl.advantage.base import group_segments
from adarl.advantage.grpo import DrGrpo, Grpo
from adarl.registry import STRICT, register
from adarl.types import Batch


def mean_logprob(batch: Batch) -> tuple[np.ndarray, np.ndarray]:
    """s(o_i) per rollout (0 where undefined) and whether it is defined (the rollout has log-probs)."""
    sampled = [r.sampled_logprobs for r in batch.rollouts]  # the policy's own tokens (no tool output)
    s = np.array([float(np.mean(lp)) if lp else 0.0 for lp in sampled], dtype=np.float64)
    defined = np.array([len(lp) > 0 for lp in sampled], dtype=bool)
    return s, defined


@register("advantage", "xrpo")
@dataclass(config=STRICT)
class Xrpo:
    base: Literal["grpo", "drgrpo"] = "grpo"
    novelty_scale: float = Field(1.0, ge=0.0)  # λ_nov
    cap: float = Field(1.0, ge=0.0)  # κ: the bonus is at most κ·A_i
    eps: float = Field(1e-6, ge=0.0)  # GRPO's ε (base="grpo")

    def __call__(self, batch: Batch) -> np.ndarray:
        adv = Grpo(eps=self.eps)(batch) if self.base == "grpo" else DrGrpo()(batch)
        if adv.size == 0:
            return adv
        sizes = batch.group_sizes
        starts = group_segments(sizes)
        s, defined = mean_logprob(batch)
        counts = np.add.reduceat(defined.astype(np.float64), starts)
        group_mean_s = np.repeat(np.add.reduceat(s * defined, starts) / np.maximum(counts, 1.0), sizes)
        eta = np.where(defined, np.exp(s - group_mean_s), 1.0)  # η_i
        bonus = np.minimum(np.maximum(self.novelty_scale * (1.0 - eta), 0.0), self.cap * adv)
        return np.where(adv > 0, adv + bonus, adv)
