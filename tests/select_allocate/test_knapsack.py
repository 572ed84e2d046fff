"""Knapsack-RL (algorithms.md §2.8) by hand: the value, a small knapsack, the fallback, the estimate and its state."""

from __future__ import annotations

import json

import pytest

from adarl import registry
from adarl.allocate.knapsack import value
from adarl.budget import Budget
from adarl.select.store import DifficultyStore
from allocation_groups import group, problems


def knapsack_with_history(history: dict[str, list[int]], **kw):
    ks = registry.build("allocate", {"name": "knapsack", "min_buffer_length": 1, **kw})
    ks.plan([], DifficultyStore([]), Budget())
    ks.more([group(q, c) for q, c in history.items()], DifficultyStore([]), Budget())  # the records
    return ks


def test_knapsack_value_is_the_released_formula():
    # Value(4, 1/2) = (1 − 1/16 − 1/16)·(1/2)(1/4) = 0.875·0.125
    assert value(4, 0.5) == pytest.approx(0.109375)
    # Value(6, 1/4) = (1 − 4^-6 − (3/4)^6)·(1/4)(9/16) = 0.82177734375·0.140625
    assert value(6, 0.25) == pytest.approx(0.115562439)


def test_a_small_knapsack_solved_by_hand():
    # n = 4, three prompts: T = 12. A: p̂ = 1/2, B: p̂ = 1/4 (effective, min_n = 2 each), C: p̂ = 1 (positive_n = 2)
    # R = 12 − 6 = 6. Fallback? c_A = ln 0.1/ln 0.5 = 3.32 → 3, c_B = ln 0.1/ln 0.75 = 8.004 → min(8, ·) = 8:
    # 11 ≥ 6, none. DP over k_A + k_B = 6 (k ≤ max_n − min_n = 6; a prompt given no extra counts 0):
    #   (0,6) V_B(8) = .1265          (1,5) V_A(3) + V_B(7) = .09375 + .12185 = .2156
    #   (2,4) V_A(4) + V_B(6) = .109375 + .115562 = .224937 (best)     (3,3) .1171875 + .1071167 = .224304
    #   (4,2) .12109 + .09558 = .21667  (5,1) .12305 + .07910 = .20215  (6,0) V_A(8) = .12402
    ks = knapsack_with_history({"A": [1, 0, 1, 0], "B": [1, 0, 0, 0], "C": [1, 1, 1, 1]}, n=4, max_n=8)
    assert ks.plan(problems("A", "B", "C"), DifficultyStore([]), Budget()) == {"A": 4, "B": 6, "C": 2}
    assert ks.metrics()["fallback"] == 0.0


def test_a_prompt_given_no_extra_adds_nothing_as_in_the_code():
    # n = 3: A p̂ = 1/2, B p̂ = 1/10, T = 6, R = 6 − 2 − 2 = 2 (c_B = ln 0.1/ln 0.9 = 21.9: no fallback).
    # The code's DP scores (1, 1): V_A(3) + V_B(3) = .09375 + .02187 = .1156 above (2, 0): V_A(4) = .1094, since
    # a prompt given no extra adds 0 (counting V_B(2) = .0146 for it, (2, 0) would win: .1240 > .1156)
    ks = knapsack_with_history({"A": [1, 0], "B": [1] + [0] * 9}, n=3)
    assert ks.plan(problems("A", "B"), DifficultyStore([]), Budget()) == {"A": 3, "B": 3}


def test_knapsack_ties_go_to_the_smaller_extra_of_the_later_prompt():
    # n = 3: A, B p̂ = 1/2, C p̂ = 1: T = 9, R = 9 − 6 = 3; (1, 2) and (2, 1) tie at V(3) + V(4) = .203125.
    # The code keeps the smaller k on a tie while it adds prompts in order, so B (the last) gets 1, A 2
    ks = knapsack_with_history({"A": [1, 0], "B": [0, 1], "C": [1, 1]}, n=3, max_n=5)
    assert ks.plan(problems("A", "B", "C"), DifficultyStore([]), Budget()) == {"A": 4, "B": 3, "C": 2}


def test_knapsack_fallback_and_unknown_prompts():
    # n = 8: A p̂ = 1/2, D p̂ = 0, U never seen. T = 24; U gets n = 8, A min_n 2, D negative_n 2: R = 12.
    # c_A = ⌊3.32⌋ = 3 < 12 → fallback: 12 − 3 = 9 go to D (the only p̂ = 0 prompt), R = 3 → A gets 3 extra
    ks = knapsack_with_history({"A": [1, 0], "D": [0, 0, 0]}, n=8)
    assert ks.plan(problems("A", "D", "U"), DifficultyStore([]), Budget()) == {"A": 5, "D": 11, "U": 8}
    assert ks.metrics()["fallback"] == 1.0 and ks.metrics()["fallback_effective_ratio"] == pytest.approx(3 / 12)
    # no effective prompt (n = 4, two p̂ = 0 prompts): T = 8, R = 8 − 2 − 2 = 4, 2 more each
    ks = knapsack_with_history({"D": [0, 0], "E": [0, 0]}, n=4)
    assert ks.plan(problems("D", "E"), DifficultyStore([]), Budget()) == {"D": 4, "E": 4}


def test_knapsack_estimates_from_the_latest_group_or_the_robust_window():
    ks = knapsack_with_history({"A": [1, 1, 1, 1]}, min_buffer_length=8)
    assert ks.estimate("A") is None  # 4 outcomes < min_buffer_length = 8: unknown, so it gets n
    ks.more([group("A", [0, 0, 0, 1])], DifficultyStore([]), Budget())  # already recorded this step: no effect
    ks._recorded = False
    ks.more([group("A", [0, 0, 0, 1])], DifficultyStore([]), Budget())
    assert ks.estimate("A") == 0.25  # the latest group's mean
    ks.robust = True  # the latest group (4) is smaller than 16: the last 16 outcomes, 5 of 8 correct
    assert ks.estimate("A") == 5 / 8
    other = registry.build("allocate", {"name": "knapsack", "robust": True})
    other.load_state_dict(json.loads(json.dumps(ks.state_dict())))
    assert other.estimate("A") == 5 / 8 and other.records == ks.records
