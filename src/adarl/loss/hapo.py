"""HAPO: entropy-heterogeneous policy optimisation, loss side (algorithms.md §4.2 (c), (d)).

With ĥ ∈ [−1, 1] the batch-normalised token entropy (tokens/entropy.py):

(d) Asymmetric Adaptive Clipping, per token (α = clip_alpha = 1.0):
    ĥ ≤ 0 (low entropy):   ε_low'  = ε_low ·(1 − α·ĥ)     wider downward room
    ĥ > 0 (high entropy):  ε_high' = ε_high·(1 + α·ĥ)     wider upward room
(c) Differential Advantage Redistribution (β = adv_beta = 1.0), with the bounds of (d):
    A_ent = A·(1 + β·ĥ);   neutral zone 1 − ε_low'/2 < ρ < 1 + ε_high'/2   (ρ detached)
    ĥ > 0:  A' = A inside the zone, A_ent outside;   ĥ ≤ 0:  A' = A_ent inside, A outside
Loss: L = −min( ρA', clip(ρ, 1 − ε_low', 1 + ε_high')A' ), dual clip min(L, −c·A') for A' < 0, c = 10.

Code reference: starriver030515/HAPO `core_algos.py` (`ada_clip`, `ada_advantage`, `compute_policy_loss`).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from pydantic import Field
from pydantic.dataclasses import dataclass

from adarl.loss.base import LossInputs, PolicyLoss
from adarl.loss.ppo import clipped_surrogate
from adarl.registry import STRICT, register


@register("loss", "hapo")
@dataclass(config=STRICT)
class Hapo(PolicyLoss):
    eps_low: float = Field(0.2, ge=0.0)  # ε_low
    eps_high: float = Field(0.2, ge=0.0)  # ε_high
    clip_alpha: float = Field(1.0, ge=0.0)  # α
    adv_beta: float = Field(1.0, ge=0.0)  # β
    dual_clip: float | None = Field(10.0, gt=1.0)  # c = clip_ratio_c; None = off
    redistribute: bool = True  # (c)
    adaptive_clip: bool = True  # (d)

    needs_entropy: ClassVar[bool] = True

    def surrogate(self, x: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if x.entropy_norm is None:
            raise ValueError("the hapo loss needs the normalised token entropy ĥ (LossInputs.entropy_norm)")
        h = x.entropy_norm.detach()  # ĥ
        ratio = torch.exp(x.logp - x.old_logp)  # ρ
        eps_low = torch.full_like(h, self.eps_low)
        eps_high = torch.full_like(h, self.eps_high)
        if self.adaptive_clip:  # (d)
            eps_low = torch.where(h <= 0, self.eps_low * (1.0 - self.clip_alpha * h), eps_low)
            eps_high = torch.where(h > 0, self.eps_high * (1.0 + self.clip_alpha * h), eps_high)
        adv = x.adv
        stats: dict[str, torch.Tensor] = {}
        if self.redistribute:  # (c)
            adv_ent = adv * (1.0 + self.adv_beta * h)  # A_ent
            value = ratio.detach()
            neutral = (value > 1.0 - eps_low / 2) & (value < 1.0 + eps_high / 2)
            use_ent = torch.where(h > 0, ~neutral, neutral)
            adv = torch.where(use_ent, adv_ent, adv)
            stats["hapo_redistributed_fraction"] = use_ent.float()
        low, high = 1.0 - eps_low, 1.0 + eps_high
        loss, clip_stats = clipped_surrogate(ratio, adv, low, high, self.dual_clip)
        stats.update(clip_stats)
        return loss, stats
