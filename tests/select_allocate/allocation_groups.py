"""Scored groups and problems for the allocator tests: `group(pid, correct)` is one prompt's rollouts with
0/1 correctness as their one reward column."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from adarl.budget import Budget
from adarl.select.store import DifficultyStore
from adarl.types import Group, Problem, Rollout, merge


def group(pid: str, correct: list[int], length: int = 3) -> Group:
    rollouts = [Rollout(pid, [1] * length, [0.0] * length, "stop", text=f"{pid}{i}") for i in range(len(correct))]
    c = np.array(correct, dtype=float)
    return Group(Problem(pid, "q"), [0], rollouts, rewards=c[:, None], reward_names=("acc",), correct=c)


def problems(*ids: str) -> list[Problem]:
    return [Problem(q, q) for q in ids]


def drive_step(allocator: Any, chosen: list[Problem], store: DifficultyStore, budget: Budget,
               rng: np.random.Generator, step: int, make: Callable[..., Group] = group) -> list[Group]:
    """One step of `allocator` as the trainer drives it: its plan, then rounds of `more` until it asks for none,
    each prompt's rollouts drawn with random 0/1 outcomes and lengths (`make(pid, correct, length=...)`); the
    step's rollout bound is asserted after every round. Returns the groups `finish` keeps."""
    counts = allocator.plan(chosen, store, budget)
    groups: dict[str, Group] = {}
    while counts:
        assert all(n > 0 for n in counts.values())
        fresh = [make(q, rng.integers(0, 2, size=n).tolist(), length=int(rng.integers(1, 16)))
                 for q, n in counts.items()]
        budget.spend([r for g in fresh for r in g.rollouts])
        assert budget.step_rollouts <= budget.rollouts_per_step
        store.update(fresh, step)
        merge(groups, fresh)
        counts = allocator.more(list(groups.values()), store, budget)
    assert budget.step_rollouts <= budget.rollouts_per_step
    return allocator.finish(list(groups.values()))
