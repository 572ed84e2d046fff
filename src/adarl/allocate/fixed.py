"""Fixed n: every selected prompt gets the same number of rollouts (plain GRPO)."""

from __future__ import annotations

from typing import Any

from pydantic import Field
from pydantic.dataclasses import dataclass

from adarl.budget import Budget
from adarl.registry import STRICT, register
from adarl.types import Group, Problem, PromptId


@register("allocate", "fixed")
@dataclass(config=STRICT)
class Fixed:
    n: int = Field(8, gt=0)

    def plan(self, problems: list[Problem], store: Any, budget: Budget) -> dict[PromptId, int]:
        return {p.id: self.n for p in problems}

    def more(self, groups: list[Group], store: Any, budget: Budget) -> dict[PromptId, int]:
        return {}

    def finish(self, groups: list[Group]) -> list[Group]:
        return groups
