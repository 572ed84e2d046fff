"""GSPO: Group Sequence Policy Optimization (Zheng et al.), algorithms.md §1.4.

The importance ratio and its clip live at the sequence level, as the reward does:

    s_i = exp( (1/|o_i|) Σ_t m_{i,t} (ℓ_θ − ℓ_old) )                 length-normalised geometric mean
    GSPO-token:  log s_{i,t} = sg[log s_i] + ℓ_θ(i,t) − sg[ℓ_θ(i,t)],   clamp log s_{i,t} ≤ 10
    L_{i,t} = −min( s_{i,t} A_{i,t}, clip(s_{i,t}, 1 − ε_low, 1 + ε_high) A_{i,t} )

s_{i,t} equals s_i in value; its gradient is s_i ∇ℓ_θ(i,t). Aggregation is always
seq-mean-token-mean; the bounds are tiny (ε_low = 3e-4, ε_high = 4e-4) because s_i is a mean
over tokens. No dual clip. Code reference: verl `compute_policy_loss_gspo`.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field, field_validator
from pydantic.dataclasses import dataclass

from adarl.loss.base import LossInputs, PolicyLoss
from adarl.loss.ppo import clipped_surrogate
from adarl.registry import STRICT, register

MAX_LOG_RATIO = 10.0  # verl's clamp on log s_{i,t}


@register("loss", "gspo")
@dataclass(config=STRICT)
class Gspo(PolicyLoss):
    agg: Literal["seq-mean-token-mean"] = "seq-mean-token-mean"  # forced by §1.4
    eps_low: float = Field(3e-4, ge=0.0)  # ε_low
    eps_high: float = Field(4e-4, ge=0.0)  # ε_high

    @field_validator("agg", mode="before")
    @classmethod
    def _only_seq_mean_token_mean(cls, value: Any) -> Any:
        if value != "seq-mean-token-mean":
            raise ValueError(f"GSPO always aggregates with 'seq-mean-token-mean' (algorithms.md §1.4), got {value!r}; "
                             "remove `agg` from the loss section or set it to 'seq-mean-token-mean'")
        return value

    def surrogate(self, x: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        live = x.mask > 0
        log_ratio = torch.where(live, x.logp - x.old_logp, torch.zeros_like(x.logp))
        lengths = x.mask.sum(-1).clamp(min=1.0)  # |o_i|
        log_s = (log_ratio.sum(-1) / lengths).detach()  # sg[log s_i], (B,)
        log_s_token = (log_s[:, None] + x.logp - x.logp.detach()).clamp(max=MAX_LOG_RATIO)  # log s_{i,t}
        s = torch.exp(log_s_token)
        low, high = 1.0 - self.eps_low, 1.0 + self.eps_high
        loss, stats = clipped_surrogate(s, x.adv, low, high)
        s_value = s.detach()
        stats["gspo_seq_ratio"] = s_value
        return loss, stats
