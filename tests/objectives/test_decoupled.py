"""Decoupled PPO (AReaL, algorithms.md §3.2): values worked by hand, PPO-clip when π_beh = π_prox, gradients.

Every example takes ℓ_prox = 0, so ℓ_θ = log u and w = exp(−ℓ_beh); each token's loss depends on
its own ℓ_θ only, so d L_t / d ℓ_θ(t) is read straight from `logp.grad`.
"""

from __future__ import annotations

import math

import pydantic
import pytest
import torch

from adarl.loss.aggregate import aggregate
from adarl.loss.base import LossInputs
from adarl.loss.decoupled import DecoupledPpo
from adarl.loss.ppo import PpoClip
from adarl.registry import build

# five tokens, ℓ_prox = 0:             log u   A     w = exp(ℓ_prox − ℓ_beh)
#  t0  A > 0, u inside the clip        0.1     1     2
#  t1  A > 0, u above 1 + ε_high       0.3     1     e^{−0.5}
#  t2  A < 0, u below 1 − ε_low       −0.5    −2     3
#  t3  w above w_max = 5               0.0     1    10
#  t4  w below w_min = 0.1             0.05   −1     0.05
LOG_U = [0.1, 0.3, -0.5, 0.0, 0.05]
ADV = [1.0, 1.0, -2.0, 1.0, -1.0]
W = [2.0, math.exp(-0.5), 3.0, 10.0, 0.05]


def inputs(log_u: list[float], adv: list[float], w: list[float], mask: list[float] | None = None) -> LossInputs:
    logp = torch.tensor([log_u], dtype=torch.float64, requires_grad=True)
    return LossInputs(
        logp=logp, old_logp=torch.zeros_like(logp.detach()), adv=torch.tensor([adv], dtype=torch.float64),
        mask=torch.ones_like(logp.detach()) if mask is None else torch.tensor([mask], dtype=torch.float64),
        beh_logp=-torch.log(torch.tensor([w], dtype=torch.float64)),
    )


def loss_and_grad(loss_fn: DecoupledPpo, x: LossInputs) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    loss, stats = loss_fn(x)
    (loss * x.mask).sum().backward()
    assert x.logp.grad is not None
    return loss.detach()[0].tolist(), x.logp.grad[0].tolist(), stats


# the PPO-clip term of each token, ε = 0.2:
#  t0  −min(e^{0.1}·1, clip·1)        = −e^{0.1} = −1.1051709   grad −e^{0.1}
#  t1  −min(e^{0.3}, 1.2)             = −1.2                    grad 0 (clipped)
#  t2  −min(e^{−0.5}·(−2), 0.8·(−2))  = 1.6                     grad 0 (clipped)
#  t3  −1                                                       grad −1
#  t4  −min(e^{0.05}·(−1), 1.05127·(−1)) = e^{0.05} = 1.0512711 grad e^{0.05}
PPO = [-math.exp(0.1), -1.2, 1.6, -1.0, math.exp(0.05)]
PPO_GRAD = [-math.exp(0.1), 0.0, 0.0, -1.0, math.exp(0.05)]


@pytest.mark.parametrize(("is_mode", "weights"), [
    ("none", W),  # L = w · PPO: [−2.2103418, −0.7278373, 4.8, −10, 0.0525636]
    ("mask", [2.0, math.exp(-0.5), 3.0, 0.0, 0.0]),  # t3 (w > 5) and t4 (w < 0.1) dropped
    ("clamp", [2.0, math.exp(-0.5), 3.0, 5.0, 0.1]),  # t3 clamped to 5, t4 to 0.1
])
def test_hand_computed_losses_and_gradients(is_mode: str, weights: list[float]) -> None:
    loss_fn = DecoupledPpo(is_mode=is_mode, w_min=0.1)  # type: ignore[arg-type]
    loss, grad, stats = loss_and_grad(loss_fn, inputs(LOG_U, ADV, W))
    # (clipped_surrogate holds the clip bounds in float32: 1.2 is 1.2 ± 5e-8)
    assert loss == pytest.approx([w * p for w, p in zip(weights, PPO, strict=True)], abs=1e-6)
    assert grad == pytest.approx([w * g for w, g in zip(weights, PPO_GRAD, strict=True)], abs=1e-6)
    assert stats["behaviour_weight_mean"][0].tolist() == pytest.approx(weights, abs=1e-12)
    assert stats["is_masked_fraction"][0].tolist() == ([0, 0, 0, 1, 1] if is_mode == "mask" else [0] * 5)
    assert stats["is_clamped_fraction"][0].tolist() == ([0, 0, 0, 1, 1] if is_mode == "clamp" else [0] * 5)
    assert stats["clip_fraction"][0].tolist() == [0, 1, 1, 0, 0]
    assert stats["clip_high_fraction"][0].tolist() == [0, 1, 0, 0, 0]
    assert stats["clip_low_fraction"][0].tolist() == [0, 0, 1, 0, 0]


