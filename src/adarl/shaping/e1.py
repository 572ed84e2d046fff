"""e1: Adaptive Effort Control (Kleinman, Trager, Achille, Xia, Soatto 2025, "e1: Learning Adaptive
Control of Reasoning Effort", arXiv 2510.27042; the budget row of the seeds).

The model is told an effort r ∈ (0, 1], a share of the tokens it currently spends on the query, and a
correct answer earns its reward only when it stays within that share of the query's current average
length:
    R_AEC(h) = correct(h) · 𝟙[ ℓ(h) / T_avg(x_r) ≤ r ]
ℓ(h) is the rollout's sampled length and T_avg(x_r) the mean sampled length of the rollouts told the
same effort r in its group (the query x_r as sampled now, so the target follows the policy: no
dataset- or phase-specific budget). The effort is stated in the answer's opening sentence
(`rollout.effort_sentences`: the group's n rollouts split into one subgroup per effort, each opened by
"Effort: {r}. ", inserted, never trained; rollout/hbpo.py's `BudgetSentences` does the splitting), and
read back from the text here; a rollout told no effort keeps its correctness.

What the abstract leaves open, and adarl's choice: the effort levels (0.25, 0.5, 0.75, 1.0 _guess,
one subgroup each, rather than a continuous draw), where the effort is stated (the answer's opening,
as HBPO's budget sentence, rather than the user prompt), and T_avg as the same-effort subgroup's mean
in the current group (not a running average over steps).

Shaping only adds columns, so the "e1" column is R_AEC − (sum of the columns already there): the row a
rollout trains on sums to R_AEC, while `Group.correct` and the verifier columns stay.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
from pydantic.dataclasses import dataclass

from adarl.registry import STRICT, register
from adarl.sentences import parse_effort
from adarl.shaping.base import add_column
from adarl.types import Group


def effort_reward(length: np.ndarray, effort: np.ndarray, correct: np.ndarray) -> np.ndarray:
    """R_AEC per rollout of one group; `effort` is NaN where the text states none (R = correct)."""
    length, effort = np.asarray(length, dtype=np.float64), np.asarray(effort, dtype=np.float64)
    within = np.ones(len(length), dtype=bool)
    for r in np.unique(effort[~np.isnan(effort)]):
        told = effort == r
        within[told] = length[told] <= r * length[told].mean()  # ℓ ≤ r·T_avg(x_r)
    return np.where(within, (np.asarray(correct) > 0.5).astype(np.float64), 0.0)


@register("shaping", "e1")
@dataclass(config=STRICT)
class AdaptiveEffort:
    column: ClassVar[str] = "e1"

    def __call__(self, groups: list[Group], max_new_tokens: int) -> None:
        for group in groups:
            if group.correct is None or group.rewards is None:
                raise ValueError(f"group {group.problem.id} must be verified before e1 shaping")
            length = np.array([len(r) for r in group.rollouts], dtype=np.float64)
            effort = np.array([np.nan if (r_ := parse_effort(r.text)) is None else r_ for r in group.rollouts])
            target = effort_reward(length, effort, group.correct)
            add_column(group, self.column, target - group.rewards.sum(axis=1))
