"""Credit in trees (advantage stage): TreePO's subgroup baseline, TreeRL's segment values, the
polychromic set advantage. Every expected value is worked out by hand in the comments, on one tree:

    prompt ─ a ─┬─ b ─┬─ x0   r = 1        a: 2 tokens, b: 1, x0: 1, x1: 1, x2: 2, y3: 3
                │     └─ x1   r = 0        leaves 0, 1 hold a and b; leaf 2 holds a;
                └─ x2         r = 1        leaf 3 (sampled from the prompt) holds only y3
    prompt ─ y3               r = 0
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from adarl import registry
from adarl.advantage.polychromic import set_advantages
from adarl.advantage.tree import leaf_paths
from adarl.train.learner import token_advantages
from adarl.types import Batch, Group, Problem, Rollout, Span, trainable_masks


def model_span(n: int, start: int) -> Span:
    return Span("model", list(range(start, start + n)), [-1.0] * n, None, [0] * n)


def tree_group() -> Group:
    a, b = model_span(2, 10), model_span(1, 20)
    leaves = [Rollout("p", finish_reason="stop", spans=[a, b, model_span(1, 30)]),
              Rollout("p", finish_reason="stop", spans=[a, b, model_span(1, 40)]),
              Rollout("p", finish_reason="stop", spans=[a, model_span(2, 50)]),
              Rollout("p", finish_reason="stop", spans=[model_span(3, 60)])]
    rewards = np.array([[1.0], [0.0], [1.0], [0.0]])
    return Group(Problem("p", [{"role": "user", "content": "q"}], "1"), [1], leaves, rewards, ("r",),
                 rewards[:, 0].copy())


def test_the_tree_is_read_from_shared_spans():
    g = tree_group()
    paths = leaf_paths(g.rollouts)
    assert [[n.leaves for n in p] for p in paths] == [[(0, 1, 2), (0, 1), (0,)], [(0, 1, 2), (0, 1), (1,)],
                                                      [(0, 1, 2), (2,)], [(3,)]]


def test_treepo_subgroup_baseline_by_hand():
    # root mean 0.5 (4 leaves); subgroup under a: {0,1,2}, mean 2/3; under b: {0,1}, mean 1/2
    # leaf 0: terms 1−.5 (w 4), 1−2/3 (w 3), 1−.5 (w 2) -> (2 + 1 + 1)/9 = 4/9
    # leaf 1: −.5 (4), −2/3 (3), −.5 (2) -> (−2 − 2 − 1)/9 = −5/9
    # leaf 2: .5 (4), 1/3 (3) -> 3/7;  leaf 3: −.5 (its only subgroup is the root)
    est = registry.build("advantage", {"name": "treepo", "whiten": "none"})
    np.testing.assert_allclose(est(Batch([tree_group()])), [4 / 9, -5 / 9, 3 / 7, -0.5])
    # average over depths: leaf 2 gets (.5 + 1/3)/2 = 5/12
    est = registry.build("advantage", {"name": "treepo", "whiten": "none", "weighting": "average"})
    np.testing.assert_allclose(est(Batch([tree_group()])), [4 / 9, -5 / 9, 5 / 12, -0.5])


def test_treepo_whitens_over_tokens_like_the_code():
    # each leaf's tokens carry its advantage: lengths 4, 4, 4, 3 sampled tokens
    raw = np.array([4 / 9, -5 / 9, 3 / 7, -0.5])
    tokens = np.repeat(raw, [4, 4, 4, 3])
    expected = (raw - tokens.mean()) / math.sqrt(tokens.var(ddof=1) + 1e-8)
    got = registry.build("advantage", {"name": "treepo"})(Batch([tree_group()]))
    np.testing.assert_allclose(got, expected)
    assert abs(np.repeat(got, [4, 4, 4, 3]).mean()) < 1e-12


def test_treepo_of_independent_samples_is_the_group_baseline():
    g = tree_group()
    g.rollouts = [Rollout("p", [1, 2], [-1.0, -1.0], "stop") for _ in range(4)]
    est = registry.build("advantage", {"name": "treepo", "whiten": "none"})
    np.testing.assert_allclose(est(Batch([g])), [0.5, -0.5, 0.5, -0.5])


def test_treerl_segment_values_by_hand():
    # V(root) = .5. a: V 2/3, GA = LA = 1/6, R = (1/3)/√3, trained once for its 3 leaves: 3R = 1/√3
    # b: V .5, GA 0, LA −1/6, R = −(1/6)/√2, ×2 = −√2/6
    # x0: V 1, GA .5, LA .5 -> 1;  x1: −1;  x2: GA .5, LA 1 − 2/3 -> 5/6;  y3: −1
    g = tree_group()
    batch = Batch([g])
    adv = registry.build("advantage", {"name": "treerl"})(batch)
    np.testing.assert_allclose(adv, [1.0, -1.0, 5 / 6, -1.0])
    rollouts = batch.rollouts
    per_token = token_advantages(rollouts, adv, trainable_masks(rollouts), batch.span_advantages)
    s3, s2 = 1 / math.sqrt(3), -math.sqrt(2) / 6
    np.testing.assert_allclose(per_token[0], [s3, s3, s2, 1.0])
    np.testing.assert_allclose(per_token[1], [0.0, 0.0, 0.0, -1.0])  # a and b train once, in leaf 0
    np.testing.assert_allclose(per_token[2], [0.0, 0.0, 5 / 6, 5 / 6])
    np.testing.assert_allclose(per_token[3], [-1.0, -1.0, -1.0])
    # shared: once -> a gets R itself, (1/3)/√3
    batch = Batch([tree_group()])
    registry.build("advantage", {"name": "treerl", "shared": "once"})(batch)
    a = batch.groups[0].rollouts[0].spans[0]
    assert batch.span_advantages[id(a)] == pytest.approx((1 / 3) / math.sqrt(3))


def test_treerl_gives_equal_rewards_exactly_zero():
    g = tree_group()
    g.rewards = np.full((4, 1), 0.1)
    batch = Batch([g])
    adv = registry.build("advantage", {"name": "treerl"})(batch)
    assert np.all(adv == 0.0) and all(v == 0.0 for v in batch.span_advantages.values())


def test_polychromic_set_advantage_by_hand():
    # N = 3, sets of 2: {0,1}, {0,2}, {1,2} equally likely.
    # r = (1, 0, 0), answers (5, 9, 9): f01 = .5·2/2 = .5, f02 = .5, f12 = 0·1/2 = 0; mean f = 1/3
    # A0 = .5 − 1/3 = 1/6, A1 = (.5 + 0)/2 − 1/3 = −1/12, A2 = −1/12
    rng = np.random.default_rng(0)
    got = set_advantages(np.array([1.0, 0.0, 0.0]), ["5", "9", "9"], 2, 20000, rng)
    np.testing.assert_allclose(got, [1 / 6, -1 / 12, -1 / 12], atol=0.01)
    # two right answers that agree add no diversity: every set scores .5, so no rollout is better
    got = set_advantages(np.array([1.0, 1.0, 0.0]), ["5", "5", "9"], 2, 2000, rng)
    np.testing.assert_allclose(got, [0.0, 0.0, 0.0], atol=1e-12)
    assert np.all(set_advantages(np.array([1.0, 0.0]), ["1", "2"], 2, 32, rng) == 0.0)  # one possible set


def test_polychromic_draws_resume_from_its_state():
    g = tree_group()
    for r, t in zip(g.rollouts, ["so 5", "so 9", "so 7", "so 9"], strict=True):
        r.text = t
    est = registry.build("advantage", {"name": "polychromic", "n": 2, "subsets": 3})
    est(Batch([g]))
    state = est.state_dict()
    second = est(Batch([g]))
    fresh = registry.build("advantage", {"name": "polychromic", "n": 2, "subsets": 3})
    fresh.load_state_dict(state)
    np.testing.assert_array_equal(fresh(Batch([g])), second)
