"""Advantage, loss and aggregation formulas against values worked by hand."""

import numpy as np
import pytest
import torch

from adarl import registry
from adarl.advantage.grpo import DrGrpo, Grpo
from adarl.loss.aggregate import aggregate
from adarl.loss.base import LossInputs
from adarl.loss.kl import k3
from adarl.loss.ppo import PpoClip
from adarl.types import Batch, Group, Problem, Rollout


def run(loss_fn, logp, old, adv, mask, ref_logp=None):
    """Call a PolicyLoss on one micro-batch's tensors."""
    return loss_fn(LossInputs(logp=logp, old_logp=old, adv=adv, mask=mask, ref_logp=ref_logp))


def make_batch(reward_lists):
    groups = []
    for gi, rewards in enumerate(reward_lists):
        rollouts = [Rollout(f"p{gi}", [1], [0.0], "stop") for _ in rewards]
        groups.append(Group(Problem(f"p{gi}", "q"), [0], rollouts, rewards=np.array(rewards, float)[:, None]))
    return Batch(groups)


# groups of sizes 4, 3, 1 and 2
REWARDS = [[1, 0, 0, 1], [1, 0, 0], [1], [0, 0]]


def test_grpo_unequal_groups():
    adv = Grpo()(make_batch(REWARDS))
    # group 1: mean 0.5, unbiased std sqrt(4·0.25/3) = 0.57735 → ±0.5/0.57735 = ±0.866025
    # group 2: mean 1/3, deviations (2/3, −1/3, −1/3), var (4/9+1/9+1/9)/2 = 1/3 → std 0.57735
    #          → 1.154701, −0.577350, −0.577350
    # group 3 (size 1): mean := 0, std := 1 → 1.0
    # group 4: all equal → 0
    expected = [0.866025, -0.866025, -0.866025, 0.866025, 1.154701, -0.577350, -0.577350, 1.0, 0.0, 0.0]
    np.testing.assert_allclose(adv, expected, atol=1e-5)


def test_drgrpo_unequal_groups():
    adv = DrGrpo()(make_batch(REWARDS))
    expected = [0.5, -0.5, -0.5, 0.5, 2 / 3, -1 / 3, -1 / 3, 1.0, 0.0, 0.0]
    np.testing.assert_allclose(adv, expected, atol=1e-12)


def test_group_order_does_not_matter():
    a = Grpo()(make_batch(REWARDS))
    b = Grpo()(make_batch(REWARDS[::-1]))
    sizes = [len(r) for r in REWARDS]
    chunks = np.split(a, np.cumsum(sizes)[:-1])
    np.testing.assert_allclose(np.concatenate(chunks[::-1]), b)


def test_ppo_clip_values_and_gradients():
    loss_fn = PpoClip(eps_low=0.2, eps_high=0.2)
    # ratios 1.5, 0.5, 0.5, 1.5 against advantages +1, +1, −1, −1
    ratio = torch.tensor([[1.5, 0.5, 0.5, 1.5]])
    logp = torch.log(ratio).requires_grad_(True)
    old = torch.zeros_like(logp)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    mask = torch.ones_like(adv)
    loss, stats = run(loss_fn, logp, old, adv, mask)
    # −min(1.5, 1.2) = −1.2 (clipped);  −min(0.5, 0.8) = −0.5;  −min(−0.5, −0.8) = 0.8 (clipped);
    # −min(−1.5, −1.2) = 1.5
    torch.testing.assert_close(loss, torch.tensor([[-1.2, -0.5, 0.8, 1.5]]))
    torch.testing.assert_close(stats["clip_fraction"], torch.tensor([[1.0, 0.0, 1.0, 0.0]]))
    loss.sum().backward()
    # d/dlogp of −ρA is −ρA where unclipped; zero where the clip is active
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -0.5, 0.0, 1.5]]))


