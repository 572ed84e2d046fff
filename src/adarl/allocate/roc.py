"""GRPO-RoC: Resample-on-Correct (rStar2-Agent, §2.6).

Over-sample 2G rollouts per prompt, then down-sample each group to G: keep every kind of
failure in proportion, but only the cleanest successes (success = correct, the outcome reward).
    penalty_i = p_err(i)·[error_ratio] + p_fmt(i)·[answer_format]
      p_err: share of tool responses reporting an error (0.5 with no tool call: every single-turn rollout)
      p_fmt: 1 if an <answer> tag is missing, the tags do not pair into closed blocks, or there is no
             model turn; else min((#closed <answer> blocks − 1)/#model turns, 1)
    n_neg = round(|neg|·G/|group|), n_pos = G − n_neg, each at least its minimum where available
    deterministic (the released code, default): the n_pos positives and the n_neg negatives with the
    smallest penalty (a stable sort: ties keep their order); stochastic (the paper): positives drawn
    with probability ∝ 1/(penalty + ε), negatives a uniform draw.
p_fmt reads `rollout.text`: the whole completion of a single-turn rollout, the last turn of an agent
rollout (the agent loop keeps no other text), so answer blocks repeated in earlier tool turns go unseen.
`reject_equal_reward` also drops groups whose rewards are all equal (DAPO-style).
"""

from __future__ import annotations

import re
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


ANSWER_BLOCK = re.compile(r"<answer>.*?</answer>", re.DOTALL)


def model_turns(rollout: Rollout) -> int:
    """The rollout's model turns: runs of model spans between tool, hint or template spans."""
    roles = [s.role for s in rollout.spans]
    return sum(r == "model" and (i == 0 or roles[i - 1] != "model") for i, r in enumerate(roles))


def answer_format_penalty(rollout: Rollout) -> float:
    """p_fmt: 1 for missing or unpaired answer tags (or no model turn), else the share of extra answers."""
    text = rollout.text
    closed = len(ANSWER_BLOCK.findall(text))
    if closed == 0 or text.count("<answer>") != closed or text.count("</answer>") != closed:
        return 1.0
    turns = model_turns(rollout)
    return min((closed - 1) / turns, 1.0) if turns else 1.0


def penalties(group: Group, error_ratio: bool = True, answer_format: bool = True) -> np.ndarray:
    out = np.zeros(group.size)
    if error_ratio:
        out += [tool_error_rate(r) for r in group.rollouts]
    if answer_format:
        out += [answer_format_penalty(r) for r in group.rollouts]
    return out


@register("allocate", "roc")
@dataclass(config=STRICT)
class Roc(Stateless):
    n: int = Field(8, gt=0)  # G: the group size kept; 2G are sampled
    oversample: float = Field(2.0, ge=1.0)
    min_negative: int = Field(2, ge=0)
    min_positive: int = Field(2, ge=0)
    reject_equal_reward: bool = True
    error_ratio: bool = True  # rStar2's roc_error_ratio: add p_err to the penalty
    answer_format: bool = True  # rStar2's roc_answer_format: add p_fmt to the penalty
    sampling: Literal["deterministic", "stochastic"] = "deterministic"
    seed: int = 0  # the stochastic draw's; unset in a recipe: the run's seed (registry.build)

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.seed)

    def plan(self, problems: list[Problem], store: DifficultyStore, budget: Budget) -> dict[PromptId, int]:
        return fit({p.id: int(round(self.n * self.oversample)) for p in problems}, budget, store)

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
        penalty = penalties(group, self.error_ratio, self.answer_format)
        if self.sampling == "deterministic":
            keep_pos = pos[np.argsort(penalty[pos], kind="stable")[:n_pos]]
            keep_neg = neg[np.argsort(penalty[neg], kind="stable")[:n_neg]]
        else:
            w = 1.0 / (penalty[pos] + 1e-3)
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
