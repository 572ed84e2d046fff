"""BAPO: Balanced Policy Optimization with adaptive clipping (arXiv 2510.18927), algorithms.md §4.1.

The clip bounds are explicit ratio bounds [c_low, c_high], moved each call until the positive
contributions reach a target share ρ_0 (bounds searched with ρ detached):

    eff(ρ, A) = ρ·A  where the clip lets the gradient through, 0 where it is clipped
                (A ≥ 0 and ρ > c_high, or A < 0 and ρ < c_low)
    P = Σ m·max(eff, 0),   N = Σ m·max(−eff, 0)
    stat = P / (P + N)                   "share" (paper / README; 1 if N = 0)
         = P / (N + 1e-8)                "pos_neg_ratio" (the authors' code; ∞ if N = 0)
    while stat < ρ_0 and c_low  < c_low_max:   c_low  += step_low;  recompute     (lower bound first)
    while stat < ρ_0 and c_high < c_high_max:  c_high += step_high; recompute
    L = −min( ρA, clip(ρ, c_low, c_high)A ),   dual clip min(L, −c·A) for A < 0,  c = 3

Defaults are the code script's (`run_bapo_example.sh`): c_low ∈ [0.8, 0.95] step 0.05,
c_high ∈ [1.2, 2.0] step 0.1; the README's are c_low ∈ [0.6, 0.9], c_high ∈ [1.2, 3.0].
*Resolved conflict.* algorithms.md §4.1 writes eff = max(ρ, c_low)·A for A < 0, which keeps a
clipped token's value in N: raising c_low could then only grow N, and the first loop could never
help reach the target, against the section's own explanation ("raising c_low clips away more
low-probability negative tokens"; "raising c_high lets more positive tokens count"). Here eff is
each token's contribution to the gradient, so a clipped token counts 0 on either side; both
explanations then hold. As in the code, a step never passes the maximum, and P, N are summed over data-parallel ranks
when torch.distributed is initialised. The statistic is taken over the tokens of one call.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.distributed as dist
from pydantic import Field, model_validator
from pydantic.dataclasses import dataclass

from adarl.loss.base import LossInputs, PolicyLoss
from adarl.loss.ppo import clipped_surrogate
from adarl.registry import STRICT, register


def contributions(ratio: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, c_low: float,
                  c_high: float) -> tuple[float, float]:
    """(P, N): the positive and negative contributions Σ m·eff of the unclipped tokens, summed over ranks."""
    clipped = torch.where(adv >= 0, ratio > c_high, ratio < c_low)
    eff = torch.where(clipped, torch.zeros_like(ratio), ratio * adv)
    eff = torch.where(mask > 0, eff, torch.zeros_like(eff))  # padding may hold anything
    sums = torch.stack([eff.clamp(min=0).sum(), (-eff).clamp(min=0).sum()]).double()
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(sums, op=dist.ReduceOp.SUM)
    positive, negative = sums.tolist()
    return positive, negative


@register("loss", "bapo")
@dataclass(config=STRICT)
class Bapo(PolicyLoss):
    stat: Literal["share", "pos_neg_ratio"] = "share"
    target: float = Field(0.5, ge=0.0)  # ρ_0
    c_low_start: float = Field(0.8, gt=0.0)
    c_low_max: float = Field(0.95, gt=0.0)
    c_low_step: float = Field(0.05, ge=0.0)
    c_high_start: float = Field(1.2, gt=0.0)
    c_high_max: float = Field(2.0, gt=0.0)
    c_high_step: float = Field(0.1, ge=0.0)
    dual_clip: float | None = Field(3.0, gt=1.0)  # c; None = off

    @model_validator(mode="after")
    def _bounds_ordered(self) -> Bapo:
        if self.c_low_max < self.c_low_start:
            raise ValueError(f"c_low_max={self.c_low_max} is below c_low_start={self.c_low_start}")
        if self.c_high_max < self.c_high_start:
            raise ValueError(f"c_high_max={self.c_high_max} is below c_high_start={self.c_high_start}")
        if self.c_low_max >= self.c_high_start:
            raise ValueError(f"c_low_max={self.c_low_max} must stay below c_high_start={self.c_high_start}")
        return self

    def statistic(self, positive: float, negative: float) -> float:
        if self.stat == "share":
            return 1.0 if negative <= 0 else positive / (positive + negative)
        return math.inf if negative <= 0 else positive / (negative + 1e-8)

    def bounds(self, ratio: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor) -> tuple[float, float, float]:
        """The searched (c_low, c_high) and the positive share P/(P+N) at those bounds."""
        ratio = ratio.detach()
        c_low, c_high = self.c_low_start, self.c_high_start
        positive, negative = contributions(ratio, adv, mask, c_low, c_high)
        steps = 0  # c = start + k·step (no drift from repeated float addition), capped at max
        while self.statistic(positive, negative) < self.target and c_low < self.c_low_max and self.c_low_step > 0:
            steps += 1
            c_low = min(self.c_low_start + steps * self.c_low_step, self.c_low_max)
            positive, negative = contributions(ratio, adv, mask, c_low, c_high)
        steps = 0
        while self.statistic(positive, negative) < self.target and c_high < self.c_high_max and self.c_high_step > 0:
            steps += 1
            c_high = min(self.c_high_start + steps * self.c_high_step, self.c_high_max)
            positive, negative = contributions(ratio, adv, mask, c_low, c_high)
        share = 1.0 if negative <= 0 else positive / (positive + negative)
        return c_low, c_high, share

    def surrogate(self, x: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        ratio = torch.exp((x.logp - x.old_logp).clamp(-20.0, 20.0))  # the code's clamp on log ρ
        c_low, c_high, share = self.bounds(ratio, x.adv, x.mask)
        loss, stats = clipped_surrogate(ratio, x.adv, c_low, c_high, self.dual_clip)
        value = ratio.detach()
        stats["bapo_c_low"] = torch.full_like(value, c_low)
        stats["bapo_c_high"] = torch.full_like(value, c_high)
        stats["bapo_positive_share"] = torch.full_like(value, share)
        return loss, stats
