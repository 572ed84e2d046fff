"""Guide (adaptive guidance; Nath et al. 2025, "Adaptive Guidance Accelerates Reinforcement Learning
of Reasoning Models"; algorithms.md §5.1, from the paper, no code found).

When all G rollouts of a prompt fail and it has a hint h, G new rollouts are sampled from
π_old(· | q, h) with the hint in context, and they replace the failed ones (adarl's default; the
paper also augments). They are trained as if the hint were absent: the update's context is q alone
and the ratio's denominator is the hinted behaviour log-prob,

    ρ_{i,t} = π_θ(o_{i,t} | q, o_{i,<t}) / π_old(o_{i,t} | q, h, o_{i,<t})

(`Rollout.guided`; train/learner.py), with the usual clip. The hint itself is never trained.
"""

from __future__ import annotations

from typing import Literal

from pydantic.dataclasses import dataclass

from adarl.hints.base import HintPlan, all_failed
from adarl.registry import STRICT, register
from adarl.types import Group


@register("hints", "guide")
@dataclass(config=STRICT)
class Guide:
    source: Literal["solution", "hint", "answer"] = "solution"
    replace: bool = True  # False: the guided rollouts join the failed ones

    rounds = 1

    def plan(self, groups: list[Group], round_: int) -> list[HintPlan]:
        return [HintPlan(g.problem, g.size, text, "context", self.replace) for g in groups
                if all_failed(g) and (text := g.problem.info(self.source)) is not None]

    def observe(self, plans: list[HintPlan], groups: list[Group]) -> None:
        pass
