"""One step's metrics row, built over the step's stages with the rule of each key said where it is recorded.

A step may generate and verify in several stages (DARS, DAPO refills). Counts and times add up
(`add`); averages over rollouts are averages over every stage, weighted by how many rollouts each
stage scored (`mean`); a description of the latest state replaces the previous one (`set`,
plain item assignment).
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
