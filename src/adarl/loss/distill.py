"""Distillation auxiliaries (algorithms.md §7): per-token terms added to the RL loss by a weight,

    L_{i,t} = rl_weight · L^RL_{i,t} + weight · L^distill_{i,t}

on the policy's own sampled tokens, from the teacher's log-probs of them (train/teacher.py: the
policy with privileged context, a snapshot, an EMA, or another model). With ℓ_θ the policy's
log-prob of the sampled token, ℓ_T the teacher's, and g = sg(ℓ_T − ℓ_θ):

- `opd` (on-policy distillation; Agarwal et al. 2024, "On-Policy Distillation of Language Models"):
  reverse KL(π_θ ‖ π_T) on the student's samples. `estimator: sampled` (default) is its
  policy-gradient form with per-token reward g: L = −g·ℓ_θ (its expectation is ∇ KL). `estimator:
  topk` is the exact divergence restricted to the teacher's top-k tokens at each position,
  `direction: reverse` Σ_v π_θ(v)(ℓ_θ(v) − ℓ_T(v)) or `forward` Σ_v p_T(v)(ℓ_T(v) − ℓ_θ(v)) (p_T
  renormalised over the k tokens).
- `aopd` (AOPD, §7.2, from the abstract): where g > 0, L_pos = −g·ℓ_θ (keep the positive signal); where
  g ≤ 0, instead of pushing the sampled token down, L_div = KL(π_T ‖ π_θ) over the teacher's top-k
  (k = 32) at that position. §7.2 aggregates the two regions apart,
      L = agg(L_pos over g > 0) + div_weight·agg(L_div over g ≤ 0)          (`aggregation: separate`)
  with agg the loss's own (`loss.agg`), so under a mean a region with few tokens weighs as much as one
  with many. Each token of a region is scaled so that the loss's aggregation of the scaled terms is
  that sum: `token-mean` by N/N_region (N the rows' tokens in the loss, N_region those in its region;
  the rows are the learner's micro-batch, so this is exact for a mini-batch that fits one micro-batch,
  `train.micro_batch_tokens`, and otherwise each micro-batch's regions are averaged apart and the
  micro-batches combine by their token share); `seq-mean-token-mean` by |o_i|/|R_i| within each
  sequence (exact); the token-sum aggregations divide by no count, so there the two forms agree.
  `joint` is one aggregation over every token (agg(L_pos·[g > 0] + div_weight·L_div·[g ≤ 0])).
- `sdar` (SDAR, §7.1, from the abstract): L = −σ(g/τ)·ℓ_θ with the gate detached (τ = 1): tokens the
  teacher endorses (g > 0) are pulled up with weight > 1/2, tokens it rejects get a softly smaller
  weight, never a push down.

Every term is 0 where `mask` is 0. Statistics: the mean gap g, the SDAR gate, the share of
tokens in AOPD's positive region.
"""

from __future__ import annotations

import torch


def distill_terms(method: str, logp: torch.Tensor, teacher_logp: torch.Tensor, *, estimator: str = "sampled",
                  direction: str = "reverse", gate_temperature: float = 1.0, div_weight: float = 1.0,
                  student_top: torch.Tensor | None = None, teacher_top: torch.Tensor | None = None,
                  mask: torch.Tensor | None = None, aggregation: str = "joint",
                  agg: str = "token-mean") -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(B, T) per-token distillation loss and per-token statistics (see the module docstring).
    `student_top` / `teacher_top`: (B, T, k) log-probs of the teacher's top-k tokens under each;
    `mask`: the tokens in the loss, which AOPD's `separate` aggregation counts per region under the loss's
    aggregation `agg`."""
    gap = (teacher_logp - logp).detach()
    stats = {"distill/gap": gap}
    if method == "sdar":
        gate = torch.sigmoid(gap / gate_temperature)
        stats["distill/gate"] = gate
        return -gate * logp, stats
    if method == "opd" and estimator == "sampled":
        return -gap * logp, stats
    if student_top is None or teacher_top is None:
        raise ValueError(f"distill {method} with estimator {estimator} needs the teacher's top-k (distill.top_k > 0)")
    p_t = torch.softmax(teacher_top, dim=-1)  # the teacher renormalised over its top-k
    forward_kl = (p_t * (torch.log_softmax(teacher_top, dim=-1) - student_top)).sum(-1)
    if method == "opd":
        if direction == "forward":
            return forward_kl, stats
        p_s = student_top.exp()
        return (p_s * (student_top - teacher_top)).sum(-1), stats
    if method == "aopd":
        positive = (gap > 0).float()
        stats["distill/positive_fraction"] = positive
        pos_scale: torch.Tensor | float = 1.0
        neg_scale: torch.Tensor | float = 1.0
        if aggregation == "separate" and agg in ("token-mean", "seq-mean-token-mean"):
            if mask is None:
                raise ValueError("distill aopd with aggregation separate needs the loss mask to count each region")
            # token-mean counts over the rows, seq-mean-token-mean within each sequence
            dims: tuple[int, ...] = (0, 1) if agg == "token-mean" else (1,)
            n = mask.sum(dims, keepdim=True)
            pos_scale = n / (mask * positive).sum(dims, keepdim=True).clamp(min=1.0)  # an empty region adds nothing
            neg_scale = n / (mask * (1.0 - positive)).sum(dims, keepdim=True).clamp(min=1.0)
        elif aggregation not in ("separate", "joint"):
            raise ValueError(f"unknown aopd aggregation {aggregation!r}: separate or joint")
        return (positive * pos_scale * (-gap * logp)
                + (1.0 - positive) * neg_scale * div_weight * forward_kl), stats
    raise ValueError(f"unknown distillation method {method!r}: opd, aopd or sdar")