def test_gradient_signs_follow_the_advantage_and_the_weight_scales_them() -> None:
    """Unclipped tokens: the loss falls as ℓ_θ rises when A > 0, rises when A < 0; |grad| = w·u·|A|."""
    x = inputs([0.0, 0.0, 0.0, 0.0], [1.0, 1.0, -1.0, -1.0], [0.5, 4.0, 0.5, 4.0])
    _, grad, _ = loss_and_grad(DecoupledPpo(), x)
    assert grad == pytest.approx([-0.5, -4.0, 0.5, 4.0], abs=1e-12)


def test_equals_ppo_clip_exactly_when_behaviour_is_proximal() -> None:
    """ℓ_beh = ℓ_prox: w = exp(0) = 1 exactly, so loss and gradient are ppo_clip's bit for bit."""
    gen = torch.Generator().manual_seed(0)
    shape = (3, 7)
    logp0 = torch.randn(shape, generator=gen, dtype=torch.float64) * 0.3
    old = torch.randn(shape, generator=gen, dtype=torch.float64) * 0.3
    adv = torch.randn(shape, generator=gen, dtype=torch.float64)
    mask = (torch.rand(shape, generator=gen) > 0.2).double()
    logp0[0, :2], adv[0, :2], mask[0, :2] = old[0, :2] + 1.5, -1.0, 1.0  # ρ = e^{1.5} > c = 3, A < 0: dual clip
    results = []
    for loss_fn in (PpoClip(eps_low=0.2, eps_high=0.28, dual_clip=3.0),
                    DecoupledPpo(eps_low=0.2, eps_high=0.28, dual_clip=3.0, is_mode="clamp")):
        logp = logp0.clone().requires_grad_(True)
        x = LossInputs(logp=logp, old_logp=old, adv=adv, mask=mask, beh_logp=old.clone())
        loss, stats = loss_fn(x)
        aggregate(loss, mask, "token-mean").backward()
        results.append((loss.detach(), logp.grad, stats))
    (ppo_loss, ppo_grad, ppo_stats), (dec_loss, dec_grad, dec_stats) = results
    assert torch.equal(ppo_loss, dec_loss) and torch.equal(ppo_grad, dec_grad)
    assert torch.equal(ppo_stats["clip_fraction"], dec_stats["clip_fraction"])
    assert torch.equal(ppo_stats["dual_clip_fraction"], dec_stats["dual_clip_fraction"])
    assert ppo_stats["clip_fraction"].sum() > 0 and ppo_stats["dual_clip_fraction"].sum() > 0  # both clips bite


def test_masked_tokens_keep_their_place_in_the_denominator() -> None:
    """token-mean over mask: a dropped token adds 0 to the sum and 1 to the count (AReaL's original count)."""
    x = inputs([0.0, 0.0], [1.0, 1.0], [2.0, 10.0])  # the second token's w = 10 > w_max
    loss, _ = DecoupledPpo(is_mode="mask")(x)
    assert loss[0].tolist() == pytest.approx([-2.0, 0.0])
    assert aggregate(loss, x.mask, "token-mean").item() == pytest.approx(-2.0 / 2)


def test_registered_and_validated() -> None:
    loss_fn = build("loss", {"name": "decoupled_ppo", "eps_high": 0.28, "is_mode": "clamp"})
    assert isinstance(loss_fn, DecoupledPpo) and loss_fn.eps_high == 0.28 and loss_fn.w_max == 5.0
    with pytest.raises(pydantic.ValidationError, match="w_min=5.0 must be below w_max=5.0"):
        DecoupledPpo(w_min=5.0)
    with pytest.raises(pydantic.ValidationError):
        DecoupledPpo(is_mode="drop")  # type: ignore[arg-type]
    x = inputs([0.0], [1.0], [1.0])
    x.beh_logp = None
    with pytest.raises(ValueError, match="behaviour log-probs"):
        DecoupledPpo()(x)


