"""The curriculum selector: prompts whose estimated pass rate is inside [low, high] come first."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from pydantic import ValidationError

from adarl.registry import build
from adarl.select.curriculum import Curriculum
from adarl.select.store import DifficultyStore


def store_with(passes: list[tuple[int, int]]) -> DifficultyStore:
    """A store whose prompt i has `passes[i] = (successes, failures)` on top of the Beta(1, 1) prior,
    so its posterior-mean pass rate is (1 + s)/(2 + s + f); (0, 0) is a prompt never seen (0.5)."""
    store = DifficultyStore([f"p{i}" for i in range(len(passes))])
    for i, (s, f) in enumerate(passes):
        store.alpha[i], store.beta[i] = 1 + s, 1 + f
        if s + f:
            store.last_step[i] = 0
    return store


# pass estimates (1 + s)/(2 + s + f), worked by hand:
#   p0 (0, 18) → 1/20 = 0.05     p1 (0, 8) → 1/10 = 0.10     p2 (2, 6) → 3/10 = 0.30
#   p3 (4, 4)  → 5/10 = 0.50     p4 (6, 2) → 7/10 = 0.70     p5 (8, 0) → 9/10 = 0.90
#   p6 (18, 0) → 19/20 = 0.95    p7 (2, 15) → 3/19 ≈ 0.158   p8 (15, 2) → 16/19 ≈ 0.842
#   p9 (5, 3)  → 6/10 = 0.60
TEN = [(0, 18), (0, 8), (2, 6), (4, 4), (6, 2), (8, 0), (18, 0), (2, 15), (15, 2), (5, 3)]
IN_BAND = {2, 3, 4, 9}  # 0.2 ≤ p ≤ 0.8 (the default band)


def test_the_store_holds_the_hand_worked_pass_rates() -> None:
    p = store_with(TEN).pass_estimate()
    assert p == pytest.approx([0.05, 0.10, 0.30, 0.50, 0.70, 0.90, 0.95, 3 / 19, 16 / 19, 0.60])


def test_picks_only_from_the_band_when_it_holds_enough() -> None:
    # k = 3, pool = 4: ⌈4·3⌉ = 12 ≥ 10 candidates, so every prompt is a candidate and the 3 picks
    # come from the 4 in-band prompts, in random order: each is picked with probability 3/4.
    store, selector = store_with(TEN), Curriculum()
    picks = [selector.select(store, 3, np.random.default_rng(seed)) for seed in range(400)]
    assert all(len(set(p)) == 3 and set(p) <= IN_BAND for p in picks)
    counts = Counter(i for p in picks for i in p)
    # 400 draws, 300 expected per in-band prompt, binomial sd sqrt(400·0.75·0.25) ≈ 8.7: ±40 is 4.6 sd
    assert set(counts) == IN_BAND and all(260 <= c <= 340 for c in counts.values()), counts


def test_fills_up_with_the_prompts_closest_to_the_band() -> None:
    # k = 6 but only 4 in band: the other two are the nearest ones. Distances to [0.2, 0.8]:
    #   p0 0.15, p1 0.10, p5 0.10, p6 0.15, p7 0.2 − 3/19 ≈ 0.042, p8 16/19 − 0.8 ≈ 0.042
    # so p7 and p8 (≈ 0.042 each) fill the two places, after the in-band four.
    store = store_with(TEN)
    for seed in range(20):
        picks = Curriculum().select(store, 6, np.random.default_rng(seed))
        assert set(picks[:4]) == IN_BAND and set(picks[4:]) == {7, 8}


def test_an_empty_band_falls_back_to_the_nearest_prompts() -> None:
    # Every prompt solved (estimates above 0.8, nothing in the band): the selector still returns
    # k prompts, those closest to the band, i.e. the least-solved ones.
    #   (8, 0) → 0.90, (18, 0) → 0.95, (15, 2) → 16/19 ≈ 0.842, (38, 0) → 0.975, (12, 1) → 13/15 ≈ 0.867
    store = store_with([(8, 0), (18, 0), (15, 2), (38, 0), (12, 1)])
    for seed in range(10):
        assert Curriculum().select(store, 2, np.random.default_rng(seed)) == [2, 4]
    # all unsolved instead (0.05, 0.10, 3/19): the most-solved come first
    store = store_with([(0, 18), (0, 8), (2, 15)])
    assert Curriculum().select(store, 2, np.random.default_rng(0)) == [2, 1]


def test_a_band_of_one_point_ranks_by_distance() -> None:
    # low = high = 0.5: only p3 (0.50) is inside; then p9 (0.6, distance 0.1), then p2/p4 (0.2 each)
    store = store_with(TEN)
    picks = Curriculum(low=0.5, high=0.5).select(store, 4, np.random.default_rng(3))
    assert picks[:2] == [3, 9] and set(picks[2:]) == {2, 4}


def test_unseen_prompts_start_inside_the_default_band() -> None:
    # 3 prompts solved every time (0.95), 3 never seen (prior mean 1/2 = 0.5, in band)
    store = store_with([(18, 0)] * 3 + [(0, 0)] * 3)
    for seed in range(10):
        assert set(Curriculum().select(store, 3, np.random.default_rng(seed))) == {3, 4, 5}


def test_only_the_candidate_pool_is_ranked() -> None:
    # 1000 prompts, even ones in band (0.5, unseen), odd ones solved (0.95). pool = 4, k = 50: 200
    # uniform candidates hold ~100 in-band ones, so all 50 picks are in band (the chance that
    # fewer than 50 of 200 are even is a binomial tail far below 1e-9). pool = 1: the 50
    # candidates are the picks, so about half (25, sd sqrt(50)/2 ≈ 3.5) are solved ones.
    store = store_with([(0, 0), (18, 0)] * 500)
    wide = Curriculum(pool=4.0).select(store, 50, np.random.default_rng(0))
    assert len(set(wide)) == 50 and all(i % 2 == 0 for i in wide)
    narrow = Curriculum(pool=1.0).select(store, 50, np.random.default_rng(0))
    assert len(set(narrow)) == 50 and 10 <= sum(i % 2 for i in narrow) <= 40


def test_band_must_be_ordered_and_the_registry_builds_it() -> None:
    with pytest.raises(ValidationError, match=r"low \(0.9\) must not exceed high \(0.1\)"):
        Curriculum(low=0.9, high=0.1)
    selector = build("select", {"name": "curriculum", "low": 0.3, "high": 0.6})
    assert isinstance(selector, Curriculum) and (selector.low, selector.high, selector.pool) == (0.3, 0.6, 4.0)
    assert selector.state_dict() == {}


def test_every_selector_declares_its_store_decay():
    """VADE owns its decay factors (the trainer hands them to the store); the others keep all evidence."""
    from adarl import registry

    assert registry.build("select", {"name": "vade", "gamma_short": 0.3, "gamma_long": 0.8}).store_decay() == (0.3, 0.8)
    for name in registry.names("select"):
        if name != "vade":
            assert registry.build("select", {"name": name}).store_decay() == (1.0, 1.0), name
