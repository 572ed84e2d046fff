"""AdvantageEstimator protocol: one advantage per rollout, from a verified batch."""

from __future__ import annotations

from typing import Protocol

import numpy as np

from adarl.types import Batch


class AdvantageEstimator(Protocol):
    def __call__(self, batch: Batch) -> np.ndarray: ...


def group_segments(sizes: np.ndarray) -> np.ndarray:
    """Start offsets of each group in the concatenated rollout order (for np.add.reduceat)."""
    return np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
