"""Token weightings: D^3S (algorithms.md §4.4) and high-entropy tokens (Wang et al. 2025)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from adarl.tokens.d3s import D3s, max_variance_subset
from adarl.tokens.high_entropy import HighEntropy
from adarl.types import Batch, Group, Problem, Rollout


def make_batch(groups: list[list[tuple[int, list[float] | None]]], advantages: list[float],
               rewards: list[list[float]] | None = None) -> Batch:
    """groups[g] = [(completion length, entropies), ...]; rewards[g] = one reward per rollout."""
    built = []
    for g, members in enumerate(groups):
        rollouts = [Rollout(f"p{g}", list(range(n)), [0.0] * n, "stop", entropies=h) for n, h in members]
        r = np.zeros(len(members)) if rewards is None else np.asarray(rewards[g], dtype=np.float64)
        built.append(Group(Problem(f"p{g}", "q"), [1], rollouts, rewards=r[:, None], reward_names=("correct",)))
    return Batch(built, advantages=np.asarray(advantages, dtype=np.float64))


def ones(batch: Batch) -> list[np.ndarray]:
    return [np.ones(len(r)) for r in batch.rollouts]


def as_lists(weights: list[np.ndarray]) -> list[list[float]]:
    return [w.tolist() for w in weights]


# --- schedule -------------------------------------------------------------------------------------

def test_cosine_schedule() -> None:
    d3s = D3s()
    # f(p) = 0.25 + 0.75·(1 − cos(π·min(p/0.6, 1)))/2
    assert d3s.fraction(0.0) == pytest.approx(0.25, abs=1e-12)
    assert d3s.fraction(0.3) == pytest.approx(0.625, abs=1e-12)  # cos(π/2) = 0: 0.25 + 0.75/2
    assert d3s.fraction(0.6) == pytest.approx(1.0, abs=1e-12)
    assert d3s.fraction(1.0) == pytest.approx(1.0, abs=1e-12)
    # f0 = 0.5, full at 0.5: p = 0.125 → x = 1/4, (1 − cos(π/4))/2 = 0.1464466; 0.5 + 0.5·0.1464466
    assert D3s(f0=0.5, full_at=0.5).fraction(0.125) == pytest.approx(0.5 + 0.5 * (1 - math.sqrt(0.5)) / 2)


# --- D^3S sample level ------------------------------------------------------------------------------

def test_max_variance_subset_fills_short_side_from_extremes() -> None:
    a = np.array([-0.1, 2.0, -0.5, -0.3, 0.0, -0.9, -0.2, -0.7])
    # k = 5: wants ⌈5/2⌉ = 3 positives but there is one (idx 1); ⌊5/2⌋ = 2 negatives (-0.9, -0.7),
    # then 2 more negatives from the extremes (-0.5, -0.3). Pure sorting would have kept 0.0 and -0.1.
    assert sorted(max_variance_subset(a, 5).tolist()) == [1, 2, 3, 5, 7]
    # negatives short: A = [1, 3, 2, -1, 0.5], k = 4 → positives 3, 2; the one negative -1; then the
    # next positive extreme 1 (idx 0), not 0.5
    assert sorted(max_variance_subset(np.array([1.0, 3.0, 2.0, -1.0, 0.5]), 4).tolist()) == [0, 1, 2, 3]
    # zero-variance group: nothing positive or negative, zeros fill in rollout order
    assert max_variance_subset(np.zeros(4), 2).tolist() == [0, 1]


def test_d3s_sample_level_unequal_groups() -> None:
    batch = make_batch(
        [[(2, None)] * 8, [(1, None)] * 3, [(3, None)] * 2],
        [-0.1, 2.0, -0.5, -0.3, 0.0, -0.9, -0.2, -0.7,  # G = 8
         0.5, -1.0, 0.5,  # G = 3
         1.0, -1.0],  # G = 2
    )
    out = D3s(token_level=False)(batch, ones(batch), progress=0.3)  # f = 0.625
    # G=8: k = max(2, ⌈0.625·8⌉) = 5 → rollouts 1, 2, 3, 5, 7 (see test above)
    # G=3: k = max(2, ⌈1.875⌉) = 2 → top positive: idx 0 (tie with idx 2, earlier wins); bottom: idx 1
    # G=2: always kept
    assert as_lists(out) == [[0, 0], [1, 1], [1, 1], [1, 1], [0, 0], [1, 1], [0, 0], [1, 1],
                             [1], [1], [0],
                             [1, 1, 1], [1, 1, 1]]
    # progress 0: f = 0.25; G=8: k = max(2, ⌈2⌉) = 2 → 2.0 and -0.9; G=3: k = 2 as before
    out = D3s(token_level=False)(batch, ones(batch), progress=0.0)
    assert [bool(w.any()) for w in out] == [False, True, False, False, False, True, False, False,
                                            True, True, False, True, True]


def test_d3s_skips_rollouts_dropped_earlier_and_keeps_scales() -> None:
    batch = make_batch([[(2, None)] * 4], [1.5, 2.0, -0.5, -1.0])
    weights = [np.array([0.5, 1.0]), np.zeros(2), np.ones(2), np.array([0.0, 3.0])]
    # rollout 1 already dropped → G = 3 live (A = 1.5, -0.5, -1.0), f = 0.25, k = 2: 1.5 and -1.0
    out = D3s(token_level=False)(batch, weights, progress=0.0)
    assert as_lists(out) == [[0.5, 1.0], [0, 0], [0, 0], [0.0, 3.0]]


def test_d3s_recompute_adv() -> None:
    # group 0 rewards [1,0,0,0]: GRPO A = [1.5, -0.5, -0.5, -0.5] (mean 1/4, unbiased std 1/2)
    # group 1 rewards [1,1,0]:   GRPO A = [0.57735, 0.57735, -1.1547]  (std √(1/3))
    a_old = np.array([1.5, -0.5, -0.5, -0.5, 1 / math.sqrt(3), 1 / math.sqrt(3), -2 / math.sqrt(3)])
    batch = make_batch([[(1, None)] * 4, [(1, None)] * 3], a_old.tolist(), rewards=[[1, 0, 0, 0], [1, 1, 0]])
    old_array = batch.advantages
    out = D3s(token_level=False, recompute_adv=True)(batch, ones(batch), progress=0.0)
    # f = 0.25 → k = 2 in both groups: group 0 keeps 0 and 1 (first of the tied -0.5), group 1 keeps 0, 2
    assert as_lists(out) == [[1], [1], [0], [0], [1], [0], [1]]
    # kept rewards [1, 0] per group: mean 1/2, unbiased std √(1/2) → A = ±0.5/(√0.5 + 1e-6)
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    expected = [a, -a, -0.5, -0.5, a, 1 / math.sqrt(3), -a]  # dropped rollouts keep their old value
    np.testing.assert_allclose(batch.advantages, expected, rtol=0, atol=1e-12)
    assert batch.advantages is not old_array
    np.testing.assert_array_equal(old_array, a_old)  # the old array itself is untouched


def test_d3s_recompute_needs_sample_level() -> None:
    with pytest.raises(ValueError, match="recompute_adv"):
        D3s(sample_level=False, recompute_adv=True)


# --- D^3S token level ------------------------------------------------------------------------------

def test_d3s_token_level_keeps_ties() -> None:
    batch = make_batch(
        [[(3, [0.1, 2.0, 0.5]), (2, [0.4, 0.05])], [(3, [1.6, 1.0, 0.2])]],
        [1.0, -2.0, 0.5],
    )
    weights = [np.array([1.0, 1.0, 0.0]), np.ones(2), np.ones(3)]
    out = D3s(sample_level=False)(batch, weights, progress=0.0)  # f = 0.25
    # live scores |A|·H: r0 0.1, 2.0 (t2 dropped earlier); r1 0.8, 0.1; r2 0.8, 0.5, 0.1 → n = 7
    # m = ⌈0.25·7⌉ = 2; sorted 2.0, 0.8, 0.8, … → τ = 0.8, both tied 0.8 tokens kept (3 in all)
    assert as_lists(out) == [[0, 1, 0], [1, 0], [1, 0, 0]]


def test_d3s_both_levels() -> None:
    batch = make_batch([[(2, [1.0, 0.2]), (2, [0.5, 0.1]), (2, [9.0, 9.0]), (2, [9.0, 9.0])]],
                       [1.5, -0.5, -0.5, -0.5])
    out = D3s()(batch, ones(batch), progress=0.0)
    # sample: k = 2 → rollouts 0, 1. token scores |A|·H: r0 1.5, 0.3; r1 0.25, 0.05
    # n = 4, m = ⌈0.25·4⌉ = 1 → τ = 1.5: only r0 t0 (the dropped rollouts' 4.5 scores never count)
    assert as_lists(out) == [[1, 0], [0, 0], [0, 0], [0, 0]]
    # at full fraction (progress ≥ 0.6) nothing is dropped
    assert as_lists(D3s()(batch, ones(batch), progress=0.8)) == [[1, 1]] * 4


# --- high entropy ------------------------------------------------------------------------------------

def test_high_entropy_top_fraction() -> None:
    batch = make_batch(
        [[(4, [0.1, 3.0, 0.2, 0.5]), (3, [2.0, 5.0, 0.0])], [(5, [1.0, 0.7, 0.05, 0.4, 0.6])]],
        [1.0, -1.0, 0.0],
    )
    weights = [np.array([1.0, 0.5, 1.0, 1.0]), np.array([1.0, 0.0, 1.0]), np.ones(5)]
    out = HighEntropy()(batch, weights, progress=0.0)
    # live tokens: 4 + 2 (r1 t1, H=5.0, dropped earlier, does not count) + 5 = 11; m = ⌈0.2·11⌉ = 3
    # live H sorted: 3.0, 2.0, 1.0, 0.7, … → τ = 1.0; kept tokens keep their weight (0.5 stays 0.5)
    assert as_lists(out) == [[0, 0.5, 0, 0], [1, 0, 0], [1, 0, 0, 0, 0]]


def test_high_entropy_after_d3s_never_revives() -> None:
    batch = make_batch([[(2, [1.0, 0.2]), (2, [0.5, 0.1]), (2, [9.0, 9.0]), (2, [9.0, 9.0])]],
                       [1.5, -0.5, -0.5, -0.5])
    after_d3s = D3s(token_level=False)(batch, ones(batch), progress=0.0)  # keeps rollouts 0 and 1
    out = HighEntropy(top=0.5)(batch, after_d3s, progress=0.0)
    # live H: 1.0, 0.2, 0.5, 0.1 → m = 2, τ = 0.5; the dropped rollouts' H = 9 stay 0
    assert as_lists(out) == [[1, 0], [1, 0], [0, 0], [0, 0]]


# --- contracts -----------------------------------------------------------------------------------------

def test_inputs_untouched() -> None:
    entropies = [[0.1, 2.0, 0.5], [0.4, 0.05], [1.6, 1.0, 0.2]]
    batch = make_batch([[(3, entropies[0]), (2, entropies[1])], [(3, entropies[2])]], [1.0, -2.0, 0.5])
    weights = [np.array([1.0, 1.0, 0.0]), np.ones(2), np.array([2.0, 1.0, 1.0])]
    copies = [w.copy() for w in weights]
    advantages = batch.advantages
    for weighting in (D3s(), HighEntropy()):
        out = weighting(batch, weights, progress=0.1)
        assert all(o is not w for o, w in zip(out, weights, strict=True))
        for w, c in zip(weights, copies, strict=True):
            np.testing.assert_array_equal(w, c)
        assert batch.advantages is advantages
        np.testing.assert_array_equal(advantages, [1.0, -2.0, 0.5])
        assert [r.entropies for r in batch.rollouts] == entropies


def test_missing_entropies_raise() -> None:
    batch = make_batch([[(2, None), (2, None)]], [1.0, -1.0])
    with pytest.raises(ValueError, match="carry no entropies"):
        D3s()(batch, ones(batch), progress=0.0)
    with pytest.raises(ValueError, match="carry no entropies"):
        HighEntropy()(batch, ones(batch), progress=0.0)
    # the sample level alone needs no entropies
    assert as_lists(D3s(token_level=False)(batch, ones(batch), progress=0.0)) == [[1, 1], [1, 1]]


def test_mismatched_entropies_and_missing_advantages_raise() -> None:
    batch = make_batch([[(2, [0.1, 0.2, 0.3])]], [1.0])
    with pytest.raises(ValueError, match="3 entropies but 2 token weights"):
        HighEntropy()(batch, ones(batch), progress=0.0)
    batch.advantages = None
    with pytest.raises(ValueError, match="after the advantage stage"):
        D3s()(batch, [np.ones(2)], progress=0.0)
