"""RolloutAllocator protocol: how many rollouts each selected prompt gets.

Allocation may run in stages within one step: `plan` gives the first counts, `more` looks at
the verified groups and asks for extra rollouts (an empty dict ends the step), and `finish`
filters or down-samples the final groups. Every allocator spends only what `budget` allows.
"""

from __future__ import annotations

from typing import Any, Protocol

from adarl.budget import Budget
from adarl.types import Group, Problem, PromptId


class RolloutAllocator(Protocol):
    def plan(self, problems: list[Problem], store: Any, budget: Budget) -> dict[PromptId, int]: ...

    def more(self, groups: list[Group], store: Any, budget: Budget) -> dict[PromptId, int]: ...

    def finish(self, groups: list[Group]) -> list[Group]: ...
