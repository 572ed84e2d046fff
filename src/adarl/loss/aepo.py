"""AEPO: entropy-balanced policy optimisation, loss side (algorithms.md §4.3 (c), (d); [abstract]).

(d) Entropy-aware advantage, ĥ the batch-normalised token entropy (tokens/entropy.py):
    A'_{i,t} = A_{i,t}·(1 + α_H·ĥ_{i,t})                                α_H = 0.1 (alpha_h_guess)
(c) Entropy-balanced clipping: a token clipped at the upper bound with A' > 0 keeps a gradient
    through a stop-gradient rescaling instead of a constant,
    L = −(1 + ε_high)·ρ/sg(ρ)·A'      (value −(1 + ε_high)·A', gradient −(1 + ε_high)·A' per unit ℓ_θ)
    every other token: L = −min( ρA', clip(ρ, 1 − ε_low, 1 + ε_high)A' ).

§4.3 gives no ε; the defaults ε_low = 0.2, ε_high = 0.28 are DAPO's clip-higher (§1.3).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from pydantic import Field
from pydantic.dataclasses import dataclass

from adarl.loss.base import LossInputs, PolicyLoss
from adarl.loss.ppo import clipped_surrogate
from adarl.registry import STRICT, register


@register("loss", "aepo")
@dataclass(config=STRICT)
class Aepo(PolicyLoss):
    eps_low: float = Field(0.2, ge=0.0)  # ε_low (DAPO clip-higher, §1.3)
    eps_high: float = Field(0.28, ge=0.0)  # ε_high (DAPO clip-higher, §1.3)
    alpha_h_guess: float = Field(0.1, ge=0.0)  # α_H
    dual_clip: float | None = Field(None, gt=1.0)  # c; None = off, as for ppo_clip
    entropy_advantage: bool = True  # (d)
    balanced_clip: bool = True  # (c)

    needs_entropy: ClassVar[bool] = True

    def surrogate(self, x: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        adv = x.adv
        if self.entropy_advantage:  # (d)
            if x.entropy_norm is None:
                raise ValueError("the aepo loss needs the normalised token entropy ĥ (LossInputs.entropy_norm)")
            adv = adv * (1.0 + self.alpha_h_guess * x.entropy_norm.detach())
        ratio = torch.exp(x.logp - x.old_logp)  # ρ
        low, high = 1.0 - self.eps_low, 1.0 + self.eps_high
        loss, stats = clipped_surrogate(ratio, adv, low, high, self.dual_clip)
        if self.balanced_clip:  # (c): same value as the clip, gradient (1 + ε_high)·A'
            upper = stats["clip_high_fraction"] > 0  # ρ > 1 + ε_high with A' > 0
            loss = torch.where(upper, -high * (ratio / ratio.detach()) * adv, loss)
        return loss, stats
