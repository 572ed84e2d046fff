"""Policy losses on tiny tensors: values worked by hand, gradient signs and clip stops via autograd.

Every (B, T) example gives ℓ_old = 0, so ℓ_θ = log ρ and the per-token gradient d L_t / d ℓ_θ(t)
is read straight from `logp.grad` (each token's loss depends on its own ℓ_θ only).
"""

from __future__ import annotations

import math

import pydantic
import pytest
import torch

from adarl.loss.aepo import Aepo
from adarl.loss.bapo import Bapo
from adarl.loss.base import LossInputs, PolicyLoss
from adarl.loss.gspo import Gspo
from adarl.loss.hapo import Hapo
from adarl.loss.ppo import PpoClip
from adarl.registry import build, component_class


def inputs(log_ratio: list[list[float]], adv: list[list[float]], mask: list[list[float]] | None = None,
           h: list[list[float]] | None = None, **extra: torch.Tensor) -> LossInputs:
    logp = torch.tensor(log_ratio, dtype=torch.float64, requires_grad=True)
    return LossInputs(
        logp=logp, old_logp=torch.zeros_like(logp.detach()), adv=torch.tensor(adv, dtype=torch.float64),
        mask=torch.ones_like(logp.detach()) if mask is None else torch.tensor(mask, dtype=torch.float64),
        entropy_norm=None if h is None else torch.tensor(h, dtype=torch.float64), **extra)


def loss_and_grad(loss_fn: PolicyLoss, x: LossInputs) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    loss, stats = loss_fn(x)
    (loss * x.mask).sum().backward()
    assert x.logp.grad is not None
    return loss.detach(), x.logp.grad, stats


# ---------------------------------------------------------------- base class: KL and entropy bonus

@pytest.mark.parametrize(("kl", "expected"), [
    # ℓ_θ = [−1, −2], ℓ_ref = [−1.5, −1]
    ("k1", [0.5, -1.0]),  # ℓ_θ − ℓ_ref
    ("k2", [0.125, 0.5]),  # (ℓ_θ − ℓ_ref)²/2
    # d = ℓ_ref − ℓ_θ = [−0.5, 1]: e^{−0.5} + 0.5 − 1 = 0.1065307, e − 1 − 1 = 0.7182818
    ("k3", [math.exp(-0.5) - 0.5, math.e - 2.0]),
])
def test_kl_estimators_added_by_base(kl: str, expected: list[float]) -> None:
    x = inputs([[-1.0, -2.0]], [[0.0, 0.0]], ref_logp=torch.tensor([[-1.5, -1.0]], dtype=torch.float64))
    x.old_logp = x.logp.detach().clone()  # ρ = 1, A = 0: the surrogate is 0, the loss is β·KL
    loss, stats = PpoClip(kl_coef=0.5, kl=kl)(x)  # type: ignore[arg-type]
    assert loss[0].tolist() == pytest.approx([0.5 * e for e in expected])
    assert stats["kl"][0].tolist() == pytest.approx(expected)


def test_entropy_bonus_subtracts_coef_times_live_entropy() -> None:
    live = torch.tensor([[1.0, 2.0]], dtype=torch.float64, requires_grad=True)
    x = inputs([[0.0, 0.0]], [[0.0, 0.0]], entropy_live=live)
    loss, _ = PpoClip(entropy_coef=0.1)(x)
    assert loss.flatten().tolist() == pytest.approx([-0.1, -0.2])  # 0 − 0.1·H
    loss.sum().backward()
    assert live.grad is not None and live.grad.flatten().tolist() == pytest.approx([-0.1, -0.1])


def test_kl_without_reference_and_bonus_without_entropy_raise() -> None:
    with pytest.raises(ValueError, match="reference"):
        PpoClip(kl_coef=0.1)(inputs([[0.0]], [[1.0]]))
    with pytest.raises(ValueError, match="entropy"):
        PpoClip(entropy_coef=0.1)(inputs([[0.0]], [[1.0]]))


