"""GRESO (algorithms.md §2.10) by hand: streaks, the skip probability after a known history, its adaptation,
its state."""

from __future__ import annotations

import json

import numpy as np
import pytest

from adarl import registry
from adarl.select.greso import keep_probability
from adarl.select.store import DifficultyStore
from allocation_groups import group


def test_greso_skip_probability_after_a_known_history():
    # streak of 3 all-correct visits with p_easy = 0.5: kept with max(0.5³, 0.01) = 0.125, skipped 0.875
    assert keep_probability(3, 0, 0.5, 0.5, 0.01) == 0.125
    # 7 all-wrong visits, p_hard = 0.5: 0.5⁷ = 0.0078 < 0.01 → the exploration floor keeps 1 %
    assert keep_probability(0, 7, 0.5, 0.5, 0.01) == 0.01
    assert keep_probability(0, 0, 0.5, 0.5, 0.01) == 1.0  # no streak: always rolled out
    greso = registry.build("select", {"name": "greso"})
    store = DifficultyStore(["e", "m", "h"])
    # visits: e all correct 3 times; m all correct, then mixed; h mixed, then all wrong twice
    for visit in ([1, 1], [1, 1], [1, 1]):
        greso.observe(store, [group("e", visit)])
    greso.observe(store, [group("m", [1, 1])])
    greso.observe(store, [group("m", [1, 0])])
    for visit in ([1, 0], [0, 0], [0, 0]):
        greso.observe(store, [group("h", visit)])
    assert greso.easy_streak.tolist() == [3, 0, 0] and greso.hard_streak.tolist() == [0, 0, 2]
    # so e is kept with 1/8, m always, h with 1/4: over 4000 draws of one prompt each, the kept counts
    counts = np.zeros(3)
    rng = np.random.default_rng(0)
    for _ in range(4000):
        greso.order, greso.cursor = [0, 1, 2], 0  # the epoch's order: e, m, h
        counts[greso.select(store, 1, rng)[0]] += 1
    # P(first kept = e) = 1/8, = m: 7/8; h is never reached (m always keeps): 500 ± 3σ (σ = 21)
    assert abs(counts[0] - 500) < 63 and counts[2] == 0


def test_greso_adapts_its_base_probabilities_from_the_second_epoch():
    greso = registry.build("select", {"name": "greso"})
    store = DifficultyStore([f"q{i}" for i in range(4)])
    rng = np.random.default_rng(0)
    greso.select(store, 4, rng)  # epoch 1: no adaptation
    greso.observe(store, [group("q0", [1, 1]), group("q1", [1, 0]), group("q2", [0, 1]), group("q3", [0, 1])])
    assert greso.probability == {"easy": 0.5, "hard": 0.5}
    greso.select(store, 2, rng)  # epoch 2
    # r_easy = 1/4 ≥ z/3 = 1/12 → p_easy − 0.01 (skip more); r_hard = 0 < 2z/3 = 1/6 → p_hard + 0.01
    greso.observe(store, [group("q0", [1, 1]), group("q1", [1, 0]), group("q2", [0, 1]), group("q3", [0, 1])])
    assert greso.probability == pytest.approx({"easy": 0.49, "hard": 0.51})
    other = registry.build("select", {"name": "greso"})
    other.load_state_dict(json.loads(json.dumps(greso.state_dict())))
    assert other.probability == greso.probability and other.easy_streak.tolist() == greso.easy_streak.tolist()
    a, b = np.random.default_rng(5), np.random.default_rng(5)
    assert greso.select(store, 3, a) == other.select(store, 3, b)
