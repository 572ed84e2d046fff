"""HAPO's normalised token entropy ĥ (algorithms.md §4.2, shared; AEPO §4.3 (d) uses it too).

    x = log(clamp(H, 1e-8));  med = quantile_pivot(x, "nearest");  s = sqrt(mean (x − med)²)
    h = (x − med)/s;  ĥ = h / max(h > 0) if h > 0,  h / |min(h < 0)| if h ≤ 0

Entropies are written as e^x so that the log-entropies are small integers.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from adarl.tokens.entropy import EntropyStats


def exp(xs: list[float]) -> np.ndarray:
    return np.exp(np.asarray(xs, dtype=np.float64))


def test_fit_six_tokens_by_hand() -> None:
    # x = 0, 1, 2, 3, 4, 5 (given out of order). Quantile 0.8, "nearest": virtual index
    # 0.8·(6 − 1) = 4.0, the 5th smallest, so med = 4.
    # x − med = −4, −3, −2, −1, 0, 1;  squares 16 + 9 + 4 + 1 + 0 + 1 = 31;  s = sqrt(31/6) ≈ 2.2730
    # h = (x − med)/s: the only positive one is 1/s, the lowest −4/s, so
    # pos_max = 1/s ≈ 0.43994, neg_max = 4/s ≈ 1.75977
    stats = EntropyStats.fit(exp([3, 0, 5, 1, 4, 2]))
    s = math.sqrt(31 / 6)
    assert stats.median == pytest.approx(4.0)
    assert stats.scale == pytest.approx(s) == pytest.approx(2.2730, abs=1e-4)
    assert stats.pos_max == pytest.approx(1 / s)
    assert stats.neg_max == pytest.approx(4 / s)
    # ĥ = h/pos_max above the pivot, h/neg_max at or below it; s cancels:
    #   x=0: −4/4 = −1, x=1: −3/4, x=2: −2/4, x=3: −1/4, x=4: 0, x=5: 1/1 = 1
    h = stats.normalise(torch.tensor(exp([0, 1, 2, 3, 4, 5])))
    assert h.tolist() == pytest.approx([-1.0, -0.75, -0.5, -0.25, 0.0, 1.0], abs=1e-6)


def test_fit_eleven_tokens_and_the_pivot() -> None:
    # x = 0..10. pivot 0.8: index 0.8·10 = 8 → med 8; x − med = −8..2
    # Σ(x − med)² = 64+49+36+25+16+9+4+1+0+1+4 = 209;  s = sqrt(209/11) = sqrt(19) ≈ 4.3589
    # pos_max = 2/s, neg_max = 8/s;  ĥ(x=9) = 1/2, ĥ(x=10) = 1, ĥ(x=6) = −2/8 = −0.25
    xs = list(range(11))
    stats = EntropyStats.fit(exp(xs))
    assert (stats.median, stats.scale) == (pytest.approx(8.0), pytest.approx(math.sqrt(19)))
    assert (stats.pos_max, stats.neg_max) == (pytest.approx(2 / math.sqrt(19)), pytest.approx(8 / math.sqrt(19)))
    assert stats.normalise(torch.tensor(exp([9, 10, 6]))).tolist() == pytest.approx([0.5, 1.0, -0.25], abs=1e-6)
    # pivot 0.5: index 5 → med 5; Σ(x − 5)² = 2·(25+16+9+4+1) = 110, s = sqrt(10);
    # pos_max = 5/s = neg_max, so ĥ = (x − 5)/5: x=7 → 0.4, x=1 → −0.8
    half = EntropyStats.fit(exp(xs), pivot=0.5)
    assert (half.median, half.scale) == (pytest.approx(5.0), pytest.approx(math.sqrt(10)))
    assert half.pos_max == pytest.approx(half.neg_max) == pytest.approx(5 / math.sqrt(10))
    assert half.normalise(torch.tensor(exp([7, 1]))).tolist() == pytest.approx([0.4, -0.8], abs=1e-6)


def test_nearest_quantile_rounds_the_index() -> None:
    # x = 0..4, pivot 0.8: index 0.8·4 = 3.2 → nearest 3 (not 3.2, as linear would give)
    # x − 3 = −3, −2, −1, 0, 1; Σ² = 15, s = sqrt(3); pos_max = 1/s, neg_max = 3/s
    stats = EntropyStats.fit(exp([0, 1, 2, 3, 4]))
    assert stats.median == pytest.approx(3.0) and stats.scale == pytest.approx(math.sqrt(3))
    assert stats.normalise(torch.tensor(exp([2]))).tolist() == pytest.approx([-1 / 3], abs=1e-6)


def test_zero_entropy_is_clamped_before_the_log() -> None:
    # H = 0 counts as 1e-8: x = ln 1e-8 = −8·ln 10 ≈ −18.4207. x = (−18.42, 0, 1, 2, 3):
    # pivot 0.8, index 3.2 → med = 2; deviations −20.42, −2, −1, 0, 1;
    # Σ² = 20.4207² + 4 + 1 + 0 + 1 = 417.004 + 6 = 423.004, s = sqrt(423.004/5) ≈ 9.1979
    low = -8 * math.log(10)
    stats = EntropyStats.fit(np.array([0.0, 1.0, math.e, math.e**2, math.e**3]))
    s = math.sqrt(((low - 2) ** 2 + 6) / 5)
    assert stats.median == pytest.approx(2.0) and stats.scale == pytest.approx(s) == pytest.approx(9.1979, abs=1e-4)
    assert stats.neg_max == pytest.approx((2 - low) / s)
    # the zero entropy normalises to exactly −1 (it is the batch minimum), not to −inf or NaN
    assert stats.normalise(torch.tensor([0.0])).tolist() == pytest.approx([-1.0])


def test_tokens_outside_the_fitted_batch_are_clamped() -> None:
    # fitted on x = 0..5 (med 4, pos_max = 1/s, neg_max = 4/s): x = 7 gives h/pos_max = 3 → 1;
    # x = −10 gives −14/4 = −3.5 → −1; x = 4.5 gives 0.5 (inside, unclamped)
    stats = EntropyStats.fit(exp([0, 1, 2, 3, 4, 5]))
    assert stats.normalise(torch.tensor(exp([7, -10, 4.5]))).tolist() == pytest.approx([1.0, -1.0, 0.5], abs=1e-6)


def test_degenerate_batches() -> None:
    # empty: the identity statistics
    assert EntropyStats.fit(np.array([])) == EntropyStats(0.0, 1.0, 1.0, 1.0)
    # all tokens equal (x = 1 each): med 1, s = 0 → 1 (no division by zero), no h above or below
    # the pivot → pos_max = neg_max = 1; every such token normalises to 0
    same = EntropyStats.fit(np.full(4, math.e))
    assert (same.median, same.scale, same.pos_max, same.neg_max) == (pytest.approx(1.0), 1.0, 1.0, 1.0)
    assert same.normalise(torch.tensor([math.e])).tolist() == pytest.approx([0.0], abs=1e-6)
    # the pivot is the maximum (x = 0..4, pivot 0.9: index 3.6 → 4): no token above it, pos_max = 1;
    # x − 4 = −4..0, Σ² = 30, s = sqrt(6), neg_max = 4/s
    top = EntropyStats.fit(exp([0, 1, 2, 3, 4]), pivot=0.9)
    assert top.median == pytest.approx(4.0) and top.pos_max == 1.0
    assert top.neg_max == pytest.approx(4 / math.sqrt(6))


def test_fit_flattens_per_rollout_arrays_and_round_trips() -> None:
    # a (2, 3) array is the six tokens of the first test
    stats = EntropyStats.fit(exp([0, 1, 2, 3, 4, 5]).reshape(2, 3))
    assert stats.median == pytest.approx(4.0) and stats.scale == pytest.approx(math.sqrt(31 / 6))
    assert EntropyStats(**stats.state_dict()) == stats
