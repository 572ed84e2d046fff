"""One step's metrics row, built over the step's stages with the rule of each key said where it is recorded.

A step may generate and verify in several stages (DARS, DAPO refills). Counts and times add up
(`add`); averages over rollouts are averages over every stage, weighted by how many rollouts each
stage scored (`mean`); a description of the latest state replaces the previous one (`set`,
plain item assignment).
"""

from __future__ import annotations

from typing import Any


class StepMetrics(dict[str, Any]):
    def __init__(self) -> None:
        super().__init__()
        self._weights: dict[str, float] = {}

    def add(self, key: str, value: float) -> None:
        """A count or a duration: summed over the step."""
        self[key] = self.get(key, 0.0) + value

    def mean(self, key: str, value: float, weight: float) -> None:
        """An average over `weight` items: the step's value is the weighted average of every stage's."""
        if weight <= 0:
            self.setdefault(key, value)
            return
        w = self._weights.get(key, 0.0)
        self[key] = (self.get(key, 0.0) * w + value * weight) / (w + weight)
        self._weights[key] = w + weight
