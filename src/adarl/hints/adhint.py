"""ADHint: a hint length from the prompt's difficulty, hinted and plain sub-groups, and hinted
successes counted for less (algorithms.md §5.3, from the abstract).

(a) For a group where every rollout failed, the hint ratio is λ_q = λ_max·(1 − d_q), with d_q the
prompt's running (EMA) accuracy of unhinted rollouts in the difficulty store (0 if unknown):
the harder the prompt, the longer the hint (λ_max = 0.8). (b) As many hinted rollouts as the group
has are sampled with the first λ_q of a worked solution as the beginning of their answer (a `hint`
span) and join the group: one plain and one hinted sub-group. (c) Their advantages are computed by
the `adhint` advantage estimator (advantage/adhint.py): each sub-group against its own mean, the
hinted one scaled by (1 − acc_hint + acc_plain). (d), the modulation of hint tokens when they are
trained, does not arise: adarl never trains hint tokens.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic.dataclasses import dataclass

from adarl.hints.base import HintPlan, all_failed, prefix_of
from adarl.registry import STRICT, register
from adarl.types import Group


@register("hints", "adhint")
@dataclass(config=STRICT)
class AdHint:
    source: Literal["solution", "hint", "answer"] = "solution"
    max_ratio: float = Field(0.8, gt=0.0, le=1.0)  # λ_max

    rounds = 1

    def __post_init__(self) -> None:
        self.accuracy: dict[str, float] = {}  # d_q, read from the store by the trainer before planning

    def plan(self, groups: list[Group], round_: int) -> list[HintPlan]:
        out = []
        for g in groups:
            text = g.problem.info(self.source)
            if all_failed(g) and text is not None:
                lam = self.max_ratio * (1.0 - self.accuracy.get(g.problem.id, 0.0))
                out.append(HintPlan(g.problem, g.size, prefix_of(text, lam), "prefix", replace=False, ratio=lam))
        return out

    def observe(self, plans: list[HintPlan], groups: list[Group]) -> None:
        pass
