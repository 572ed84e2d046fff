"""The polychromic objective: a rollout is credited with what it adds to a *set* of rollouts that
must be both right and different (Hamid et al. 2025, "Polychromic Objectives for Reinforcement
Learning"; algorithms.md §6.3, from the abstract: no released code was found).

For a set S of n rollouts of one state (here: one prompt, the group),

    f_poly(S) = ( (1/n) Σ_{o ∈ S} r(o) ) · d(S),     d(S) = |distinct outcomes in S| / n

where an outcome is the rollout's extracted final answer (`outcome: last_number`, the default;
`answer_tag`, `boxed` as in rewards/short_answer.py; `text`: the whole stripped completion; a
rollout without an answer is an outcome of its own kind, "none"). Vine sampling draws M random
subsets of size n from the group's N rollouts, and the set advantage of rollout i is

    A_i = mean_{S ∋ i} f_poly(S) − mean_S f_poly(S)

(0 for a rollout in no drawn subset), used in place of the GRPO advantage with the PPO loss
unchanged. Defaults n = 4, M = 32 (§6.3, guessed). A group of at most n rollouts has one possible
set: every A_i is 0 (it carries no set-level signal). The subsets are drawn from a generator seeded
by `seed` and the number of calls so far, which checkpoints with the estimator.

Branched groups: the state is the prompt; the tree's shared spans get the mean advantage of the
leaves under them (`train/learner.py: token_advantages`).
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import Field
from pydantic.dataclasses import dataclass

from adarl.advantage.base import group_segments
from adarl.registry import STRICT, register
from adarl.rewards.short_answer import extract
from adarl.types import Batch


def set_advantages(rewards: np.ndarray, outcomes: list[str | None], n: int, subsets: int,
                   rng: np.random.Generator) -> np.ndarray:
    """A_i for one group (see the module docstring)."""
    size = len(rewards)
    if size <= n:
        return np.zeros(size)
    codes = np.unique(np.array(["\0none" if o is None else o for o in outcomes], dtype=object), return_inverse=True)[1]
    total = np.zeros(size)
    count = np.zeros(size)
    values = np.empty(subsets)
    for m in range(subsets):
        s = rng.choice(size, n, replace=False)
        values[m] = rewards[s].mean() * len(set(codes[s].tolist())) / n
        total[s] += values[m]
        count[s] += 1
    return np.where(count > 0, total / np.maximum(count, 1) - values.mean(), 0.0)


@register("advantage", "polychromic")
@dataclass(config=STRICT)
class Polychromic:
    n: int = Field(4, ge=2, le=4096)  # set size
    subsets: int = Field(32, ge=1, le=1_000_000)  # M: sets drawn per group
    outcome: Literal["last_number", "answer_tag", "boxed", "text"] = "last_number"
    seed: int = 0  # the set draws'; unset in a recipe: the run's seed (registry.build)

    def __post_init__(self) -> None:
        self.calls = 0

    def __call__(self, batch: Batch) -> np.ndarray:
        rewards = batch.rewards.astype(np.float64)
        rollouts = batch.rollouts
        rng = np.random.default_rng([self.seed, self.calls])
        self.calls += 1
        texts = [r.text for r in rollouts]
        outcomes = [t.strip() if self.outcome == "text" else extract(t, self.outcome) for t in texts]
        adv = np.zeros(len(rewards))
        sizes = batch.group_sizes
        for start, size in zip(group_segments(sizes), sizes, strict=True):
            adv[start:start + size] = set_advantages(rewards[start:start + size], outcomes[start:start + size],
                                                     self.n, self.subsets, rng)
        return adv

    def state_dict(self) -> dict:
        return {"calls": self.calls}

    def load_state_dict(self, state: dict) -> None:
        self.calls = int(state["calls"])
