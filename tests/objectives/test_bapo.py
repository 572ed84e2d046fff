"""BAPO (algorithms.md §4.1): both readings of a token's contribution, and bounds per mini-batch.

Every example gives ℓ_old = 0, so ℓ_θ = log ρ. P and N are worked by hand in the comments.
"""

from __future__ import annotations

import math

import pydantic
import pytest
import torch

from adarl.loss.bapo import Bapo
from adarl.loss.base import LossInputs, PolicyLoss
from adarl.loss.ppo import PpoClip
from adarl.registry import build

PAD = (5.0, -10.0)  # a padded token (ρ, A) that must never count


def batch(rows: list[list[tuple[float, float]]]) -> LossInputs:
    """Sequences of (ρ, A) tokens, right-padded with PAD to the longest."""
    width = max(len(r) for r in rows)
    padded = [r + [PAD] * (width - len(r)) for r in rows]
    logp = torch.tensor([[math.log(rho) for rho, _ in r] for r in padded], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([[a for _, a in r] for r in padded], dtype=torch.float64)
    mask = torch.tensor([[1.0] * len(r) + [0.0] * (width - len(r)) for r in rows], dtype=torch.float64)
    return LossInputs(logp=logp, old_logp=torch.zeros_like(logp.detach()), adv=adv, mask=mask)


def searched(stats: dict[str, torch.Tensor]) -> tuple[float, float, float]:
    return (stats["bapo_c_low"][0, 0].item(), stats["bapo_c_high"][0, 0].item(),
            stats["bapo_positive_share"][0, 0].item())


# tokens (ρ, A): (2, +1), (1, −1), (0.5, −0.5), and padding
THREE = [[(2.0, 1.0), (1.0, -1.0), (0.5, -0.5)]]


@pytest.mark.parametrize(("contribution", "stat", "target", "expected"), [
    # released: eff = min(ρ, c_high)·A for A ≥ 0, max(ρ, c_low)·A for A < 0.
    #   start (0.8, 1.2): P = min(2, 1.2)·1 = 1.2;  N = 1·1 + max(0.5, 0.8)·0.5 = 1.4;  share 1.2/2.6 = 0.462 < 0.5
    #   c_low 0.85, 0.90, 0.95: N = 1 + 0.5·c_low grows to 1.475 (share 1.2/2.675 = 0.449): the loop runs to its max
    #   c_high 1.3: 1.3/2.775 = 0.468;  1.4: 1.4/2.875 = 0.487;  1.5: 1.5/2.975 = 0.504 ≥ 0.5: stop
    ("released", "share", 0.5, (0.95, 1.5, 1.5 / 2.975)),
    # released, the code's P/N: 1.2/1.4 = 0.857 ≥ 0.5 at the start, so nothing moves
    ("released", "pos_neg_ratio", 0.5, (0.8, 1.2, 1.2 / 2.6)),
    # P/N ≥ 1: 1.2/1.475 = 0.81 after the c_low walk; c_high 1.3: 0.88, 1.4: 0.95, 1.5: 1.5/1.475 = 1.017: stop
    ("released", "pos_neg_ratio", 1.0, (0.95, 1.5, 1.5 / 2.975)),
    # gradient: a clipped token counts 0. Start: (2, +1) clipped above → P = 0; (1, −1) → N = 1; (0.5, −0.5) clipped
    #   below → 0. share 0. c_low 0.85 … 0.95 never clips ρ = 1: N stays 1. c_high 1.3 … 1.9 still clip ρ = 2;
    #   at 2.0 it counts: P = 2, share 2/3: stop
    ("gradient", "share", 0.5, (0.95, 2.0, 2 / 3)),
    ("gradient", "pos_neg_ratio", 0.5, (0.95, 2.0, 2 / 3)),
])
def test_bound_search_by_hand(contribution: str, stat: str, target: float, expected: tuple) -> None:
    loss_fn = Bapo(contribution=contribution, stat=stat, target=target)  # type: ignore[arg-type]
    loss, stats = loss_fn(batch(THREE))
    assert searched(stats) == pytest.approx(expected)
    c_low, c_high, _ = expected
    # −min(2, c_high)·1;  −(1·−1) = 1;  −min(0.5·−0.5, c_low·−0.5) = 0.5·c_low (under the dual clip 3·0.5)
    assert loss[0].tolist() == pytest.approx([-min(2.0, c_high), 1.0, 0.5 * c_low])


def test_the_rules_differ_on_a_token_clipped_below() -> None:
    # one token, ρ = 0.5, A = −1.
    # released: N = max(0.5, c_low)·1 = c_low > 0, P = 0: share 0 at every bound, so both walks reach their
    #   max (0.95, 2.0).
    #   L = −min(−0.5, −0.95) = 0.95, constant in ℓ_θ
    loss, stats = Bapo()(batch([[(0.5, -1.0)]]))
    assert searched(stats) == pytest.approx((0.95, 2.0, 0.0))
    assert loss.item() == pytest.approx(0.95)
    # gradient: clipped below c_low = 0.8, so it counts 0: N = 0, share 1, the bounds stay at (0.8, 1.2); L = 0.8
    loss, stats = Bapo(contribution="gradient")(batch([[(0.5, -1.0)]]))
    assert searched(stats) == pytest.approx((0.8, 1.2, 1.0))
    assert loss.item() == pytest.approx(0.8)


def test_contribution_is_validated() -> None:
    assert build("loss", {"name": "bapo", "contribution": "gradient"}).contribution == "gradient"
    with pytest.raises((pydantic.ValidationError, ValueError)):
        build("loss", {"name": "bapo", "contribution": "grad"})


# ---------------------------------------------------------------- bounds per mini-batch (`prepare`)

# three sequences of one mini-batch, tokens (ρ, A)
SEQ1 = [(2.0, 1.0), (2.0, 1.0)]
SEQ2 = [(1.0, -2.0), (0.5, -1.0), (1.0, -1.0)]
SEQ3 = [(1.5, 1.0)]
# released rule, share ≥ 0.5, over all three:
#   start (0.8, 1.2): P = 1.2 + 1.2 + 1.2 = 3.6;  N = 2 + max(0.5, 0.8)·1 + 1 = 3.8;  share 3.6/7.4 = 0.486
#   c_low → 0.95: N = 3.95, share 3.6/7.55 = 0.477
#   c_high 1.3: P = 3·1.3 = 3.9, share 3.9/7.85 = 0.497;  1.4: P = 4.2, share 4.2/8.15 = 0.515 ≥ 0.5: stop
MINI_BATCH = (0.95, 1.4, 4.2 / 8.15)
# alone, each sequence would search differently: SEQ1 and SEQ3 have N = 0 (share 1, the start bounds),
# SEQ2 has P = 0 (share 0, both bounds at their max)
ALONE = {0: (0.8, 1.2, 1.0), 1: (0.95, 2.0, 0.0), 2: (0.8, 1.2, 1.0)}


@pytest.mark.parametrize("split", [
    [[SEQ1, SEQ2, SEQ3]],  # one micro-batch
    [[SEQ1], [SEQ2], [SEQ3]],  # three, of different widths
    [[SEQ1, SEQ3], [SEQ2]],
])
def test_bounds_do_not_depend_on_the_micro_batch_split(split: list) -> None:
    loss_fn = Bapo()
    assert loss_fn.needs_prepare
    parts = [batch(rows) for rows in split]
    loss_fn.prepare(parts)
    # each token's loss at (0.95, 1.4): (2, +1) → −1.4;  (1, −2) → 2;  (0.5, −1) → −min(−0.5, −0.95) = 0.95;
    #   (1, −1) → 1;  (1.5, +1) → −1.4
    expected = {tuple(SEQ1): [-1.4, -1.4], tuple(SEQ2): [2.0, 0.95, 1.0], tuple(SEQ3): [-1.4]}
    for rows, x in zip(split, parts, strict=True):
        loss, stats = loss_fn(x)
        assert searched(stats) == pytest.approx(MINI_BATCH)
        for i, row in enumerate(rows):
            assert loss[i, :len(row)].tolist() == pytest.approx(expected[tuple(row)])
        (loss * x.mask).sum().backward()  # prepare detached ρ: the micro-batch still has its gradient
        assert x.logp.grad is not None


def test_without_prepare_each_call_searches_its_own_tokens() -> None:
    for i, rows in enumerate([SEQ1, SEQ2, SEQ3]):
        _, stats = Bapo()(batch([rows]))
        assert searched(stats) == pytest.approx(ALONE[i])


def test_prepared_bounds_hold_until_the_next_prepare() -> None:
    loss_fn = Bapo()
    loss_fn.prepare([batch([SEQ1]), batch([SEQ2, SEQ3])])
    _, stats = loss_fn(batch([SEQ1]))  # SEQ1 alone would keep (0.8, 1.2)
    assert searched(stats) == pytest.approx(MINI_BATCH)
    loss_fn.prepare([batch([SEQ2])])  # the next mini-batch: SEQ2 alone
    _, stats = loss_fn(batch([SEQ2]))
    assert searched(stats) == pytest.approx(ALONE[1])


def test_prepare_is_a_no_op_by_default() -> None:
    assert not PolicyLoss.needs_prepare and not PpoClip.needs_prepare
    x = batch(THREE)
    loss_fn = PpoClip()
    before, _ = loss_fn(x)
    loss_fn.prepare([x])
    after, _ = loss_fn(x)
    assert torch.equal(before, after)
