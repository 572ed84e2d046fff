"""Decoupled PPO for stale and partial rollouts (AReaL, arXiv 2505.24298), algorithms.md §3.2.

Three policies: π_beh sampled the tokens (the generator's log-probs, possibly several versions
old: async or APRIL partial rollouts), π_prox is the recomputed ℓ_old at the start of the update,
π_θ is trained. The PPO trust region is taken around π_prox; π_beh is corrected by a detached
importance weight:

    u = exp(ℓ_θ − ℓ_prox)                        ℓ_prox = LossInputs.old_logp
    w = exp(ℓ_prox − ℓ_beh)  (detached)          ℓ_beh  = LossInputs.beh_logp
    L = w · max( −u·A, −clip(u, 1 − ε_low, 1 + ε_high)·A ),   dual clip min(·, −c·A) for A < 0

Rejection (AReaL's `rejection_sampling`, §3.2) tests a statistic of π_prox against π_beh, per token
(`level: token`) or per sequence (`level: sequence`), against the band [w_min, w_max]:

    metric ratio   w                                        kl_k1  ℓ_prox − ℓ_beh
                   kl_k2  (ℓ_prox − ℓ_beh)² / 2              kl_k3  e^{ℓ_beh − ℓ_prox} − (ℓ_beh − ℓ_prox) − 1
    a sequence's statistic: `sequence_agg` (sum, mean, max) of its tokens' (for ratio: of log w, so
    mean is the geometric mean Ŵ; at the sequence level the ratio's weight is Ŵ for every token)

`is_mode`: "mask" drops the tokens (or whole sequences) whose statistic leaves the band (AReaL's default
action), "clamp" clamps w into [w_min, w_max] there (metric ratio only: the band bounds the ratio),
"none" keeps w as is. A masked token's loss is 0 but it keeps mask = 1 in the aggregation, so it still
counts in the denominator, as AReaL's Σ m·L / (original count of m): dropping a stale token shrinks the
step, it never re-weights the other tokens. With ℓ_beh = ℓ_prox, w = 1 and the loss is `ppo_clip`'s.

This weight is the sampler/learner mismatch correction too (algorithms.md §3.6: the same loss with
π_prox = π_old), so `train.mismatch` stays off with this loss (`weighs_behaviour`).
"""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
from pydantic import Field, model_validator
from pydantic.dataclasses import dataclass

from adarl.loss.base import LossInputs
from adarl.loss.kl import ESTIMATORS
from adarl.loss.mismatch import per_sequence
from adarl.loss.ppo import PpoClip, clipped_surrogate
from adarl.registry import STRICT, register


@register("loss", "decoupled_ppo")
@dataclass(config=STRICT)
class DecoupledPpo(PpoClip):  # eps_low, eps_high, dual_clip as in ppo_clip
    is_mode: Literal["none", "mask", "clamp"] = "mask"
    w_max: float = Field(5.0, gt=0.0)  # AReaL's rejection_sampling.upper (its behav_imp_weight_cap before)
    w_min: float | None = None  # its lower; None: no lower bound
    level: Literal["token", "sequence"] = "token"
    metric: Literal["ratio", "kl_k1", "kl_k2", "kl_k3"] = "ratio"
    sequence_agg: Literal["sum", "mean", "max"] = "mean"  # level sequence: a sequence's statistic (AReaL's agg)

    needs_behaviour: ClassVar[bool] = True
    weighs_behaviour: ClassVar[bool] = True

    @model_validator(mode="after")
    def _bounds_ordered(self) -> DecoupledPpo:
        if self.w_min is not None and self.w_min >= self.w_max:
            raise ValueError(f"w_min={self.w_min} must be below w_max={self.w_max}")
        if self.is_mode == "clamp" and self.metric != "ratio":
            raise ValueError(f"is_mode clamp clamps the ratio w into [w_min, w_max], which metric {self.metric} "
                             "does not bound: use metric ratio, or is_mode mask")
        return self

    def surrogate(self, x: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if x.beh_logp is None:
            raise ValueError("decoupled_ppo needs the generator's behaviour log-probs (LossInputs.beh_logp)")
        ratio = torch.exp(x.logp - x.old_logp)  # u, against the proximal policy
        prox = x.old_logp.detach()
        log_w = prox - x.beh_logp
        statistic = log_w if self.metric == "ratio" else ESTIMATORS[self.metric.removeprefix("kl_")](prox, x.beh_logp)
        if self.level == "sequence":
            statistic = per_sequence(statistic, x.mask, self.sequence_agg).expand_as(log_w)
            if self.metric == "ratio":  # AReaL: the geometric mean Ŵ weighs every token of the sequence
                log_w = per_sequence(log_w, x.mask, "mean").expand_as(log_w)
        weight = torch.exp(log_w)  # w
        if self.metric == "ratio":
            statistic = torch.exp(statistic)
        low = -torch.inf if self.w_min is None else self.w_min
        outside = (statistic < low) | (statistic > self.w_max)
        if self.is_mode == "mask":
            weight = torch.where(outside, torch.zeros_like(weight), weight)
        elif self.is_mode == "clamp":
            weight = torch.where(outside, weight.clamp(self.w_min or 0.0, self.w_max), weight)
        loss, stats = clipped_surrogate(ratio, x.adv, 1.0 - self.eps_low, 1.0 + self.eps_high, self.dual_clip)
        none = torch.zeros_like(weight)
        stats["behaviour_weight_mean"] = weight
        stats["behaviour_approx_kl"] = prox - x.beh_logp  # k1 of π_prox against π_beh (AReaL's behave_approx_kl)
        stats["is_masked_fraction"] = outside.float() if self.is_mode == "mask" else none
        stats["is_clamped_fraction"] = outside.float() if self.is_mode == "clamp" else none
        return weight * loss, stats
