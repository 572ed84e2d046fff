"""Train–inference mismatch correction: truncated and masked importance sampling, IcePop, the geometric
mask (algorithms.md §3.6; TRL, verl, SkyRL, NeMo-RL, AReaL).

The engine that samples (vLLM's kernels, another precision, another process) draws from π_beh, not from
the learner's π_old, even with the same weights. Every framework weighs the loss by the ratio between the
learner's recomputed old-policy log-probs and the sampler's:

    w_{i,t} = exp(ℓ_old − ℓ_beh)                 per token
    W_i     = exp(Σ_t (ℓ_old − ℓ_beh))           per sequence: the product of its token ratios
    Ŵ_i     = exp(mean_t (ℓ_old − ℓ_beh))        per sequence: their geometric mean

and sets the weight ω of every token by one of five rules, [low, high] the band (`train.mismatch`):

    token_truncate     ω = clamp(w, low, high)              TIS (TRL token_truncate, NeMo "tis", verl token)
    sequence_truncate  ω = clamp(W_i, low, high)            sequence TIS
    token_mask         ω = w · 1[low ≤ w ≤ high]            MIS per token = IcePop's two-sided mask
    sequence_mask      ω = W_i · 1[low ≤ W_i ≤ high]        MIS per sequence: TRL's default (band [0, 3])
    geometric_mask     ω = 1[low ≤ Ŵ_i ≤ high]              verl seq_mean_k1, SkyRL geometric

ω is detached and multiplies the loss's own (already clipped) surrogate, never its KL or entropy terms:

    L_{i,t} = ω_{i,t} · max(−ρA, −clip(ρ, 1 − ε_low, 1 + ε_high)A),    ρ = exp(ℓ_θ − ℓ_old)

so the PPO clip acts on ρ = π_θ/π_old alone and ω, from π_old/π_beh, is never clipped by ε. A masked
token keeps its place in the loss's denominator (TRL, NeMo-RL and AReaL; verl shrinks it): dropping it
shrinks the step, it never re-weights the other tokens. A sequence's statistics run over the tokens the
loss trains (`mask`). The rules select and clamp, never multiply by a mask, so a product that overflows
(a long sequence: exp(Σ) = inf) is dropped or truncated, never inf · 0 = NaN.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch

Mode = Literal["token_truncate", "sequence_truncate", "token_mask", "sequence_mask", "geometric_mask"]
LOG_RATIO_LIMIT = 20.0  # the logged ratios are clipped to e^{±20} (a metric stays a finite number)
QUANTILES = {"p01": 0.01, "p50": 0.5, "p99": 0.99}  # of the token ratio w, logged every step


def per_sequence(values: torch.Tensor, mask: torch.Tensor, how: Literal["sum", "mean", "max"]) -> torch.Tensor:
    """(B, 1): the sum, mean or max of each row's `values` over its tokens in `mask` (an empty row: 0)."""
    kept = mask > 0
    if how == "max":
        top = torch.where(kept, values, torch.full_like(values, -torch.inf)).amax(dim=-1, keepdim=True)
        return torch.where(kept.any(dim=-1, keepdim=True), top, torch.zeros_like(top))
    total = torch.where(kept, values, torch.zeros_like(values)).sum(dim=-1, keepdim=True)
    return total / kept.sum(dim=-1, keepdim=True).clamp(min=1) if how == "mean" else total


def correction(old_logp: torch.Tensor, beh_logp: torch.Tensor, mask: torch.Tensor, mode: Mode, low: float,
               high: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """ω (B, T), detached, and per-token statistics (the learner averages them over `mask`):
    `mismatch/masked_fraction` (ω set to 0 by a mask rule), `mismatch/truncated_fraction` (the ratio moved
    into the band by a truncate rule) and `mismatch/weight_mean` (ω)."""
    log_w = torch.where(mask > 0, old_logp.detach() - beh_logp, torch.zeros_like(beh_logp))
    if mode.startswith("token"):
        log_ratio = log_w
    else:  # one ratio per sequence, the same for each of its tokens
        how = "mean" if mode == "geometric_mask" else "sum"
        log_ratio = per_sequence(log_w, mask, how).expand_as(log_w)
    ratio = torch.exp(log_ratio)
    inside = (ratio >= low) & (ratio <= high)
    none = torch.zeros_like(ratio)
    if mode.endswith("truncate"):
        weight, masked, truncated = ratio.clamp(low, high), none, (~inside).float()
    else:
        kept = torch.ones_like(ratio) if mode == "geometric_mask" else ratio
        weight, masked, truncated = torch.where(inside, kept, none), (~inside).float(), none
    return weight, {"mismatch/masked_fraction": masked, "mismatch/truncated_fraction": truncated,
                    "mismatch/weight_mean": weight}


def ratio_quantiles(log_w: np.ndarray) -> dict[str, float]:
    """The step's token ratios w = exp(ℓ_old − ℓ_beh) over the trained tokens: min, 1%, median, 99%, max."""
    if log_w.size == 0:
        return {}
    w = np.exp(np.clip(np.asarray(log_w, dtype=np.float64), -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
    out = {"mismatch/ratio_min": float(w.min()), "mismatch/ratio_max": float(w.max())}
    out.update({f"mismatch/ratio_{name}": float(np.quantile(w, q)) for name, q in QUANTILES.items()})
    return out