# ---------------------------------------------------------------- every loss: gradient sign and registration

ALL = [PpoClip(), Gspo(), Bapo(), Hapo(), Aepo()]


@pytest.mark.parametrize("loss_fn", ALL, ids=lambda f: type(f).__name__)
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_gradient_sign_follows_advantage(loss_fn: PolicyLoss, sign: float) -> None:
    # on-policy (ρ = 1): raising ℓ_θ lowers the loss for A > 0 and raises it for A < 0; the padded
    # token holds junk and must stay finite
    x = inputs([[0.0, 0.0, 7.0]], [[sign, sign, 100.0]], mask=[[1.0, 1.0, 0.0]], h=[[0.3, -0.4, 0.0]])
    loss, grad, stats = loss_and_grad(loss_fn, x)
    assert torch.isfinite(loss).all()
    assert all(torch.isfinite(v).all() for v in stats.values())
    assert (grad[0, :2] * sign < 0).all()
    assert grad[0, 2] == 0.0


@pytest.mark.parametrize(("loss_fn", "h"), [(PpoClip(), 0.0), (Gspo(), 0.0), (Hapo(), 0.5), (Hapo(), 0.0)],
                         ids=["ppo", "gspo", "hapo-h0.5", "hapo-h0"])
def test_ratio_above_upper_bound_with_positive_advantage_has_no_gradient(loss_fn: PolicyLoss, h: float) -> None:
    # ρ = e^{0.5} = 1.6487 > 1 + ε_high (1.2 for ppo, 1.0004 for gspo, 1.3 for hapo at ĥ = 0.5)
    x = inputs([[0.5, 0.5]], [[1.0, 1.0]], h=[[h, h]])
    _, grad, stats = loss_and_grad(loss_fn, x)
    assert grad.tolist() == [[0.0, 0.0]]
    assert stats["clip_fraction"].tolist() == [[1.0, 1.0]]


def test_every_loss_is_registered() -> None:
    for name, cls in [("ppo_clip", PpoClip), ("gspo", Gspo), ("bapo", Bapo), ("hapo", Hapo), ("aepo", Aepo)]:
        assert component_class("loss", name) is cls
    assert Hapo.needs_entropy and Aepo.needs_entropy
    assert not Gspo.needs_entropy and not Bapo.needs_entropy


# ---------------------------------------------------------------- GSPO (§1.4)

def test_gspo_sequence_ratio_is_the_masked_geometric_mean() -> None:
    # row 0: Δ = [0.2, 0.2] (+ a padded 5.0) → log s = 0.2;  row 1: Δ = [0.1, 0.3] → log s = 0.2
    # s = e^{0.2} = 1.2214028 > 1.0004 and A = −1: −min(−s, −1.0004) = s, unclipped
    x = inputs([[0.2, 0.2, 5.0], [0.1, 0.3, 0.0]], [[-1.0] * 3, [-1.0] * 3], mask=[[1, 1, 0], [1, 1, 0]])
    loss, grad, stats = loss_and_grad(Gspo(), x)
    s = math.exp(0.2)
    assert stats["gspo_seq_ratio"][:, :2].flatten().tolist() == pytest.approx([s] * 4)
    assert loss[:, :2].flatten().tolist() == pytest.approx([s] * 4)
    # GSPO-token gradient: d(−A·s_{i,t})/dℓ_θ(t) = s_i for every token, not the token's own ρ_t (e^{0.1}, e^{0.3})
    assert grad[:, :2].flatten().tolist() == pytest.approx([s] * 4)


