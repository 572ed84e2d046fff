"""One step's metrics row, built over the step's stages with the rule of each key said where it is recorded.

A step may generate and verify in several stages (DARS, DAPO refills). Counts and times add up
(`add`); averages over rollouts are averages over every stage, weighted by how many rollouts each
stage scored (`mean`); a description of the latest state replaces the previous one (`set`,
plain item assignment).

`RunTotals` adds the step's token counts over the run (checkpointed with the trainer), for the
cumulative fractions a run is judged by: the useful-token fraction (tokens that train with a
non-zero advantage over tokens sampled) and the tokens wasted on zero-variance groups.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from adarl.types import Batch, Group

# wall-clock keys of a metrics row: the only ones that differ between two identical runs
TIMING_KEYS = ("generate_s", "verify_s", "train_s", "weight_sync_s", "eval_s", "step_s", "tokens_per_s", "wall_s",
               "cluster/broadcast_s")


class StepMetrics(dict[str, Any]):
    def __init__(self) -> None:
        super().__init__()
        self._weights: dict[str, float] = {}

    def add(self, key: str, value: float) -> None:
        """A count or a duration: summed over the step."""
        self[key] = self.get(key, 0.0) + value

    def merge(self, prefix: str, values: dict[str, Any], summed: frozenset[str]) -> None:
        """A stage's metrics under `prefix`: the keys in `summed` are counts (added up), the others
        describe the latest state (replaced)."""
        for key, value in values.items():
            if key in summed:
                self.add(prefix + key, value)
            else:
                self[prefix + key] = value

    def mean(self, key: str, value: float, weight: float) -> None:
        """An average over `weight` items: the step's value is the weighted average of every stage's."""
        if weight <= 0:
            self.setdefault(key, value)
            return
        w = self._weights.get(key, 0.0)
        self[key] = (self.get(key, 0.0) * w + value * weight) / (w + weight)
        self._weights[key] = w + weight


def batch_metrics(generated: list[Group], batch: Batch) -> dict[str, Any]:
    """Statistics of everything generated this step, and of what survived to the loss (lengths
    count sampled tokens)."""
    if not generated:  # the allocator had no budget left to spend
        return {"groups": 0, "trained_groups": 0}
    rollouts = [r for g in generated for r in g.rollouts]
    sizes = np.array([g.size for g in generated])
    return {
        # sampled tokens of groups whose rewards are all equal: no GRPO signal, wasted
        "tokens/zero_variance": sum(len(r) for g in generated if g.zero_variance for r in g.rollouts),
        "reward": float(np.concatenate([g.reward for g in generated]).mean()),
        "pass_rate": float(np.concatenate([g.correct for g in generated]).mean()),
        "zero_variance_fraction": float(np.mean([g.zero_variance for g in generated])),
        "groups": len(generated),
        "trained_groups": len(batch.groups),
        "response_length": float(np.mean([len(r) for r in rollouts])),
        "truncated_fraction": float(np.mean([r.finish_reason == "length" for r in rollouts])),
        "rollouts_per_prompt_mean": float(sizes.mean()),
        "rollouts_per_prompt_min": int(sizes.min()),
        "rollouts_per_prompt_max": int(sizes.max()),
        "rollouts_per_prompt_hist": {str(n): int(c) for n, c in zip(*np.unique(sizes, return_counts=True),
                                                                     strict=True)},
    }


class RunTotals:
    """Token counts of every step so far, and the cumulative fractions they give.

    Per step the trainer records ``tokens/sampled`` (tokens of the step's groups), ``tokens/useful``
    (those that train with a non-zero advantage) and ``tokens/zero_variance`` (those of groups with
    equal rewards); `update` adds them up and returns the run's totals and fractions so far.
    """

    SUMMED = ("tokens/sampled", "tokens/useful", "tokens/zero_variance")

    def __init__(self) -> None:
        self.sums = dict.fromkeys(self.SUMMED, 0.0)

    def update(self, step: dict[str, Any]) -> dict[str, float]:
        for key in self.SUMMED:
            self.sums[key] += float(step.get(key, 0.0))
        sampled = self.sums["tokens/sampled"]
        return {"tokens/useful_cumulative": self.sums["tokens/useful"],
                "tokens/zero_variance_cumulative": self.sums["tokens/zero_variance"],
                "effective_token_fraction_cumulative": self.sums["tokens/useful"] / sampled if sampled else 0.0,
                "zero_variance_token_fraction_cumulative":
                    self.sums["tokens/zero_variance"] / sampled if sampled else 0.0}

    def state_dict(self) -> dict[str, float]:
        return dict(self.sums)

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.sums = {key: float(state.get(key, 0.0)) for key in self.SUMMED}
