"""The data that flows between stages.

Stages talk only through these types. Nothing here assumes a fixed number of rollouts per
prompt: a `Group` holds however many rollouts its prompt received, and a `Batch` is built
from groups of any sizes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

PromptId = str
FinishReason = Literal["stop", "length", "partial"]


@dataclass(frozen=True)
class Problem:
    """One task item: what to ask, what a verifier needs to check the answer."""

    id: PromptId
    prompt: str | list[dict[str, str]]  # plain text, or chat messages
    answer: str | None = None
    columns: dict[str, Any] = field(default_factory=dict)  # extra dataset fields, passed to rewards

    @property
    def messages(self) -> list[dict[str, str]]:
        """The prompt as chat messages (a plain-text prompt is one user message)."""
        return self.prompt if isinstance(self.prompt, list) else [{"role": "user", "content": self.prompt}]


@dataclass
class Request:
    """Ask a generator for `n` completions of one tokenised prompt."""

    prompt_id: PromptId
    prompt_ids: list[int]
    n: int
    prefix_ids: list[int] | None = None  # continue from this partial completion


@dataclass
class Rollout:
    """One sampled completion with what the trainer needs to correct for its sampler."""

    prompt_id: PromptId
    completion_ids: list[int]
    logprobs: list[float]  # behaviour log-probs, one per completion token
    finish_reason: FinishReason
    text: str = ""
    policy_version: int = 0
    entropies: list[float] | None = None
    token_versions: list[int] | None = None  # the policy version that sampled each completion token

    def __len__(self) -> int:
        return len(self.completion_ids)


@dataclass
class Generated:
    """One group as the scheduler hands it back: a request's finished rollouts, not yet verified."""

    group_id: int  # unique in a run (admission order); never derived from the prompt
    request: Request
    rollouts: list[Rollout]


@dataclass
class StageResult:
    """What one generation stage produced: complete groups, and what it cost the budget."""

    groups: list[Generated]
    tokens_spent: int  # sampled by this call, finished or not (partials carried, rows cut by the budget)
    rollouts_started: int  # rows started by this call (spares included)
    metrics: dict[str, Any] = field(default_factory=dict)

    @property
    def rollouts(self) -> list[Rollout]:
        return [r for g in self.groups for r in g.rollouts]


@dataclass
class Group:
    """One prompt and all of its rollouts; `rewards` is (rollouts x reward names)."""

    problem: Problem
    prompt_ids: list[int]
    rollouts: list[Rollout]
    rewards: np.ndarray | None = None
    reward_names: tuple[str, ...] = ()
    correct: np.ndarray | None = None  # 0/1 per rollout, from the correctness reward
    group_id: int | None = None  # the scheduler's id of the group it was generated as

    @property
    def size(self) -> int:
        return len(self.rollouts)

    @property
    def reward(self) -> np.ndarray:
        """The scalar reward each rollout is trained on: the sum of its named rewards."""
        if self.rewards is None:
            raise ValueError(f"group {self.problem.id} has not been verified")
        return self.rewards.sum(axis=1)

    def extend(self, other: Group) -> None:
        """Append a later stage's verified rollouts of the same prompt."""
        if other.problem.id != self.problem.id:
            raise ValueError(f"cannot merge group {other.problem.id} into {self.problem.id}")
        self.rollouts += other.rollouts
        self.rewards = np.concatenate([self.rewards, other.rewards])
        self.correct = np.concatenate([self.correct, other.correct])

    @property
    def zero_variance(self) -> bool:
        r = self.reward
        return bool(np.all(r == r[0]))


def merge(groups: dict[PromptId, Group], fresh: list[Group]) -> None:
    """Add a stage's verified groups to the step's, by prompt: a top-up joins its prompt's group."""
    for g in fresh:
        if g.problem.id in groups:
            groups[g.problem.id].extend(g)
        else:
            groups[g.problem.id] = g


@dataclass
class Batch:
    """The groups of one step and the per-rollout arrays built from them, in rollout order.

    `group_index[i]` is the index in `groups` of rollout i; rollouts are the concatenation
    of every group's rollouts, whatever their sizes.
    """

    groups: list[Group]
    advantages: np.ndarray | None = None  # one per rollout (sequence-level)

    @property
    def rollouts(self) -> list[Rollout]:
        return [r for g in self.groups for r in g.rollouts]

    @property
    def group_index(self) -> np.ndarray:
        return np.repeat(np.arange(len(self.groups)), [g.size for g in self.groups])

    @property
    def rewards(self) -> np.ndarray:
        return np.concatenate([g.reward for g in self.groups]) if self.groups else np.zeros(0)

    @property
    def group_sizes(self) -> np.ndarray:
        return np.array([g.size for g in self.groups], dtype=np.int64)

    def __len__(self) -> int:
        return int(self.group_sizes.sum()) if self.groups else 0