def test_gspo_clips_at_the_sequence_bound_and_clamps_log_ratio_at_10() -> None:
    # A = +1, s = e^{0.2} > 1 + 4e-4: −min(s, 1.0004) = −1.0004
    loss, _, _ = loss_and_grad(Gspo(), inputs([[0.1, 0.3]], [[1.0, 1.0]]))
    assert loss.flatten().tolist() == pytest.approx([-1.0004, -1.0004])
    # log s = 12 → clamped to 10; A = −1: −min(−e^{10}, −1.0004) = e^{10} = 22026.466, no gradient past the clamp
    loss, grad, _ = loss_and_grad(Gspo(), inputs([[12.0, 12.0]], [[-1.0, -1.0]]))
    assert loss.flatten().tolist() == pytest.approx([math.exp(10.0)] * 2)
    assert grad.tolist() == [[0.0, 0.0]]


def test_gspo_forces_seq_mean_token_mean() -> None:
    assert Gspo().agg == "seq-mean-token-mean"
    assert Gspo(agg="seq-mean-token-mean").eps_low == 3e-4
    with pytest.raises(pydantic.ValidationError, match="always aggregates with 'seq-mean-token-mean'"):
        Gspo(agg="token-mean")  # type: ignore[arg-type]
    with pytest.raises(pydantic.ValidationError, match="got 'token-mean'"):
        build("loss", {"name": "gspo", "agg": "token-mean"})


# ---------------------------------------------------------------- BAPO (§4.1)

# tokens (ρ, A): (2, +1), (1, −1), (0.5, −0.5) and a padded (5, −10) that must not count
BAPO_X = ([[math.log(2.0), 0.0, math.log(0.5), math.log(5.0)]], [[1.0, -1.0, -0.5, -10.0]], [[1.0, 1.0, 1.0, 0.0]])


@pytest.mark.parametrize(("x", "stat", "target", "c_low", "c_high", "share"), [
    # with contribution: gradient a clipped token contributes 0 (loss/bapo.py).
    # Tokens (ρ, A): (2, +1), (1, −1), (0.5, −0.5); the 4th is padding.
    # start (0.8, 1.2): (2, +1) is clipped above → P = 0; (1, −1) counts → N = 1; (0.5, −0.5) clipped below.
    #   share 0 < 0.5. c_low 0.85 … 0.95 never clips ρ = 1: N stays 1, c_low ends at its max 0.95.
    #   c_high 1.3 … 1.9 still clip ρ = 2; at 2.0 it counts: P = 2, share 2/3 ≥ 0.5: stop.
    (BAPO_X, "share", 0.5, 0.95, 2.0, 2 / 3),
    # pos_neg_ratio (the code): P/N = 0 at the start, the same walk ends at P/N = 2 ≥ 0.5 and ≥ 1.0
    (BAPO_X, "pos_neg_ratio", 0.5, 0.95, 2.0, 2 / 3),
    (BAPO_X, "pos_neg_ratio", 1.0, 0.95, 2.0, 2 / 3),
    # where raising c_low helps: (1, +1) → P = 1; (0.82, −2) counts at c_low 0.8 → N = 1.64, share 1/2.64 = 0.379;
    #   c_low 0.85 clips it away → N = 0, share 1: stop with c_high untouched
    (([[0.0, math.log(0.82)]], [[1.0, -2.0]], [[1.0, 1.0]]), "share", 0.5, 0.85, 1.2, 1.0),
])
def test_bapo_bound_search(x: tuple, stat: str, target: float, c_low: float, c_high: float, share: float) -> None:
    loss_fn = Bapo(stat=stat, target=target, contribution="gradient")  # type: ignore[arg-type]
    loss, _, stats = loss_and_grad(loss_fn, inputs(*x))
    assert stats["bapo_c_low"][0, 0].item() == pytest.approx(c_low)
    assert stats["bapo_c_high"][0, 0].item() == pytest.approx(c_high)
    assert stats["bapo_positive_share"][0, 0].item() == pytest.approx(share)
    assert stats["bapo_c_low"].shape == torch.tensor(x[0]).shape
    if x is BAPO_X:
        # loss at the chosen bounds: −min(2, c_high)·1;  −(1·−1) = 1;  −min(0.5·−0.5, c_low·−0.5) = 0.5·c_low
        assert loss[0, :3].tolist() == pytest.approx([-min(2.0, c_high), 1.0, 0.5 * c_low])
    else:
        # (1, +1): −1;  (0.82, −2) below c_low 0.85: −min(−1.64, −1.7) = 1.7
        assert loss[0].tolist() == pytest.approx([-1.0, 1.7])


