"""TokenWeighting: which tokens of a verified, estimated batch train, and with what weight.

A token weighting gets the batch (with `batch.advantages` set and the generator's per-token
`Rollout.entropies`) and one weight array per rollout (one float per completion token, all 1
before the first weighting), and returns new arrays. The loss sees A_{i,t} = A_i · w_{i,t}:

- w = 0 drops the token: it leaves the loss *and* the normalisation count of `agg`;
- w > 0 scales its advantage (HAPO/AEPO-style re-weighting).

A rollout whose weights are all 0 leaves the mini-batch entirely (D^3S sample selection).
Weightings run in recipe order, each on the previous one's output. `progress` is the fraction
of the run done (by steps or tokens, whichever budget ends it), for schedules.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from adarl.types import Batch


class TokenWeighting(Protocol):
    def __call__(self, batch: Batch, weights: list[np.ndarray], progress: float) -> list[np.ndarray]: ...


def batch_entropies(batch: Batch) -> list[np.ndarray]:
    """Per-token entropies of every rollout, as recorded by the generator."""
    missing = [r.prompt_id for r in batch.rollouts if r.entropies is None]
    if missing:
        raise ValueError(f"rollouts of prompt {missing[0]!r} carry no entropies; this generator does not record them")
    return [np.asarray(r.entropies, dtype=np.float64) for r in batch.rollouts]
