"""Reinforce-Ada (algorithms.md §2.9) by hand: an elimination sequence over rounds, the kept group."""

from __future__ import annotations

import math

import numpy as np
import pytest

from adarl import registry
from adarl.budget import Budget
from adarl.select.store import DifficultyStore
from adarl.types import merge
from allocation_groups import group, problems


def test_reinforce_ada_elimination_sequence_by_hand():
    # K = 4 (2 positive + 2 negative to leave), M = 2 rollouts a round, R = 3 rounds
    ada = registry.build("allocate", {"name": "reinforce_ada", "n": 4, "round_n": 2, "max_rounds": 3})
    store, budget = DifficultyStore([]), Budget()
    assert ada.plan(problems("a", "b", "c"), store, budget) == {"a": 2, "b": 2, "c": 2}
    groups: dict = {}
    # round 1: a 1 1 | b 1 0 | c 0 0  → nobody has 2 and 2 yet
    merge(groups, [group("a", [1, 1]), group("b", [1, 0]), group("c", [0, 0])])
    assert ada.more(list(groups.values()), store, budget) == {"a": 2, "b": 2, "c": 2}
    # round 2: a 0 0 → (2 pos, 2 neg): leaves | b 1 1 → (3, 1) stays | c 0 0 → (0, 4) stays
    merge(groups, [group("a", [0, 0]), group("b", [1, 1]), group("c", [0, 0])])
    assert ada.more(list(groups.values()), store, budget) == {"b": 2, "c": 2}
    # round 3: b 0 1 → (4, 2): leaves | c 0 0 → (0, 6): still active, but R = 3 rounds are spent
    merge(groups, [group("b", [0, 1]), group("c", [0, 0])])
    assert ada.more(list(groups.values()), store, budget) == {}
    assert ada.metrics()["total_samples"] == 6 + 6 + 4 and ada.metrics()["prompts_active_after_1st_round"] == 3
    kept = {g.problem.id: g for g in ada.finish(list(groups.values()))}
    # a: positives 0, 1 and negatives 2, 3 → all four; b: history 1 0 1 1 0 1 → first 2 positives (0, 2) and
    # first 2 negatives (1, 4); c: all negative → the first K = 4 negatives (a zero-advantage group)
    assert [r.text for r in kept["a"].rollouts] == ["a0", "a1", "a0", "a1"]
    assert kept["b"].correct.tolist() == [1, 0, 1, 0]
    assert [r.text for r in kept["b"].rollouts] == ["b0", "b1", "b0", "b0"]
    assert kept["c"].size == 4 and not kept["c"].correct.any()


def test_reinforce_ada_positive_focused_and_a_short_side():
    ada = registry.build("allocate", {"name": "reinforce_ada", "n": 4, "round_n": 4, "max_rounds": 1,
                                      "choice": "positive_focused"})
    ada.plan(problems("a"), DifficultyStore([]), Budget())
    # one positive leaves at once; the split wants 2 positives, there is 1: the negatives top it up to K
    g = group("a", [0, 0, 1, 0])
    assert ada.more([g], DifficultyStore([]), Budget()) == {}
    (kept,) = ada.finish([g])
    assert kept.correct.tolist() == [0, 0, 1, 0]


def test_a_spare_prompt_joins_the_rounds():
    # over-provisioning plans spare s on a copy: it is not among the planned prompts, but its group arrives
    ada = registry.build("allocate", {"name": "reinforce_ada", "n": 2, "round_n": 2, "max_rounds": 2})
    assert ada.plan(problems("a"), DifficultyStore([]), Budget()) == {"a": 2}
    # a has 1 correct and 1 wrong: collected (K = 2); s has none correct: another round
    assert ada.more([group("a", [1, 0]), group("s", [0, 0])], DifficultyStore([]), Budget()) == {"s": 2}


def test_global_statistics_give_the_kept_group_the_baseline_of_all_its_samples():
    from adarl.types import Batch

    ada = registry.build("allocate", {"name": "reinforce_ada", "n": 4, "round_n": 6, "max_rounds": 1,
                                      "global_stats": True})
    ada.plan(problems("b"), DifficultyStore([]), Budget())
    g = group("b", [1, 0, 1, 1, 0, 1])  # P = 4, N = 2: collected; the first 2 + 2 are kept: 1 0 1 0
    ada.more([g], DifficultyStore([]), Budget())
    (kept,) = ada.finish([g])
    # mean 4/6 = 2/3; std = sqrt(4·2/(6·5)) = sqrt(8/30) = 0.5164 (the kept four alone: 1/2 and 0.5774)
    assert kept.baseline == pytest.approx((2 / 3, math.sqrt(8 / 30)))
    drgrpo = registry.build("advantage", {"name": "drgrpo"})(Batch([kept]))
    assert drgrpo == pytest.approx([1 / 3, -2 / 3, 1 / 3, -2 / 3])
    grpo = registry.build("advantage", {"name": "grpo"})(Batch([kept]))
    assert grpo == pytest.approx(np.array([1 / 3, -2 / 3, 1 / 3, -2 / 3]) / math.sqrt(8 / 30), rel=1e-5)
    # all negative over every round: baseline mean 0, so the K negatives train with advantage 0
    ada.plan(problems("c"), DifficultyStore([]), Budget())
    (dead,) = ada.finish([group("c", [0] * 6)])
    assert dead.baseline == (0.0, 0.0) and registry.build("advantage", {"name": "drgrpo"})(Batch([dead])).tolist() \
        == [0.0] * 4
