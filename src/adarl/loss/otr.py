"""OTR: One-Token Rollout (Ming et al., 2025, "Guiding Supervised Fine-Tuning of LLMs with Policy Gradient").

Each target position n of a supervised answer is a one-step episode: the state is the prefix, the
policy π = softmax(z_n / T) its next-token distribution. K candidates are drawn from π (no gradient
through the draw) and rewarded against the ground-truth token y_n:

    c_1..c_K ~ π(·),   r_k = 1 if c_k = y_n else r⁻                 (r⁻ = negative_reward)
    b_k = (Σ_j r_j − r_k) / (K − 1)                                  (leave-one-out, baseline=True)
    L_n = −(1/K) Σ_k (r_k − b_k) · log π(c_k)

E[∇L_n] = −Σ_c π(c) r(c) ∇log π(c); with r⁻ = 0 that is −∇π(y_n): OTR ascends the *probability*
of the target where SFT (NLL, L_n = −log π(y_n)) ascends its log, so tokens the policy already
finds likely get the largest push and unreachable ones the smallest (the on-policy weighting).

Our reading of the abstract; what it does not say is marked _guess:
- baseline: leave-one-out (RLOO) mean of the other K − 1 rewards. It is unbiased (b_k does not
  depend on c_k), and it is how "penalising incorrect samples" arises even with r⁻ = 0: misses get
  advantage −hits/(K−1) < 0. Its advantages sum to zero, so the logit gradient is simply
  −(1/K) Σ_k A_k e_{c_k}.  _guess (baseline=False: plain REINFORCE, b = 0)
- degenerate case, no candidate equals y_n: every reward is r⁻, so with the baseline every advantage
  is 0 (and with b = 0, r⁻ = 0 the estimate is 0 too): a token the policy cannot yet reach would
  never be learned. With target_fallback=True the K-th candidate is replaced by y_n, i.e. at
  least one hit counts; its gradient is then that of one hit among K (with r⁻ = 0, b = 0:
  exactly (1/K) of the NLL gradient). This biases E[∇L] by at most P(no hit) = (1 − π(y))^K.  _guess
- log π(c) is taken at the sampling temperature T (the policy that drew c).  _guess: T = 1.0
- r⁻ = 0.0.  _guess
"""

from __future__ import annotations

import torch


def otr_token_loss(
    logits: torch.Tensor,
    targets: torch.Tensor,
    k: int,
    generator: torch.Generator,
    temperature: float = 1.0,
    negative_reward: float = 0.0,
    baseline: bool = True,
    target_fallback: bool = True,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-position OTR loss (N,) for logits (N, V) and ground-truth targets (N,).

    Stats (detached, per position): ``candidates`` (N, K) as used in the loss, ``hit_fraction``
    (share of the K draws equal to the target, before any fallback), ``fallback`` (1.0 where no draw
    hit), ``target_logprob`` (log π(y) at `temperature`).
    """
    if k < 1:
        raise ValueError(f"otr: k (candidates per position) must be at least 1, got {k}")
    if baseline and k < 2:
        raise ValueError("otr: baseline=True is a leave-one-out mean over the other k − 1 candidates and needs "
                         "k >= 2; raise k or set baseline=False")
    if temperature <= 0:
        raise ValueError(f"otr: temperature must be > 0, got {temperature}")
    logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)
    with torch.no_grad():
        candidates = torch.multinomial(logp_all.exp(), k, replacement=True, generator=generator)
        hits = candidates == targets[:, None]
        missed = ~hits.any(dim=-1)
        if target_fallback:
            candidates[:, -1] = torch.where(missed, targets, candidates[:, -1])
        reward = torch.where(candidates == targets[:, None], 1.0, float(negative_reward))
        advantage = reward - (reward.sum(-1, keepdim=True) - reward) / (k - 1) if baseline else reward
    loss = -(advantage * logp_all.gather(-1, candidates)).mean(-1)
    stats = {
        "candidates": candidates,
        "hit_fraction": hits.float().mean(-1),
        "fallback": missed.float(),
        "target_logprob": logp_all.detach().gather(-1, targets[:, None])[:, 0],
    }
    return loss, stats


def nll_token_loss(logits: torch.Tensor, targets: torch.Tensor,
                   temperature: float = 1.0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Plain SFT for comparison: L_n = −log π(y_n), π = softmax(z_n / T); same return shape as OTR."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1).gather(-1, targets[:, None])[:, 0]
    return -logp, {"target_logprob": logp.detach()}
