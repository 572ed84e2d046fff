"""GRESO: skip, before rollout, the prompts whose history predicts an all-equal group (algorithms.md §2.10;
Infini-AI-Lab/GRESO `presampling_selector.py::DataProfiler`, strategy `all_probabilistic`).

Prompts come in uniform epochs (select/uniform.py); each one's history is the mean correctness of every
group it was rolled out in, one entry per visit. Before rollout a candidate is
    easy streak k_e = trailing entries ≥ 0.98 (all correct);  hard streak k_h = trailing entries ≤ 0.11
    k_e > 0: skipped with probability 1 − max(p_easy^k_e, ε);  k_h > 0: 1 − max(p_hard^k_h, ε)
    no history, or a mixed latest entry: kept        (ε = `exploration` = 0.01: some always survive)
Once per step, after generation, from the second epoch on (the code's epoch ≥ 1, 0-based):
    r_easy, r_hard = the fractions of this step's groups that are all correct / all wrong
    p_easy ← clip(p_easy − Δ, p_min, p_max) if r_easy ≥ z/3 else clip(p_easy + Δ, …)      (skip more / less)
    p_hard ← clip(p_hard − Δ, p_min, p_max) if r_hard ≥ 2z/3 else clip(p_hard + Δ, …)
with z = `target_zero_variance` = 0.25 and Δ = 0.01. The code fills its batch by DAPO-style dynamic
sampling: pair with `allocate: dapo`, which asks this selector for its candidates. adarl reads the 0/1
correctness column where the code reads the mean reward (1 correct, 0.1 well-formatted but wrong), so the
thresholds 0.98 and 0.11 mean all correct and all wrong for groups of up to 9 rollouts, and a group with
format errors counts as hard here (the code counts it as neither when adapting).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from pydantic import Field
from pydantic.dataclasses import dataclass

from adarl.registry import STRICT, register
from adarl.select.store import DifficultyStore
from adarl.select.uniform import Uniform
from adarl.types import Group


def keep_probability(easy_streak: int, hard_streak: int, p_easy: float, p_hard: float, exploration: float) -> float:
    """The chance a candidate is rolled out: max(p^k, ε) for its streak, 1 without one."""
    if easy_streak > 0:
        return max(p_easy**easy_streak, exploration)
    if hard_streak > 0:
        return max(p_hard**hard_streak, exploration)
    return 1.0


@register("select", "greso")
@dataclass(config=STRICT)
class Greso(Uniform):
    p_easy: float = Field(0.5, gt=0.0, lt=1.0)  # initial base keep probability of an all-correct streak
    p_hard: float = Field(0.5, gt=0.0, lt=1.0)  # … of an all-wrong streak
    target_zero_variance: float = Field(0.25, ge=0.0, le=1.0)  # z
    step_size: float = Field(0.01, ge=0.0, le=1.0)  # Δ
    min_p: float = Field(0.05, gt=0.0, le=1.0)
    max_p: float = Field(0.95, gt=0.0, le=1.0)
    exploration: float = Field(0.01, gt=0.0, le=1.0)  # ε: the least keep probability
    easy_threshold: float = Field(0.98, ge=0.0, le=1.0)
    hard_threshold: float = Field(0.11, ge=0.0, le=1.0)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.probability = {"easy": self.p_easy, "hard": self.p_hard}
        self.easy_streak = np.zeros(0, dtype=np.int64)
        self.hard_streak = np.zeros(0, dtype=np.int64)
        self._stats: dict[str, float] = {}
        self._ratios: dict[str, float] = {}  # of the step observed last

    def _sized(self, store: DifficultyStore) -> None:
        if len(self.easy_streak) != len(store):
            self.easy_streak = np.zeros(len(store), dtype=np.int64)
            self.hard_streak = np.zeros(len(store), dtype=np.int64)

    def select(self, store: DifficultyStore, k: int, rng: np.random.Generator) -> list[int]:
        self._sized(store)
        chosen: list[int] = []
        skipped = 0
        while len(chosen) < k:
            (i,) = super().select(store, 1, rng)
            keep = keep_probability(int(self.easy_streak[i]), int(self.hard_streak[i]), self.probability["easy"],
                                    self.probability["hard"], self.exploration)
            if keep >= 1.0 or rng.random() < keep:
                chosen.append(i)
            else:
                skipped += 1
        self._stats = {"p_easy": self.probability["easy"], "p_hard": self.probability["hard"],
                       "skipped": float(skipped)}
        return chosen

    def observe(self, store: DifficultyStore, groups: list[Group]) -> None:
        self._sized(store)
        easy = hard = 0
        for g in groups:
            if not g.size:
                continue
            i, mean = store.index[g.problem.id], float(np.mean(g.correct))
            self.easy_streak[i] = self.easy_streak[i] + 1 if mean >= self.easy_threshold else 0
            self.hard_streak[i] = self.hard_streak[i] + 1 if mean <= self.hard_threshold else 0
            easy += mean >= self.easy_threshold
            hard += mean <= self.hard_threshold
        if not groups or self.epoch < 2:  # the code adapts from its epoch 1 (0-based) on
            return
        rates = {"easy": easy / len(groups), "hard": hard / len(groups)}
        targets = {"easy": self.target_zero_variance / 3, "hard": 2 * self.target_zero_variance / 3}
        for side in ("easy", "hard"):
            move = -self.step_size if rates[side] >= targets[side] else self.step_size
            self.probability[side] = float(np.clip(self.probability[side] + move, self.min_p, self.max_p))
        self._ratios = {"too_easy_ratio": rates["easy"], "too_hard_ratio": rates["hard"]}

    def metrics(self) -> dict[str, Any]:
        return {**self._stats, **self._ratios}

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "probability": dict(self.probability), "ratios": dict(self._ratios),
                "easy_streak": self.easy_streak.tolist(), "hard_streak": self.hard_streak.tolist()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.probability = dict(state["probability"])
        self._ratios = dict(state["ratios"])
        self.easy_streak = np.array(state["easy_streak"], dtype=np.int64)
        self.hard_streak = np.array(state["hard_streak"], dtype=np.int64)
