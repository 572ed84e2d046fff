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

from adarl.types import Batch, trainable_masks


class TokenWeighting(Protocol):
    def __call__(self, batch: Batch, weights: list[np.ndarray], progress: float) -> list[np.ndarray]: ...


def batch_entropies(batch: Batch) -> list[np.ndarray]:
    """Per-token entropies of every rollout, as recorded by the generator (0 at tokens not sampled)."""
    missing = [r.prompt_id for r in batch.rollouts if r.entropies is None]
    if missing:
        raise ValueError(f"rollouts of prompt {missing[0]!r} carry no entropies; this generator does not record them")
    return [np.asarray(r.entropies, dtype=np.float64) for r in batch.rollouts]


def weigh_tokens(weightings: list[TokenWeighting], batch: Batch, progress: float) -> tuple[list[np.ndarray], dict]:
    """Per-token weights of the batch's rollouts after the recipe's weightings, in order, starting
    from 1 on each trainable token (sampled by the policy, a shared span once) and 0 elsewhere;
    with the weightings' metrics."""
    weights = trainable_masks(batch.rollouts)
    if not weightings:
        return weights, {}
    trainable = sum(int((w > 0).sum()) for w in weights)
    for weighting in weightings:
        weights = weighting(batch, weights, progress)
    kept = sum(int((w > 0).sum()) for w in weights)
    return weights, {"tokens/kept_fraction": kept / max(trainable, 1),
                     "tokens/kept_rollout_fraction": float(np.mean([bool((w > 0).any()) for w in weights]))}


def effective_tokens(batch: Batch, weights: list[np.ndarray]) -> int:
    """Trained tokens that carry a non-zero advantage (after token weighting)."""
    return int(sum(int((w > 0).sum()) for w, a in zip(weights, batch.advantages, strict=True) if a != 0.0))
