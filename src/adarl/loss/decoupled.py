"""Decoupled PPO for stale and partial rollouts (AReaL, arXiv 2505.24298), algorithms.md §3.2.

Three policies: π_beh sampled the tokens (the generator's log-probs, possibly several versions
old: async or APRIL partial rollouts), π_prox is the recomputed ℓ_old at the start of the update,
π_θ is trained. The PPO trust region is taken around π_prox; π_beh is corrected by a detached
importance weight:

    u = exp(ℓ_θ − ℓ_prox)                        ℓ_prox = LossInputs.old_logp
    w = exp(ℓ_prox − ℓ_beh)  (detached)          ℓ_beh  = LossInputs.beh_logp
    L = w · max( −u·A, −clip(u, 1 − ε_low, 1 + ε_high)·A ),   dual clip min(·, −c·A) for A < 0

Behaviour weights far from 1 (`is_mode`): "mask" drops the tokens whose w leaves [w_min, w_max]
(AReaL's behav_imp_weight_cap), "clamp" clamps w into [w_min, w_max], "none" keeps w as is.
A masked token's loss is 0 but it keeps mask = 1 in the aggregation, so it still counts in the
denominator, as AReaL's Σ m·L / (original count of m): dropping a stale token shrinks the step,
it never re-weights the other tokens. With ℓ_beh = ℓ_prox, w = 1 and the loss is `ppo_clip`'s.
"""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
from pydantic import Field, model_validator
from pydantic.dataclasses import dataclass

from adarl.loss.base import LossInputs
from adarl.loss.ppo import PpoClip, clipped_surrogate
from adarl.registry import STRICT, register


@register("loss", "decoupled_ppo")
@dataclass(config=STRICT)
class DecoupledPpo(PpoClip):  # eps_low, eps_high, dual_clip as in ppo_clip
    is_mode: Literal["none", "mask", "clamp"] = "mask"
    w_max: float = Field(5.0, gt=0.0)  # AReaL's behav_imp_weight_cap in its examples
    w_min: float = Field(0.0, ge=0.0)  # 0 = no lower bound

    needs_behaviour: ClassVar[bool] = True

    @model_validator(mode="after")
    def _bounds_ordered(self) -> DecoupledPpo:
        if self.w_min >= self.w_max:
            raise ValueError(f"w_min={self.w_min} must be below w_max={self.w_max}")
        return self

    def surrogate(self, x: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if x.beh_logp is None:
            raise ValueError("decoupled_ppo needs the generator's behaviour log-probs (LossInputs.beh_logp)")
        ratio = torch.exp(x.logp - x.old_logp)  # u, against the proximal policy
        weight = torch.exp(x.old_logp - x.beh_logp).detach()  # w
        outside = (weight < self.w_min) | (weight > self.w_max)
        if self.is_mode == "mask":
            weight = torch.where(outside, torch.zeros_like(weight), weight)
        elif self.is_mode == "clamp":
            weight = weight.clamp(self.w_min, self.w_max)
        loss, stats = clipped_surrogate(ratio, x.adv, 1.0 - self.eps_low, 1.0 + self.eps_high, self.dual_clip)
        stats["behaviour_weight_mean"] = weight
        stats["is_masked_fraction"] = (outside if self.is_mode == "mask" else torch.zeros_like(outside)).float()
        stats["is_clamped_fraction"] = (outside if self.is_mode == "clamp" else torch.zeros_like(outside)).float()
        return weight * loss, stats
