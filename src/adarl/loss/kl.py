"""KL estimators between the policy and a frozen reference, per token (Schulman, "Approximating
KL divergence"), for samples drawn from the policy, with d = ℓ_ref − ℓ_θ:

    k1 = −d                      unbiased, high variance, can be negative
    k2 = d² / 2                  biased, low variance
    k3 = exp(d) − d − 1          unbiased, low variance, ≥ 0 ("low_var_kl")

verl's clamps for k3: d ∈ [−20, 20], KL ∈ [−10, 10].
"""

from __future__ import annotations

import torch


def k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return logp - ref_logp


def k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return 0.5 * (logp - ref_logp) ** 2


def k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    d = (ref_logp - logp).clamp(-20.0, 20.0)
    return (torch.exp(d) - d - 1.0).clamp(-10.0, 10.0)


ESTIMATORS = {"k1": k1, "k2": k2, "k3": k3}
