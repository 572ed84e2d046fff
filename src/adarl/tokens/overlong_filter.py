"""DAPO overlong filtering (algorithms.md §1.3; the DAPO paper's "Overlong Filtering").

A sample cut at the length limit (`finish_reason == "length"`) gets no loss:

    w'_{i,t} = w_{i,t} · 𝟙[o_i was not truncated]

Its reward still enters its group's statistics (the advantage is computed before token weighting);
only its own tokens leave the loss and `agg`'s normalisation count (tokens/base.py). The DAPO paper
uses it as an alternative to the soft overlong punishment (`shaping: [{name: overlong}]`); verl's
DAPO recipe, the released code, ships only the punishment, so the filter is off unless the recipe
names it: `tokens: [{name: overlong_filter}]`.
"""

from __future__ import annotations

import numpy as np
from pydantic.dataclasses import dataclass

from adarl.registry import STRICT, register
from adarl.types import Batch


@register("tokens", "overlong_filter")
@dataclass(config=STRICT)
class OverlongFilter:
    def __call__(self, batch: Batch, weights: list[np.ndarray], progress: float) -> list[np.ndarray]:
        return [np.zeros_like(w) if r.finish_reason == "length" else w
                for r, w in zip(batch.rollouts, weights, strict=True)]
