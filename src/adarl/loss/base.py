"""PolicyLoss protocol: a per-token loss from current, proximal and behaviour log-probs."""

from __future__ import annotations

from typing import Protocol

import torch


class PolicyLoss(Protocol):
    agg: str
    kl_coef: float

    def __call__(
        self,
        logp: torch.Tensor,
        old_logp: torch.Tensor,
        adv: torch.Tensor,
        mask: torch.Tensor,
        ref_logp: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Return the (B, T) per-token loss (to be aggregated) and per-token statistics."""
        ...
