"""DAPO's overlong filtering (algorithms.md §1.3): the loss of a truncated sample is masked."""

from __future__ import annotations

import numpy as np
import pytest

from adarl import registry
from adarl.tokens.base import weigh_tokens
from adarl.types import Batch, Group, Problem, Rollout


def test_truncated_rollouts_leave_the_loss_and_its_count() -> None:
    # one group: a finished answer (3 tokens), one cut at max_new_tokens (2 tokens), another finished (1 token)
    rollouts = [Rollout("p", [1, 2, 3], [0.0] * 3, "stop"), Rollout("p", [4, 5], [0.0] * 2, "length"),
                Rollout("p", [6], [0.0], "stop")]
    rewards = np.array([[1.0], [0.0], [0.0]])
    batch = Batch([Group(Problem("p", "q"), [9], rollouts, rewards=rewards, reward_names=("correct",))],
                  advantages=np.array([1.0, -0.5, -0.5]))
    weights, metrics = weigh_tokens([registry.build("tokens", {"name": "overlong_filter"})], batch, 0.0)
    # the truncated rollout's 2 tokens get weight 0: out of the loss and of token-mean's count (4 of 6 kept)
    assert [w.tolist() for w in weights] == [[1.0, 1.0, 1.0], [0.0, 0.0], [1.0]]
    assert metrics["tokens/kept_fraction"] == pytest.approx(4 / 6)
    assert metrics["tokens/kept_rollout_fraction"] == pytest.approx(2 / 3)


def test_the_recipe_key_loads() -> None:
    from adarl.config import load_recipe

    recipe = load_recipe(data={"task": {"source": "reasoning_gym", "name": "basic_arithmetic"},
                               "tokens": [{"name": "overlong_filter"}]})
    assert recipe.tokens == [{"name": "overlong_filter"}]
