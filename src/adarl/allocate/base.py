"""RolloutAllocator protocol: how many rollouts each selected prompt gets.

Allocation may run in stages within one step: `plan` gives the first counts, `more` looks at
the verified groups and asks for extra rollouts (an empty dict ends the step), and `finish`
filters or down-samples the final groups. Every allocator spends only what `budget` allows:
`fit` trims a request to the step's rollout allowance exactly, and to its token allowance
by each prompt's expected length (the difficulty store's history).
"""

from __future__ import annotations

import copy
from typing import Protocol

import numpy as np

from adarl.budget import Budget
from adarl.select.store import DifficultyStore
from adarl.types import Group, Problem, PromptId, Request


class RolloutAllocator(Protocol):
    def candidates(self, k: int) -> int:
        """How many prompts the selector should offer for a step that trains on k."""
        ...

    def plan(self, problems: list[Problem], store: DifficultyStore, budget: Budget) -> dict[PromptId, int]: ...

    def more(self, groups: list[Group], store: DifficultyStore, budget: Budget) -> dict[PromptId, int]: ...

    def finish(self, groups: list[Group]) -> list[Group]: ...


def _largest_remainder(weights: np.ndarray, total: int) -> np.ndarray:
    """Integers proportional to `weights` summing to exactly `total` (Hamilton's method)."""
    if total <= 0 or weights.sum() <= 0:
        return np.zeros(len(weights), dtype=np.int64)
    exact = weights * (total / weights.sum())
    out = np.floor(exact).astype(np.int64)
    short = total - int(out.sum())
    if short > 0:
        out[np.argsort(-(exact - out), kind="stable")[:short]] += 1
    return out


def fit(counts: dict[PromptId, int], budget: Budget, store: DifficultyStore | None = None) -> dict[PromptId, int]:
    """Trim `counts` to what the budget still allows this step, proportionally.

    Rollouts are capped exactly. Tokens are capped by expected length: a prompt's mean
    completion length from the store, or `budget.expected_length` for prompts never seen.
    """
    ids = [q for q, n in counts.items() if n > 0]
    want = np.array([counts[q] for q in ids], dtype=np.int64)
    rollouts_left = budget.step_rollouts_left()
    if rollouts_left is not None and want.sum() > rollouts_left:
        want = np.minimum(want, _largest_remainder(want.astype(float), rollouts_left))
    tokens_left = budget.step_tokens_left()
    if tokens_left is not None and len(ids):
        length = expected_lengths(ids, budget, store)
        if (want * length).sum() > tokens_left:
            scaled = _largest_remainder(want * length, int(tokens_left)) / length
            want = np.minimum(want, np.floor(scaled).astype(np.int64))
    return {q: int(n) for q, n in zip(ids, want, strict=True) if n > 0}


def expected_lengths(ids: list[PromptId], budget: Budget, store: DifficultyStore | None = None) -> np.ndarray:
    """Tokens per rollout expected of each prompt: its mean completion length in the store, or
    `budget.expected_length` for prompts never seen."""
    length = np.full(len(ids), float(budget.expected_length))
    if store is not None and len(ids):
        known = store.mean_length[[store.index[q] for q in ids]]
        length = np.where(np.isnan(known), length, np.maximum(known, 1.0))
    return length


def plan_spares(allocator: RolloutAllocator, spares: list[Problem], requests: list[Request], store: DifficultyStore,
                budget: Budget) -> dict[PromptId, int]:
    """Counts for over-provisioned spare prompts, started beside `requests` (not generated yet).

    Each spare gets what the allocator would plan for it, asked of a copy (the step's own
    allocation state is untouched), within what the budget leaves once `requests` are reserved:
    their rollouts, and their tokens at the prompts' expected lengths.
    """
    if not spares:
        return {}
    lengths = expected_lengths([r.prompt_id for r in requests], budget, store)
    left = budget.reserve(sum(r.n for r in requests), float(np.dot([r.n for r in requests], lengths)))
    return copy.deepcopy(allocator).plan(spares, store, left)


def subset(group: Group, keep: list[int]) -> Group:
    """The group restricted to rollouts `keep` (rewards and correctness follow)."""
    return Group(group.problem, group.prompt_ids, [group.rollouts[i] for i in keep],
                 rewards=None if group.rewards is None else group.rewards[keep],
                 reward_names=group.reward_names,
                 correct=None if group.correct is None else group.correct[keep], group_id=group.group_id)


def accuracy(group: Group) -> float:
    return float(np.mean(group.correct)) if group.size else 0.0


class OneRound:
    """Mixin for allocators whose step is one plan: the selector offers the k prompts asked for, `more` asks
    for no further round and `finish` trains every group; an allocator overrides what it does otherwise."""

    def candidates(self, k: int) -> int:
        return k

    def more(self, groups: list[Group], store: DifficultyStore, budget: Budget) -> dict[PromptId, int]:
        return {}

    def finish(self, groups: list[Group]) -> list[Group]:
        return groups


class Stateless(OneRound):
    """Mixin for allocators that keep nothing across steps (the registry gives every component the
    no-op `metrics`/`state_dict`/`load_state_dict` it lacks)."""