# AReaL's rejection at the sequence level and by KL (§3.2), ℓ_prox = 0 and w = exp(−ℓ_beh) again:
#   row A  w = [2, 0.5, 4]   log w = [0.6931, −0.6931, 1.3863]
#          sum 1.3863 → W = 4;  mean 0.4621 → Ŵ = 4^{1/3} = 1.5874011;  max → 4
#   row B  w = [8, 8, 1]     sum → 64;  mean → Ŵ = 64^{1/3} = 4;  max → 8
# per-token KL of π_prox against π_beh, d = ℓ_prox − ℓ_beh = log w:
#   k1 = d           A: [0.6931, −0.6931, 1.3863]
#   k2 = d²/2        A: [0.2402, 0.2402, 0.9609]
#   k3 = e^{−d} + d − 1 = 1/w + log w − 1      A: [0.1931, 0.3069, 0.6363]   (mean 0.3788)
#                                              B: [1.2044, 1.2044, 0]        (mean 0.8030)
ROWS = [[2.0, 0.5, 4.0], [8.0, 8.0, 1.0]]
ROOT3_4 = 4.0 ** (1 / 3)


def weights_of(loss_fn: DecoupledPpo) -> list[list[float]]:
    """The behaviour weight of each token: with log u = 0 and A = −1 the PPO term is exactly 1, so L = weight."""
    logp = torch.zeros(2, 3, dtype=torch.float64, requires_grad=True)
    x = LossInputs(logp=logp, old_logp=torch.zeros(2, 3, dtype=torch.float64),
                   adv=-torch.ones(2, 3, dtype=torch.float64), mask=torch.ones(2, 3, dtype=torch.float64),
                   beh_logp=-torch.log(torch.tensor(ROWS, dtype=torch.float64)))
    loss, _ = loss_fn(x)
    return loss.detach().tolist()


@pytest.mark.parametrize(("spec", "expected"), [
    # sequence, ratio, mean: Ŵ_A = 1.587 ≤ 5 kept, Ŵ_B = 4 ≤ 5 kept; every token weighs its row's Ŵ
    ({"level": "sequence", "sequence_agg": "mean"}, [[ROOT3_4] * 3, [4.0] * 3]),
    # sequence, ratio, sum: W_A = 4 kept (weight Ŵ_A), W_B = 64 > 5 drops B whole
    ({"level": "sequence", "sequence_agg": "sum"}, [[ROOT3_4] * 3, [0.0] * 3]),
    # sequence, ratio, max: A's max 4 kept, B's 8 > 5 dropped
    ({"level": "sequence", "sequence_agg": "max"}, [[ROOT3_4] * 3, [0.0] * 3]),
    # sequence, ratio, clamp: B (sum 64 outside) has its weight Ŵ_B = 4 clamped into [0.5, 3]
    ({"level": "sequence", "sequence_agg": "sum", "is_mode": "clamp", "w_min": 0.5, "w_max": 3.0},
     [[ROOT3_4] * 3, [3.0] * 3]),
    # token, k1 ∈ [−0.5, 1.5]: A's −0.693 out; B's log 8 = 2.079 out twice, log 1 = 0 in
    ({"metric": "kl_k1", "w_min": -0.5, "w_max": 1.5}, [[2.0, 0.0, 4.0], [0.0, 0.0, 1.0]]),
    # token, k2 ≤ 0.5: A's 0.961 out; B's (log 8)²/2 = 2.16 out
    ({"metric": "kl_k2", "w_max": 0.5}, [[2.0, 0.5, 0.0], [0.0, 0.0, 1.0]]),
    # token, k3 ≤ 0.3: A's 0.307 and 0.636 out; B's 1.204 out twice, 0 in
    ({"metric": "kl_k3", "w_max": 0.3}, [[2.0, 0.0, 0.0], [0.0, 0.0, 1.0]]),
    # sequence, k3, mean ≤ 0.5: A's 0.379 in (its tokens keep their own w), B's 0.803 out
    ({"metric": "kl_k3", "level": "sequence", "w_max": 0.5}, [[2.0, 0.5, 4.0], [0.0] * 3]),
])
def test_sequence_level_and_kl_rejection_by_hand(spec: dict, expected: list[list[float]]) -> None:
    got = weights_of(DecoupledPpo(**spec))
    assert got[0] == pytest.approx(expected[0], abs=1e-6) and got[1] == pytest.approx(expected[1], abs=1e-6)


def test_clamp_needs_the_ratio_metric_and_the_correction_stays_off() -> None:
    with pytest.raises(pydantic.ValidationError, match="is_mode clamp clamps the ratio"):
        DecoupledPpo(is_mode="clamp", metric="kl_k3")
    assert DecoupledPpo.weighs_behaviour and not PpoClip.weighs_behaviour
