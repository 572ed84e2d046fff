"""PPO-clip with decoupled bounds (GRPO §1.1, DAPO clip-higher §1.3) and optional dual clip.

    ρ = exp(ℓ_θ − ℓ_old)
    L^clip = −min( ρ·A, clip(ρ, 1 − ε_low, 1 + ε_high)·A )
    dual clip (A < 0):  L = min( L^clip, −c·A )

KL and entropy terms are added by PolicyLoss (loss/base.py); aggregation over tokens is `agg`
(loss/aggregate.py), applied by the trainer.
"""

from __future__ import annotations

import torch
from pydantic import Field
from pydantic.dataclasses import dataclass

from adarl.loss.base import LossInputs, PolicyLoss
from adarl.registry import STRICT, register


def clipped_surrogate(ratio: torch.Tensor, adv: torch.Tensor, low: torch.Tensor | float, high: torch.Tensor | float,
                      dual_clip: float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """−min(ρA, clip(ρ, low, high)A), then the dual clip for A < 0; bounds may be per-token tensors.

    Stats: `clip_fraction` (the clipped term is the smaller), and which bound holds the gradient:
    `clip_low_fraction` (ρ < low, A < 0) and `clip_high_fraction` (ρ > high, A > 0).
    """
    unclipped = ratio * adv
    clipped = torch.minimum(torch.maximum(ratio, torch.as_tensor(low)), torch.as_tensor(high)) * adv
    loss = -torch.minimum(unclipped, clipped)
    value = ratio.detach()
    stats = {"clip_fraction": (clipped < unclipped).float(),
             "clip_low_fraction": ((value < low) & (adv < 0)).float(),
             "clip_high_fraction": ((value > high) & (adv > 0)).float()}
    if dual_clip is not None:
        dual = -dual_clip * adv
        use_dual = (adv < 0) & (loss > dual)
        loss = torch.where(use_dual, dual, loss)
        stats["dual_clip_fraction"] = use_dual.float()
    return loss, stats


@register("loss", "ppo_clip")
@dataclass(config=STRICT)
class PpoClip(PolicyLoss):
    eps_low: float = Field(0.2, ge=0.0)
    eps_high: float = Field(0.2, ge=0.0)
    dual_clip: float | None = Field(None, gt=1.0)  # c; None = off

    def surrogate(self, x: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        ratio = torch.exp(x.logp - x.old_logp)
        return clipped_surrogate(ratio, x.adv, 1.0 - self.eps_low, 1.0 + self.eps_high, self.dual_clip)
