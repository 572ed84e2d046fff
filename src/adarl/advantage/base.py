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


def equal_groups(rewards: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Per rollout: does its group have all rewards exactly equal (`Group.zero_variance`)?

    Estimators use it to give such groups advantage exactly 0.0: a float mean of equal values
    (0.1 + 0.1 + 0.1)/3 is not exactly 0.1, and the residue would train a group that the metrics
    count as zero-variance and the trainer would otherwise skip.
    """
    if rewards.size == 0:
        return np.zeros(0, dtype=bool)
    starts = group_segments(sizes)
    return np.repeat(np.maximum.reduceat(rewards, starts) == np.minimum.reduceat(rewards, starts), sizes)
