"""HAPO's normalised token entropy ĥ ∈ [−1, 1] (algorithms.md §4.2, shared).

    x   = log(clamp(H, 1e-8))                          log-entropy
    med = quantile_q(x over the batch's tokens)        q = pivot (0.8 in HAPO's recipes, "nearest")
    s   = sqrt(mean (x − med)²)
    h   = (x − med) / s
    ĥ   = h / max(h > 0)  if h > 0,   h / |min(h < 0)|  if h ≤ 0

The statistics are fitted once per batch (from the entropies the generator recorded) and then
applied to any token: the trainer's losses and token weightings, and HAPO's sampler, which
uses the previous step's statistics. Applied to tokens outside the fitted batch, ĥ is clamped
to [−1, 1].
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class EntropyStats:
    median: float  # the pivot quantile of the log-entropy
    scale: float  # s, the RMS deviation of the log-entropy from the pivot
    pos_max: float  # max of h over the batch's tokens above the pivot (1.0 if none)
    neg_max: float  # |min of h| over the tokens at or below it (1.0 if none)

    @classmethod
    def fit(cls, entropies: np.ndarray, pivot: float = 0.8) -> EntropyStats:
        x = np.log(np.clip(np.asarray(entropies, dtype=np.float64).ravel(), 1e-8, None))
        if x.size == 0:
            return cls(0.0, 1.0, 1.0, 1.0)
        med = float(np.quantile(x, pivot, method="nearest"))
        scale = float(np.sqrt(np.mean((x - med) ** 2))) or 1.0
        h = (x - med) / scale
        pos, neg = h[h > 0], h[h <= 0]
        pos_max = float(pos.max()) if pos.size else 1.0
        neg_max = float(-neg.min()) if neg.size and neg.min() < 0 else 1.0
        return cls(med, scale, pos_max, neg_max)

    def normalise(self, entropy: torch.Tensor) -> torch.Tensor:
        """ĥ for a tensor of entropies, clamped to [−1, 1]."""
        h = (torch.log(entropy.clamp(min=1e-8)) - self.median) / self.scale
        h = torch.where(h > 0, h / self.pos_max, h / self.neg_max)
        return h.clamp(-1.0, 1.0)

    def state_dict(self) -> dict[str, float]:
        return asdict(self)


class EntropyObserver:
    """HAPO's ĥ statistics, one object shared by whoever reads them: fitted on each batch's trained
    tokens before its update (`observe`), read by the loss for that batch (`stats`) and by the
    adaptive-temperature sampler, which the trainer hands them after the weights move."""

    def __init__(self, pivot: float = 0.8) -> None:
        self.pivot = pivot
        self.stats: EntropyStats | None = None

    def observe(self, entropies: list[np.ndarray], masks: list[np.ndarray]) -> None:
        tokens = [h[m > 0] for h, m in zip(entropies, masks, strict=True)]
        self.stats = EntropyStats.fit(np.concatenate(tokens) if tokens else np.zeros(0), self.pivot)
