"""RewardShaping: adds a named reward column to verified groups, before advantages.

Shaping runs right after the verifiers, on every stage's fresh groups. Each shaping appends
one column to `Group.rewards` (rollouts × reward names) under its own name, so the scalar a
rollout trains on (`Group.reward`, the row sum) includes it, metrics report it as
`reward/<name>`, and multi-reward estimators (RDPO) see it as one more dimension. Shaping
never edits the verifiers' columns, so `Group.correct` keeps the verifier's judgement.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from adarl.types import Group


class RewardShaping(Protocol):
    column: str  # the reward name this shaping adds

    def __call__(self, groups: list[Group], max_new_tokens: int) -> None: ...


def add_column(group: Group, name: str, values: np.ndarray) -> None:
    """Append reward column `name` (one value per rollout) to a verified group."""
    values = np.asarray(values, dtype=np.float64).reshape(group.size, 1)
    if group.rewards is None:
        raise ValueError(f"group {group.problem.id} must be verified before shaping")
    if name in group.reward_names:
        raise ValueError(f"group {group.problem.id} already has a reward column {name!r}")
    group.rewards = np.concatenate([group.rewards, values], axis=1)
    group.reward_names = (*group.reward_names, name)


def apply_shapings(shapings: list[Any], groups: list[Group], max_new_tokens: int, metrics: Any) -> None:
    """The recipe's reward shapings, in order, on freshly verified groups; their means into `metrics`
    (a `StepMetrics`: weighted by the rollouts of each stage)."""
    for shaping in shapings:
        shaping(groups, max_new_tokens)
        column = np.concatenate([g.rewards[:, g.reward_names.index(shaping.column)] for g in groups])
        metrics.mean(f"reward/{shaping.column}", float(column.mean()), len(column))
        metrics.update({f"shaping/{k}": v for k, v in shaping.metrics().items()})
