"""DARS: Difficulty-Adaptive Rollout Sampling (Depth-Breadth Synergy in RLVR, §2.1).

Stage 1 gives every prompt N rollouts; a prompt with accuracy a < 0.5 gets Δn more in stage 2
so that its summed absolute advantage reaches a target:
    a ≤ 1e-6 → a := 0.5/N;  a ≥ 0.5 → Δn = 0
    S(a) = 2·sqrt(a(1−a)), A_peak = N        (use_std)
    S(a) = 2·a(1−a),       A_peak = N/2      (default)
    A_cur = N·S(a)
    equal treatment (ET):      Δn = (A_peak − A_cur)/S(a)
    hardness weighted (HW):    Δn = (2(1−a)·A_peak − A_cur)/S(a)
    Δn = min(ceil(Δn), N_max − N)
N is the size stage 1 actually reached for the prompt (`n` unless the budget trimmed it) and a
the accuracy over those rollouts. `finish` keeps groups with 0 < a < upper (the merged group's accuracy).
Pair with `advantage: drgrpo` (DARS assumes no std division) unless use_std is on.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import Field
from pydantic.dataclasses import dataclass

from adarl.allocate.base import Stateless, accuracy, fit
from adarl.budget import Budget
from adarl.registry import STRICT, register
from adarl.select.store import DifficultyStore
from adarl.types import Group, Problem, PromptId


def extra_rollouts(a: float, n: int, n_max: int, schedule: str, use_std: bool = False) -> int:
    """Δn of DARS for stage-1 accuracy a over n rollouts."""
    if a <= 1e-6:
        a = 0.5 / n
    if a >= 0.5:
        return 0
    if use_std:
        s, peak = 2.0 * math.sqrt(a * (1 - a)), float(n)
    else:
        s, peak = 2.0 * a * (1 - a), 0.5 * n
    current = n * s
    target = peak if schedule == "equal" else 2.0 * (1 - a) * peak
    return max(0, min(math.ceil((target - current) / s - 1e-9), n_max - n))


@register("allocate", "dars")
@dataclass(config=STRICT)
class Dars(Stateless):
    n: int = Field(8, gt=0)
    n_max: int = Field(32, gt=0)
    schedule: Literal["equal", "hardness"] = "hardness"
    use_std: bool = False
    upper: float = Field(1.0, gt=0.0, le=1.0)

    def plan(self, problems: list[Problem], store: DifficultyStore, budget: Budget) -> dict[PromptId, int]:
        self._stage = 1
        self._stats: dict[str, Any] = {}
        return fit({p.id: self.n for p in problems}, budget, store)

    def more(self, groups: list[Group], store: DifficultyStore, budget: Budget) -> dict[PromptId, int]:
        if self._stage != 1:
            return {}
        self._stage = 2
        # N is the group's actual size: the budget may have trimmed stage 1, or partial rollouts cut it
        want = {g.problem.id: extra_rollouts(accuracy(g), g.size, self.n_max, self.schedule, self.use_std)
                for g in groups if g.size > 0}
        granted = fit(want, budget, store)
        self._stats = {"stage2_rollouts": sum(granted.values()),
                       "stage2_prompts": sum(1 for v in granted.values() if v > 0)}
        return granted

    def finish(self, groups: list[Group]) -> list[Group]:
        kept = [g for g in groups if 0.0 < accuracy(g) < self.upper]
        self._stats["kept_fraction"] = len(kept) / max(len(groups), 1)
        return kept

    def metrics(self) -> dict[str, Any]:
        return {k: float(v) for k, v in getattr(self, "_stats", {}).items()}
