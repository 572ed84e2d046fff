"""KL estimators between the policy and a frozen reference, per token.

k3 ("low_var_kl", Schulman's unbiased low-variance estimator), with verl's clamps:
    d = ℓ_ref − ℓ_θ,  KL = exp(d) − d − 1,  d ∈ [−20, 20],  KL ∈ [−10, 10]
"""

from __future__ import annotations

import torch


def k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    d = (ref_logp - logp).clamp(-20.0, 20.0)
    return (torch.exp(d) - d - 1.0).clamp(-10.0, 10.0)
