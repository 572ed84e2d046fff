"""A policy loss written outside adarl and named by import path in a recipe:

    loss: {name: "plugin_loss:Cispo", eps_high: 0.2}

(with this folder on PYTHONPATH). CISPO (MiniMax-M1, 2025) clips the importance weight instead of
the update, so no token's gradient is ever dropped:

    L_{i,t} = −sg(min(r_{i,t}, 1 + ε_high)) · A_{i,t} · ℓ_θ(y_t),    r = exp(ℓ_θ − ℓ_old)

The learner fills the inputs (`LossInputs`) and aggregates with `agg`, as for a built-in loss;
KL and entropy terms come from `PolicyLoss`.
"""

from __future__ import annotations

import torch
from pydantic import Field
from pydantic.dataclasses import dataclass

from adarl.loss.base import LossInputs, PolicyLoss
from adarl.registry import STRICT


@dataclass(config=STRICT)
class Cispo(PolicyLoss):
    eps_high: float = Field(0.2, gt=0.0)  # ε_high: the importance weight's upper clip

    def surrogate(self, x: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        ratio = torch.exp(x.logp - x.old_logp)
        weight = ratio.clamp(max=1.0 + self.eps_high).detach()
        return -weight * x.adv * x.logp, {"clip_fraction": (ratio > 1.0 + self.eps_high).float()}
