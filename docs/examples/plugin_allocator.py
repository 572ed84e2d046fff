"""A rollout allocator written outside adarl and named by import path in a recipe:

    allocate: {name: "plugin_allocator:SolvedGetFewer", n_unsolved: 8, n_solved: 2}

(with this folder on PYTHONPATH). Prompts the difficulty store estimates as mostly solved
(posterior-mean pass rate ≥ `solved`) get `n_solved` rollouts, the others `n_unsolved`; `fit`
keeps the step within its budget, as every built-in allocator does.
"""

from __future__ import annotations

import numpy as np
from pydantic import Field
from pydantic.dataclasses import dataclass

from adarl.allocate.base import Stateless, fit
from adarl.budget import Budget
from adarl.select.store import DifficultyStore
from adarl.types import Group, Problem, PromptId


@dataclass
class SolvedGetFewer(Stateless):
    n_unsolved: int = Field(8, gt=0)
    n_solved: int = Field(2, gt=0)
    solved: float = Field(0.8, gt=0.0, le=1.0)

    def plan(self, problems: list[Problem], store: DifficultyStore, budget: Budget) -> dict[PromptId, int]:
        p = store.pass_estimate(np.array([store.index[q.id] for q in problems], dtype=np.int64))
        return fit({q.id: self.n_solved if pq >= self.solved else self.n_unsolved
                    for q, pq in zip(problems, p, strict=True)}, budget, store)

    def more(self, groups: list[Group], store: DifficultyStore, budget: Budget) -> dict[PromptId, int]:
        return {}  # one stage

    def finish(self, groups: list[Group]) -> list[Group]:
        return groups
