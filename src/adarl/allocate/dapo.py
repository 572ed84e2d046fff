"""DAPO dynamic sampling (§1.3): over-sample, drop zero-variance groups, refill up to a cap.

Stage 1 rolls out the first k prompts n times each. While fewer than k groups have mixed
rewards (p̂ ∉ {0, 1}) and fewer than `max_batches` batches were drawn, the next k candidate
prompts are rolled out (verl draws whole batches). `finish` keeps the mixed groups, first k.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field
from pydantic.dataclasses import dataclass

from adarl.allocate.base import Stateless, fit
from adarl.budget import Budget
from adarl.registry import STRICT, register
from adarl.select.store import DifficultyStore
from adarl.types import Group, Problem, PromptId


@register("allocate", "dapo")
@dataclass(config=STRICT)
class Dapo(Stateless):
    n: int = Field(8, gt=0)
    max_batches: int = Field(3, gt=0)  # cap on prompt batches drawn per step (HAPO uses 16)

    def candidates(self, k: int) -> int:
        self._k = k
        return k * self.max_batches

    def plan(self, problems: list[Problem], store: DifficultyStore, budget: Budget) -> dict[PromptId, int]:
        k = getattr(self, "_k", len(problems))
        self._queue, self._batches = list(problems[k:]), 1
        self._stats = {"batches": 1}
        return fit({p.id: self.n for p in problems[:k]}, budget, store)

    def more(self, groups: list[Group], store: DifficultyStore, budget: Budget) -> dict[PromptId, int]:
        k = getattr(self, "_k", len(groups))
        mixed = sum(not g.zero_variance for g in groups)
        if mixed >= k or self._batches >= self.max_batches or not self._queue:
            return {}
        batch, self._queue = self._queue[:k], self._queue[k:]
        self._batches += 1
        self._stats["batches"] = self._batches
        return fit({p.id: self.n for p in batch}, budget, store)

    def finish(self, groups: list[Group]) -> list[Group]:
        k = getattr(self, "_k", len(groups))
        return [g for g in groups if not g.zero_variance][:k]

    def metrics(self) -> dict[str, Any]:
        return dict(getattr(self, "_stats", {}))
