"""Frontier curriculum: prefer prompts whose estimated pass rate is inside a target band.

From M·B uniform candidates, take those whose posterior-mean pass rate lies in
[low, high] (random order), then fill up with the candidates closest to the band.
Unseen prompts have estimate 0.5 and so start inside the default band.
"""

from __future__ import annotations

import numpy as np
from pydantic import Field, model_validator
from pydantic.dataclasses import dataclass

from adarl.registry import STRICT, register
from adarl.select.base import Stateless, candidates
from adarl.select.store import DifficultyStore


@register("select", "curriculum")
@dataclass(config=STRICT)
class Curriculum(Stateless):
    low: float = Field(0.2, ge=0.0, le=1.0)
    high: float = Field(0.8, ge=0.0, le=1.0)
    pool: float = Field(4.0, ge=1.0)

    @model_validator(mode="after")
    def _band(self) -> Curriculum:
        if self.low > self.high:
            raise ValueError(f"low ({self.low}) must not exceed high ({self.high})")
        return self

    def select(self, store: DifficultyStore, k: int, rng: np.random.Generator) -> list[int]:
        pool = candidates(store, int(np.ceil(self.pool * k)), rng)
        p = store.pass_estimate(pool)
        distance = np.maximum(self.low - p, 0.0) + np.maximum(p - self.high, 0.0)
        order = np.lexsort((rng.random(len(pool)), distance))  # in-band first, ties random
        return pool[order[:k]].tolist()