def test_bapo_ratio_below_c_low_with_negative_advantage_has_no_gradient() -> None:
    # one token, ρ = e^{−0.5} = 0.6065, A = −1: clipped below c_low 0.8, so it counts 0 and N = 0:
    # share 1, the bounds stay at their starts (0.8, 1.2).
    # ρ < 0.8: L = −min(−0.6065, −0.8) = 0.8 (below the dual clip 3), constant in ℓ_θ
    loss, grad, stats = loss_and_grad(Bapo(contribution="gradient"), inputs([[-0.5]], [[-1.0]]))
    assert (stats["bapo_c_low"].item(), stats["bapo_c_high"].item()) == pytest.approx((0.8, 1.2))
    assert loss.item() == pytest.approx(0.8)
    assert grad.item() == 0.0
    assert stats["clip_low_fraction"].item() == 1.0


def test_bapo_dual_clip_and_bound_validation() -> None:
    # ρ = e^{1.5} = 4.48, A = −1: share 0 → (0.95, 2.0); −min(−4.48, −2) = 4.48 > −c·A = 3 → 3
    loss, grad, _ = loss_and_grad(Bapo(), inputs([[1.5]], [[-1.0]]))
    assert loss.item() == pytest.approx(3.0) and grad.item() == 0.0
    with pytest.raises(pydantic.ValidationError, match="c_high_max"):
        Bapo(c_high_max=1.0)


# ---------------------------------------------------------------- HAPO (§4.2 c, d)

def test_hapo_with_zero_entropy_is_ppo_clip() -> None:
    log_ratio = [[0.5, -0.5, 0.05, -0.05, 2.5, -3.0]]
    adv = [[1.0, -1.0, 0.7, -0.3, -1.0, 2.0]]
    a, b = inputs(log_ratio, adv, h=[[0.0] * 6]), inputs(log_ratio, adv)
    loss_h, grad_h, _ = loss_and_grad(Hapo(), a)
    loss_p, grad_p, _ = loss_and_grad(PpoClip(eps_low=0.2, eps_high=0.2, dual_clip=10.0), b)
    assert loss_h.flatten().tolist() == pytest.approx(loss_p.flatten().tolist())
    assert grad_h.flatten().tolist() == pytest.approx(grad_p.flatten().tolist())


# token  ĥ     ρ      A   bounds (1−ε_low', 1+ε_high')  neutral zone     A'                          L        dL/dℓ
#  a   −0.5   0.75   −1   (0.7, 1.2)  ε_low' = 0.3      (0.85, 1.1)  out → A = −1            −min(−.75,−.75) = .75  .75
#  b   −0.5   1.0    +1   (0.7, 1.2)                    (0.85, 1.1)  in  → A(1−0.5) = 0.5        −0.5      −0.5
#  c   +0.5   1.25   +1   (0.8, 1.3)  ε_high' = 0.3     (0.9, 1.15)  out → A(1+0.5) = 1.5    −1.25·1.5 = −1.875  −1.875
#  d   +0.5   1.0    +1   (0.8, 1.3)                    (0.9, 1.15)  in  → A = 1                 −1        −1
#  e   +0.5   1.4    +1   (0.8, 1.3)                    (0.9, 1.15)  out → 1.5               −1.3·1.5 = −1.95   0
#  f    0     e^2.5  −1   (0.8, 1.2)                    (0.9, 1.1)   out → A = −1            12.18 → dual 10   0
HAPO_X = ([[math.log(0.75), 0.0, math.log(1.25), 0.0, math.log(1.4), 2.5]], [[-1.0, 1.0, 1.0, 1.0, 1.0, -1.0]],
          None, [[-0.5, -0.5, 0.5, 0.5, 0.5, 0.0]])


