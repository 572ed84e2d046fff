"""BAPO: Balanced Policy Optimization with adaptive clipping (arXiv 2510.18927), algorithms.md §4.1.

The clip bounds are explicit ratio bounds [c_low, c_high], moved until the positive
contributions reach a target share ρ_0 (bounds searched with ρ detached):

    eff(ρ, A) = min(ρ, c_high)·A  if A ≥ 0,  max(ρ, c_low)·A  if A < 0        "released" (default)
              = ρ·A where the clip lets the gradient through, 0 where it clips   "gradient"
                (A ≥ 0 and ρ > c_high, or A < 0 and ρ < c_low)
    P = Σ m·max(eff, 0),   N = Σ m·max(−eff, 0)
    stat = P / (P + N)                   "share" (paper / README; 1 if N = 0)
         = P / (N + 1e-8)                "pos_neg_ratio" (the authors' code; ∞ if N = 0)
    while stat < ρ_0 and c_low  < c_low_max:   c_low  += step_low;  recompute     (lower bound first)
    while stat < ρ_0 and c_high < c_high_max:  c_high += step_high; recompute
    L = −min( ρA, clip(ρ, c_low, c_high)A ),   dual clip min(L, −c·A) for A < 0,  c = 3

Defaults are the code script's (`run_bapo_example.sh`): c_low ∈ [0.8, 0.95] step 0.05,
c_high ∈ [1.2, 2.0] step 0.1; the README's are c_low ∈ [0.6, 0.9], c_high ∈ [1.2, 3.0].

*Two readings of eff* (`contribution`). "released" is the authors' code
(`recipe/bapo/policy_loss.py`) and §4.1's formula. It is the default because users compare
against that code. Under it a token clipped below keeps the value c_low·A in N, so raising
c_low can only grow N: whenever the start misses the target, the first loop runs c_low up to
c_low_max and the c_high loop alone does the balancing. "gradient" is adarl's reading of the
paper's explanation ("raising c_low clips away more low-probability negative tokens", "raising
c_high lets more positive tokens count"): eff is the token's contribution to the gradient, so a
clipped token counts 0 on either side, and both loops can then help reach the target.

*Where the statistic is taken.* Once per mini-batch: the trainer calls `prepare` with every
micro-batch's inputs, and since P and N are sums the bounds are the whole mini-batch's however
it is split; each call uses them until the next `prepare`. A call made without `prepare`
(standalone use) searches on its own tokens. (The released code searches on each micro-batch
verl hands its loss.) As in the code, a step never passes the maximum, and P, N are summed
over data-parallel ranks when torch.distributed is initialised, so every rank uses the same bounds.
"""

from __future__ import annotations

import math
from typing import ClassVar, Literal

import torch
import torch.distributed as dist
from pydantic import Field, model_validator
from pydantic.dataclasses import dataclass

from adarl.loss.base import LossInputs, PolicyLoss
from adarl.loss.ppo import clipped_surrogate
from adarl.registry import STRICT, register

Contribution = Literal["released", "gradient"]
Part = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (ρ detached, A, mask) of one micro-batch


def ratio_of(x: LossInputs) -> torch.Tensor:
    return torch.exp((x.logp - x.old_logp).clamp(-20.0, 20.0))  # the code's clamp on log ρ


def contributions(ratio: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, c_low: float, c_high: float,
                  rule: Contribution = "released") -> torch.Tensor:
    """This rank's (P, N) = (Σ m·max(eff, 0), Σ m·max(−eff, 0)) as a float64 pair."""
    if rule == "released":
        eff = torch.where(adv >= 0, ratio.clamp(max=c_high), ratio.clamp(min=c_low)) * adv
    else:
        clipped = torch.where(adv >= 0, ratio > c_high, ratio < c_low)
        eff = torch.where(clipped, torch.zeros_like(ratio), ratio * adv)
    eff = torch.where(mask > 0, eff, torch.zeros_like(eff))  # padding may hold anything
    return torch.stack([eff.clamp(min=0).sum(), (-eff).clamp(min=0).sum()]).double()


@register("loss", "bapo")
@dataclass(config=STRICT)
class Bapo(PolicyLoss):
    stat: Literal["share", "pos_neg_ratio"] = "share"
    contribution: Contribution = "released"
    target: float = Field(0.5, ge=0.0)  # ρ_0
    c_low_start: float = Field(0.8, gt=0.0)
    c_low_max: float = Field(0.95, gt=0.0)
    c_low_step: float = Field(0.05, ge=0.0)
    c_high_start: float = Field(1.2, gt=0.0)
    c_high_max: float = Field(2.0, gt=0.0)
    c_high_step: float = Field(0.1, ge=0.0)
    dual_clip: float | None = Field(3.0, gt=1.0)  # c; None = off

    needs_prepare: ClassVar[bool] = True

    def __post_init__(self) -> None:
        self._prepared: tuple[float, float, float] | None = None  # the mini-batch's (c_low, c_high, share)

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

    def sums(self, parts: list[Part], c_low: float, c_high: float) -> tuple[float, float]:
        """(P, N) over every part, summed over data-parallel ranks."""
        device = parts[0][0].device if parts else None  # NCCL reduces only tensors on the GPU
        total = torch.zeros(2, dtype=torch.float64, device=device)
        for ratio, adv, mask in parts:
            total = total + contributions(ratio, adv, mask, c_low, c_high, self.contribution)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(total, op=dist.ReduceOp.SUM)
        positive, negative = total.tolist()
        return positive, negative

    def bounds(self, parts: list[Part]) -> tuple[float, float, float]:
        """The searched (c_low, c_high) over `parts` and the positive share P/(P+N) at those bounds."""
        c_low, c_high = self.c_low_start, self.c_high_start
        positive, negative = self.sums(parts, c_low, c_high)
        steps = 0  # c = start + k·step (no drift from repeated float addition), capped at max
        while self.statistic(positive, negative) < self.target and c_low < self.c_low_max and self.c_low_step > 0:
            steps += 1
            c_low = min(self.c_low_start + steps * self.c_low_step, self.c_low_max)
            positive, negative = self.sums(parts, c_low, c_high)
        steps = 0
        while self.statistic(positive, negative) < self.target and c_high < self.c_high_max and self.c_high_step > 0:
            steps += 1
            c_high = min(self.c_high_start + steps * self.c_high_step, self.c_high_max)
            positive, negative = self.sums(parts, c_low, c_high)
        share = 1.0 if negative <= 0 else positive / (positive + negative)
        return c_low, c_high, share

    def prepare(self, parts: list[LossInputs]) -> None:
        self._prepared = self.bounds([(ratio_of(x).detach(), x.adv, x.mask) for x in parts])

    def surrogate(self, x: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        ratio = ratio_of(x)
        c_low, c_high, share = self._prepared or self.bounds([(ratio.detach(), x.adv, x.mask)])
        loss, stats = clipped_surrogate(ratio, x.adv, c_low, c_high, self.dual_clip)
        value = ratio.detach()
        stats["bapo_c_low"] = torch.full_like(value, c_low)
        stats["bapo_c_high"] = torch.full_like(value, c_high)
        stats["bapo_positive_share"] = torch.full_like(value, share)
        return loss, stats
