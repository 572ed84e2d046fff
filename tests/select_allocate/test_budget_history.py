"""The step's rollout bound, whatever history the allocator itself built over earlier steps (a property test
beside test_allocation.py's, for allocators that keep per-prompt records or predict from the store)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from adarl import registry
from adarl.budget import Budget
from adarl.select.store import DifficultyStore
from adarl.types import Problem
from allocation_groups import drive_step

ALLOCATORS = [{"name": "knapsack", "n": 4, "min_buffer_length": 2, "max_n": 16},
              {"name": "knapsack", "n": 8, "robust": True, "cost_estimation": "expectation"},
              {"name": "reinforce_ada", "n": 4, "round_n": 3}, {"name": "reinforce_ada", "choice": "positive_focused"},
              {"name": "vip", "n": 6}, {"name": "vip", "estimator": "rloo", "reuse_mean": True}]


@settings(max_examples=25, deadline=None, database=None)
@given(spec=st.sampled_from(ALLOCATORS), limit=st.integers(1, 200), k=st.integers(1, 8), seed=st.integers(0, 10_000))
def test_allocators_with_a_history_never_exceed_the_step_rollouts(spec, limit, k, seed):
    rng = np.random.default_rng(seed)
    ids = [f"p{i}" for i in range(40)]
    store = DifficultyStore(ids, problems=[Problem(q, f"what is {i} plus {i % 7}") for i, q in enumerate(ids)])
    allocator = registry.build("allocate", spec)
    for step in range(1, 4):  # a random history, through the allocator as the trainer runs it
        budget = Budget(rollouts_per_step=limit, expected_length=8)
        budget.start_step()
        chosen = [Problem(q, "x") for q in rng.choice(ids, size=allocator.candidates(k), replace=False)]
        assert all(g.size for g in drive_step(allocator, chosen, store, budget, rng, step))