def test_hapo_redistribution_and_adaptive_clip_by_hand() -> None:
    loss, grad, stats = loss_and_grad(Hapo(), inputs(*HAPO_X))
    assert loss.flatten().tolist() == pytest.approx([0.75, -0.5, -1.875, -1.0, -1.95, 10.0])
    assert grad.flatten().tolist() == pytest.approx([0.75, -0.5, -1.875, -1.0, 0.0, 0.0])
    assert stats["hapo_redistributed_fraction"].tolist() == [[0.0, 1.0, 1.0, 0.0, 1.0, 0.0]]
    assert stats["dual_clip_fraction"].tolist() == [[0.0, 0.0, 0.0, 0.0, 0.0, 1.0]]


def test_hapo_ablations() -> None:
    # no adaptive clip: a has bounds (0.8, 1.2), zone (0.9, 1.1): ρ = 0.75 out → A' = −1, clipped: −min(−.75, −.8) = .8
    # c: zone (0.9, 1.1), ρ = 1.25 out → A' = 1.5, clipped at 1.2: −1.8
    loss, grad, _ = loss_and_grad(Hapo(adaptive_clip=False), inputs(*HAPO_X))
    assert loss[0, :3].tolist() == pytest.approx([0.8, -0.5, -1.8])
    assert grad[0, 0].item() == 0.0
    # no redistribution: A' = A; b: −1, c: −1.25 (inside the widened bound 1.3)
    loss, _, stats = loss_and_grad(Hapo(redistribute=False), inputs(*HAPO_X))
    assert loss[0, :3].tolist() == pytest.approx([0.75, -1.0, -1.25])
    assert "hapo_redistributed_fraction" not in stats


def test_hapo_needs_entropy_norm() -> None:
    with pytest.raises(ValueError, match="entropy_norm"):
        Hapo()(inputs([[0.0]], [[1.0]]))


# ---------------------------------------------------------------- AEPO (§4.3 c, d)

# token  ĥ     ρ        A    A' = A(1 + 0.1ĥ)   L                                   dL/dℓ
#  1    0.5   1        +1    1.05               −1.05                                −1.05
#  2   −1.0   1        −2    −1.8               1.8                                   1.8
#  3    0     e^{0.5}  +1    1                  −1.28·ρ/sg(ρ) = −1.28 (upper clip)   −1.28 (PPO: 0)
#  4    0     e^{−0.5} −1    −1                 −min(−.6065, −.8) = 0.8 (lower clip)  0
AEPO_X = ([[0.0, 0.0, 0.5, -0.5]], [[1.0, -2.0, 1.0, -1.0]], None, [[0.5, -1.0, 0.0, 0.0]])


def test_aepo_entropy_advantage_and_balanced_clip_by_hand() -> None:
    loss, grad, stats = loss_and_grad(Aepo(), inputs(*AEPO_X))
    assert loss.flatten().tolist() == pytest.approx([-1.05, 1.8, -1.28, 0.8])
    assert grad.flatten().tolist() == pytest.approx([-1.05, 1.8, -1.28, 0.0])
    assert stats["clip_high_fraction"].tolist() == [[0.0, 0.0, 1.0, 0.0]]
    assert stats["clip_low_fraction"].tolist() == [[0.0, 0.0, 0.0, 1.0]]


def test_aepo_ablations() -> None:
    # without (c) the upper-clipped token loses its gradient; without (d) A' = A
    loss, grad, _ = loss_and_grad(Aepo(balanced_clip=False), inputs(*AEPO_X))
    assert loss[0, 2].item() == pytest.approx(-1.28) and grad[0, 2].item() == 0.0
    loss, _, _ = loss_and_grad(Aepo(entropy_advantage=False), inputs(*AEPO_X))
    assert loss[0, :2].tolist() == pytest.approx([-1.0, 2.0])
