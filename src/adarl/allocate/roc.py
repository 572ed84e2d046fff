"""GRPO-RoC: Resample-on-Correct (rStar2-Agent, §2.6).

Over-sample 2G rollouts per prompt, then down-sample each group to G: keep every kind of
failure in proportion, but only the cleanest successes (success = correct, the outcome reward).
    penalty_i = p_err(i) + p_fmt(i)
      p_err: share of tool responses reporting an error (0.5 with no tool call: every single-turn rollout)
      p_fmt: 1 − the rollout's format reward when the recipe has one (0 otherwise)
    n_neg = round(|neg|·G/|group|), n_pos = G − n_neg, each at least its minimum where available
    positives: the n_pos with the smallest penalty (deterministic, as the code) or drawn with
    probability ∝ 1/(penalty + ε) (stochastic, as the paper); negatives: the first n_neg
    (deterministic) or a uniform draw (stochastic).
`reject_equal_reward` also drops groups whose rewards are all equal (DAPO-style).
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import Field
from pydantic.dataclasses import dataclass

from adarl.allocate.base import Stateless, fit, subset
from adarl.budget import Budget
from adarl.registry import STRICT, register
from adarl.select.store import DifficultyStore
from adarl.types import Group, Problem, PromptId, Rollout


def tool_error_rate(rollout: Rollout) -> float:
    """p_err: the share of the rollout's tool responses that report an error; 0.5 with no tool call."""
    tools = [s for s in rollout.spans if s.role == "tool"]
    return sum(s.status != "ok" for s in tools) / len(tools) if tools else 0.5


def penalties(group: Group) -> np.ndarray:
    p_err = np.array([tool_error_rate(r) for r in group.rollouts])
    if "format" in group.reward_names and group.rewards is not None:
        fmt = group.rewards[:, group.reward_names.index("format")]
        return p_err + (fmt <= 0).astype(float)
    return p_err


@register("allocate", "roc")
@dataclass(config=STRICT)
class Roc(Stateless):
    n: int = Field(8, gt=0)  # G: the group size kept; 2G are sampled
    oversample: float = Field(2.0, ge=1.0)
    min_negative: int = Field(2, ge=0)
    min_positive: int = Field(2, ge=0)
    reject_equal_reward: bool = True
    sampling: Literal["deterministic", "stochastic"] = "deterministic"
    seed: int = 0

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.seed)

    def plan(self, problems: list[Problem], store: DifficultyStore, budget: Budget) -> dict[PromptId, int]:
        return fit({p.id: int(round(self.n * self.oversample)) for p in problems}, budget, store)

    def more(self, groups: list[Group], store: DifficultyStore, budget: Budget) -> dict[PromptId, int]:
        return {}

    def down_sample(self, group: Group) -> Group:
        if group.size <= self.n:
            return group
        # successes by outcome (the correctness column), as rStar2 splits them: a wrong answer with a
        # format reward is a failure; without a correctness column, a positive summed reward
        success = group.correct > 0.5 if group.correct is not None else group.reward > 0
        pos, neg = np.flatnonzero(success), np.flatnonzero(~success)
        n_neg = int(round(len(neg) * self.n / group.size))
        n_neg = max(n_neg, min(self.min_negative, len(neg)))
        n_pos = self.n - n_neg
        if n_pos < min(self.min_positive, len(pos)):
            n_pos = min(self.min_positive, len(pos))
            n_neg = self.n - n_pos
        n_pos, n_neg = min(n_pos, len(pos)), min(n_neg, len(neg))
        pen = penalties(group)[pos]
        if self.sampling == "deterministic":
            keep_pos = pos[np.argsort(pen, kind="stable")[:n_pos]]
            keep_neg = neg[:n_neg]
        else:
            w = 1.0 / (pen + 1e-3)
            keep_pos = self.rng.choice(pos, size=n_pos, replace=False, p=w / w.sum()) if n_pos else pos[:0]
            keep_neg = self.rng.choice(neg, size=n_neg, replace=False) if n_neg else neg[:0]
        return subset(group, sorted(np.concatenate([keep_pos, keep_neg]).tolist()))

    def finish(self, groups: list[Group]) -> list[Group]:
        out = [self.down_sample(g) for g in groups]
        return [g for g in out if not (self.reject_equal_reward and g.zero_variance)]

    def state_dict(self) -> dict:
        return {"rng": self.rng.bit_generator.state}

    def load_state_dict(self, state: dict) -> None:
        self.rng.bit_generator.state = state["rng"]
