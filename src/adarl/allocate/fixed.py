"""Fixed n: every selected prompt gets the same number of rollouts (plain GRPO).

BroRL (§2.5) is this allocator with a very large n (its preset `brorl`: n = 512) and few
prompts per step; generation and the loss stream such groups in bounded chunks
(`rollout.max_batch` rows at a time, `train.micro_batch_tokens` per backward).
"""

from __future__ import annotations

from pydantic import Field
from pydantic.dataclasses import dataclass

from adarl.allocate.base import Stateless, fit
from adarl.budget import Budget
from adarl.registry import STRICT, register
from adarl.select.store import DifficultyStore
from adarl.types import Problem, PromptId


@register("allocate", "fixed")
@dataclass(config=STRICT)
class Fixed(Stateless):
    n: int = Field(8, gt=0)

    def plan(self, problems: list[Problem], store: DifficultyStore, budget: Budget) -> dict[PromptId, int]:
        return fit({p.id: self.n for p in problems}, budget, store)


@register("allocate", "brorl")
@dataclass(config=STRICT)
class BroRL(Fixed):
    n: int = Field(512, gt=0)