def test_clip_higher_is_asymmetric():
    loss_fn = PpoClip(eps_low=0.2, eps_high=0.28)
    logp = torch.log(torch.tensor([[1.5, 0.5]]))
    loss, _ = run(loss_fn, logp, torch.zeros_like(logp), torch.tensor([[1.0, -1.0]]), torch.ones(1, 2))
    torch.testing.assert_close(loss, torch.tensor([[-1.28, 0.8]]))


def test_dual_clip():
    loss_fn = PpoClip(dual_clip=3.0)
    logp = torch.log(torch.tensor([[4.0, 2.0]]))
    loss, stats = run(loss_fn, logp, torch.zeros_like(logp), torch.tensor([[-1.0, -1.0]]), torch.ones(1, 2))
    # ratio 4, A=−1: L^clip = 4 > c·|A| = 3 → 3;  ratio 2: L^clip = 2 stays
    torch.testing.assert_close(loss, torch.tensor([[3.0, 2.0]]))
    torch.testing.assert_close(stats["dual_clip_fraction"], torch.tensor([[1.0, 0.0]]))


def test_k3_kl():
    # d = ℓ_ref − ℓ = −2 − (−1) = −1 → e^−1 + 1 − 1 = 0.367879;  equal → 0
    kl = k3(torch.tensor([-1.0, -3.0]), torch.tensor([-2.0, -3.0]))
    torch.testing.assert_close(kl, torch.tensor([0.3678794, 0.0]))
    loss_fn = PpoClip(kl_coef=0.5)
    logp = torch.tensor([[-1.0]])
    loss, stats = run(loss_fn, logp, logp, torch.zeros(1, 1), torch.ones(1, 1), ref_logp=torch.tensor([[-2.0]]))
    torch.testing.assert_close(loss, torch.tensor([[0.5 * 0.3678794]]))
    with pytest.raises(ValueError, match="reference"):
        run(loss_fn, logp, logp, torch.zeros(1, 1), torch.ones(1, 1))


# per-token losses of two sequences of lengths 2 and 4 (padding holds garbage that must not count)
L = torch.tensor([[1.0, 3.0, 99.0, 99.0], [2.0, 2.0, 2.0, 6.0]])
M = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])


@pytest.mark.parametrize(
    "agg,expected",
    [
        ("token-mean", (4 + 12) / 6),  # 2.6667
        ("seq-mean-token-mean", (4 / 2 + 12 / 4) / 2),  # 2.5
        ("seq-mean-token-sum", (4 + 12) / 2),  # 8
        ("seq-mean-token-sum-norm", (4 + 12) / (2 * 8)),  # L_max = 8 → 1.0
    ],
)
def test_aggregation_modes(agg, expected):
    assert aggregate(L, M, agg, max_len=8).item() == pytest.approx(expected)


def test_positive_advantage_raises_probability():
    """One gradient step on the PPO loss moves a token's probability the way its advantage says."""
    for sign in (1.0, -1.0):
        logits = torch.zeros(1, 5, requires_grad=True)
        opt = torch.optim.SGD([logits], lr=0.5)
        for _ in range(3):
            logp = torch.log_softmax(logits, -1)[:, 2:3]
            loss, _ = run(PpoClip(), logp, logp.detach(), torch.tensor([[sign]]), torch.ones(1, 1))
            opt.zero_grad()
            loss.sum().backward()
            opt.step()
        p = torch.softmax(logits, -1)[0, 2].item()
        assert (p > 0.2) if sign > 0 else (p < 0.2)


def test_clipping_stops_gradient_at_the_bound():
    logp = torch.tensor([[np.log(1.3)]], dtype=torch.float32, requires_grad=True)  # ratio beyond 1+ε
    loss, _ = run(PpoClip(), logp, torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1))
    loss.sum().backward()
    assert logp.grad.item() == 0.0


def test_registry_builds_by_name():
    assert isinstance(registry.build("advantage", {"name": "drgrpo"}), DrGrpo)
    loss = registry.build("loss", {"name": "ppo_clip", "eps_high": 0.28, "agg": "seq-mean-token-sum-norm"})
    assert loss.eps_high == 0.28 and loss.agg == "seq-mean-token-sum-norm"
