"""PPO-clip with decoupled bounds (GRPO §1.1, DAPO clip-higher §1.3), optional dual clip and k3 KL.

    ρ = exp(ℓ_θ − ℓ_old)
    L^clip = −min( ρ·A, clip(ρ, 1 − ε_low, 1 + ε_high)·A )
    dual clip (A < 0):  L = min( L^clip, −c·A )
    L = L^clip + β·KL_k3(θ ‖ ref)

Aggregation over tokens is `agg` (loss/aggregate.py); the trainer applies it.
"""

from __future__ import annotations

import torch
from pydantic import Field
from pydantic.dataclasses import dataclass

from adarl.loss.aggregate import Aggregation
from adarl.loss.kl import k3
from adarl.registry import STRICT, register


@register("loss", "ppo_clip")
@dataclass(config=STRICT)
class PpoClip:
    eps_low: float = Field(0.2, ge=0.0)
    eps_high: float = Field(0.2, ge=0.0)
    dual_clip: float | None = Field(None, gt=1.0)  # c; None = off
    agg: Aggregation = "token-mean"
    max_len: int | None = None  # L_max for seq-mean-token-sum-norm (default: rollout.max_new_tokens)
    kl_coef: float = Field(0.0, ge=0.0)  # β; > 0 loads a frozen reference model

    def __call__(
        self,
        logp: torch.Tensor,
        old_logp: torch.Tensor,
        adv: torch.Tensor,
        mask: torch.Tensor,
        ref_logp: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        ratio = torch.exp(logp - old_logp)
        unclipped = ratio * adv
        clipped = ratio.clamp(1.0 - self.eps_low, 1.0 + self.eps_high) * adv
        loss = -torch.minimum(unclipped, clipped)
        stats = {"clip_fraction": (clipped < unclipped).float()}
        if self.dual_clip is not None:
            dual = -self.dual_clip * adv
            use_dual = (adv < 0) & (loss > dual)
            loss = torch.where(use_dual, dual, loss)
            stats["dual_clip_fraction"] = use_dual.float()
        if self.kl_coef > 0:
            if ref_logp is None:
                raise ValueError("kl_coef > 0 but no reference log-probs were given")
            kl = k3(logp, ref_logp)
            loss = loss + self.kl_coef * kl
            stats["kl"] = kl.detach()
        return loss, stats
