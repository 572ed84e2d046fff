"""Reinforce-Ada: sample in rounds until a prompt's signal is collected, then train a fixed, balanced group
(algorithms.md §2.9; RLHFlow/Reinforce-Ada `ray_trainer.py::_generate_multi_round_adaptive_downsampling`,
the released code this module follows).

K = `n` (the trained group), M = `round_n`, R = `max_rounds`, τ = `threshold`. A rollout is positive when
its reward r > τ, else negative; pos and neg are counted over all of a prompt's rounds.
    round r = 1..R: M rollouts for every active prompt; after verifying, a prompt leaves once
        balanced:          |pos| ≥ ⌊K/2⌋ and |neg| ≥ K − ⌊K/2⌋
        positive_focused:  |pos| ≥ 1
    finish: a prompt that left trains the first ⌊K/2⌋ positives and the first negatives to K (a short side
        is topped up from the other); one still active after R rounds trains min(K, |pos| + |neg|):
        balanced by the same split, positive_focused with #pos = clip(⌈P/(P+N)·K⌉, 1, take − 1)
        (an all-negative prompt then trains K negatives: a zero-advantage group).
Kept rollouts are the first ones sampled, not a random draw (as in the code). A prompt costs at most R·M
rollouts. Spare prompts of over-provisioning, and groups admitted from earlier steps, join the rounds as
prompts of round 1 (the code has neither).
`global_stats` (the code's `global_stat_est`: off in its class, on in its script) gives each kept group the
mean and std of all its P + N samples as P ones and N zeros, which `advantage: grpo` / `drgrpo` use in place
of the kept group's own:  mean = P/(P + N),  std = sqrt(P·N / ((P + N)(P + N − 1)))  (one sample: 0 and 1).
Like the code it assumes 0/1 rewards for the baseline while A_i uses the real r_i.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import numpy as np
from pydantic import Field
from pydantic.dataclasses import dataclass

from adarl.allocate.base import Stateless, fit, subset
from adarl.budget import Budget
from adarl.registry import STRICT, register
from adarl.select.store import DifficultyStore
from adarl.types import Group, Problem, PromptId


def split(positives: list[int], negatives: list[int], n_positive: int, take: int) -> list[int]:
    """The first `n_positive` positives and the first negatives up to `take`, a short side topped up
    from the other; indices in sampling order."""
    n_pos = min(n_positive, len(positives))
    n_neg = min(take - n_pos, len(negatives))
    n_pos = min(take - n_neg, len(positives))
    return sorted(positives[:n_pos] + negatives[:n_neg])


def global_baseline(positives: int, negatives: int) -> tuple[float, float]:
    """Mean and unbiased std of `positives` ones and `negatives` zeros (0 and 1 for one sample or none)."""
    total = positives + negatives
    if total <= 1:
        return 0.0, 1.0
    return positives / total, math.sqrt(positives * negatives / (total * (total - 1)))


@register("allocate", "reinforce_ada")
@dataclass(config=STRICT)
class ReinforceAda(Stateless):
    n: int = Field(4, gt=0)  # K: rollout.n, the trained group (the script's 4)
    round_n: int = Field(8, gt=0)  # M: round_repeat
    max_rounds: int = Field(4, gt=0)  # R
    threshold: float = 0.7  # τ: positive_threshold
    choice: Literal["balanced", "positive_focused"] = "balanced"  # reinforce_ada_choice
    global_stats: bool = False  # global_stat_est: the advantage's baseline from all of a prompt's samples

    def sides(self, group: Group) -> tuple[list[int], list[int]]:
        positive = group.reward > self.threshold
        return [i for i in range(group.size) if positive[i]], [i for i in range(group.size) if not positive[i]]

    def collected(self, group: Group) -> bool:
        positives, negatives = self.sides(group)
        if self.choice == "positive_focused":
            return len(positives) >= 1
        return len(positives) >= self.n // 2 and len(negatives) >= self.n - self.n // 2

    def plan(self, problems: list[Problem], store: DifficultyStore, budget: Budget) -> dict[PromptId, int]:
        self._round, self._active = 1, [p.id for p in problems]
        self._known = set(self._active)
        granted = fit(dict.fromkeys(self._active, self.round_n), budget, store)
        self._stats: dict[str, float] = {"rounds": 1.0, "total_samples": float(sum(granted.values()))}
        return granted

    def more(self, groups: list[Group], store: DifficultyStore, budget: Budget) -> dict[PromptId, int]:
        by_id = {g.problem.id: g for g in groups}
        # spares (over-provisioning plans them on a copy) and groups admitted from earlier steps join the rounds
        self._active += [q for q in by_id if q not in self._known]
        self._known |= set(by_id)
        self._active = [q for q in self._active if q in by_id and not self.collected(by_id[q])]
        if self._round == 1:
            self._stats["prompts_active_after_1st_round"] = float(len(self._active))
        if not self._active or self._round >= self.max_rounds:
            return {}
        self._round += 1
        self._stats["rounds"] = float(self._round)
        granted = fit(dict.fromkeys(self._active, self.round_n), budget, store)
        self._stats["total_samples"] += sum(granted.values())
        return granted

    def keep(self, group: Group) -> list[int]:
        positives, negatives = self.sides(group)
        if self.collected(group):
            return split(positives, negatives, self.n // 2, self.n)
        take = min(self.n, group.size)
        if self.choice == "balanced":
            return split(positives, negatives, self.n // 2, take)
        share = math.ceil(len(positives) / group.size * self.n)
        return split(positives, negatives, int(np.clip(share, 1, take - 1)), take)

    def finish(self, groups: list[Group]) -> list[Group]:
        kept = [subset(g, self.keep(g)) for g in groups if g.size]
        if self.global_stats:
            for g, k in zip([g for g in groups if g.size], kept, strict=True):
                k.baseline = global_baseline(*map(len, self.sides(g)))
        return kept

    def metrics(self) -> dict[str, Any]:
        return dict(getattr(self, "_stats", {}))
