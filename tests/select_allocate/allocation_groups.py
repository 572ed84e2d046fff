"""Scored groups and problems for the allocator tests: `group(pid, correct)` is one prompt's rollouts with
0/1 correctness as their one reward column."""

from __future__ import annotations

import numpy as np

from adarl.types import Group, Problem, Rollout


def group(pid: str, correct: list[int], length: int = 3) -> Group:
    rollouts = [Rollout(pid, [1] * length, [0.0] * length, "stop", text=f"{pid}{i}") for i in range(len(correct))]
    c = np.array(correct, dtype=float)
    return Group(Problem(pid, "q"), [0], rollouts, rewards=c[:, None], reward_names=("acc",), correct=c)


def problems(*ids: str) -> list[Problem]:
    return [Problem(q, q) for q in ids]
