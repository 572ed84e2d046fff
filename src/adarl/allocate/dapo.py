"""DAPO dynamic sampling (§1.3): over-sample, drop groups with no signal, refill up to a cap.

A group is informative when its `metric` varies within the group (verl: std(metric) > 0):
    metric = "acc"     the correctness column `Group.correct` (p̂ ∉ {0, 1}); the paper's and
                       verl's recipe setting `metric=acc`, so a format or length reward that
                       differs inside an all-correct group does not keep it
    metric = "reward"  the summed reward each rollout trains on (verl's `metric=score`)
Stage 1 rolls out the first k prompts n times each. While fewer than k groups are informative
and fewer than `max_batches` batches were drawn, the next k candidate prompts are rolled out
(verl draws whole batches). `finish` keeps the informative groups, the first k (the surplus of
the last batch is trimmed). `max_batches: 0` is verl's "unlimited" (`max_num_gen_batches: 0`),
bounded here by MAX_BATCHES_UNLIMITED = 64 batches, because the selector must be asked for
its candidates up front and a task with no informative prompt would otherwise never stop.
One-rollout groups are dropped (p̂ ∈ {0, 1}); verl keeps them, though they carry no advantage.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
from pydantic import Field
from pydantic.dataclasses import dataclass

from adarl.allocate.base import Stateless, fit
from adarl.budget import Budget
from adarl.registry import STRICT, register
from adarl.select.store import DifficultyStore
from adarl.types import Group, Problem, PromptId

MAX_BATCHES_UNLIMITED = 64  # the batches drawn per step when max_batches = 0 ("unlimited")


@register("allocate", "dapo")
@dataclass(config=STRICT)
class Dapo(Stateless):
    n: int = Field(8, gt=0)
    max_batches: int = Field(3, ge=0)  # prompt batches drawn per step; 0 = MAX_BATCHES_UNLIMITED (HAPO uses 16)
    metric: Literal["acc", "reward"] = "acc"

    @property
    def batch_cap(self) -> int:
        return self.max_batches or MAX_BATCHES_UNLIMITED

    def informative(self, group: Group) -> bool:
        """Whether the group's `metric` varies across its rollouts (verl: std(metric) > 0)."""
        if self.metric == "reward":
            values = group.reward
        elif group.correct is None:
            raise ValueError(f"group {group.problem.id} has no correctness column: dapo `metric: acc` needs "
                             "a verifier that judges correctness; use `metric: reward` to filter on the reward")
        else:
            values = group.correct
        return len(values) > 1 and bool(np.any(values != values[0]))

    def candidates(self, k: int) -> int:
        self._k = k
        return k * self.batch_cap

    def plan(self, problems: list[Problem], store: DifficultyStore, budget: Budget) -> dict[PromptId, int]:
        k = getattr(self, "_k", len(problems))
        self._queue, self._batches = list(problems[k:]), 1
        self._stats = {"batches": 1}
        return fit({p.id: self.n for p in problems[:k]}, budget, store)

    def more(self, groups: list[Group], store: DifficultyStore, budget: Budget) -> dict[PromptId, int]:
        k = getattr(self, "_k", len(groups))
        kept = sum(self.informative(g) for g in groups)
        if kept >= k or self._batches >= self.batch_cap or not self._queue:
            return {}
        batch, self._queue = self._queue[:k], self._queue[k:]
        self._batches += 1
        self._stats["batches"] = self._batches
        return fit({p.id: self.n for p in batch}, budget, store)

    def finish(self, groups: list[Group]) -> list[Group]:
        k = getattr(self, "_k", len(groups))
        return [g for g in groups if self.informative(g)][:k]

    def metrics(self) -> dict[str, Any]:
        return dict(getattr(self, "_stats", {}))
