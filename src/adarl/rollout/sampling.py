"""Keyed sampling, shared by every engine: a row's random numbers depend on its key and its position
only, never on the batch it is decoded in, so a continued, re-issued or remote row samples alike.

`SampleStream` is a generator's checkpointable stream of keys (one per row per call), `row_keys`
assigns them to a call's rows, and `uniforms` turns (key, position) into the u ∈ (0, 1) an engine
samples its token from (the hf decoder's inverse-CDF draw)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from adarl.types import Request

MASK64 = (1 << 64) - 1
_GAMMA, _MIX1, _MIX2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 output function of x + γ, element-wise on uint64 (wrapping arithmetic)."""
    z = np.atleast_1d(np.asarray(x, dtype=np.uint64)) + _GAMMA
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


def uniforms(keys: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """u ∈ (0, 1) for each (row key, completion position): 53 hashed bits, centred in their cell."""
    h = splitmix64(np.asarray(keys, dtype=np.uint64) ^ splitmix64(np.asarray(positions, dtype=np.uint64)))
    return ((h >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0**-53


class SampleStream:
    """The generator's random state: a seed and how many sampling `generate` calls used it.

    `get_state` / `set_state` mirror torch.Generator's so that a caller can draw an aside (an
    evaluation) and put the stream back where it was.
    """

    def __init__(self, seed: int) -> None:
        self.seed = int(seed) & MASK64
        self.calls = 0

    def get_state(self) -> dict[str, int]:
        return {"seed": self.seed, "calls": self.calls}

    def set_state(self, state: dict[str, int]) -> None:
        self.seed, self.calls = int(state["seed"]), int(state["calls"])

    def new_keys(self, requests: Sequence[Request]) -> list[int]:
        """One key per row of `requests` (request i's n rows consecutive); moves on to the next call."""
        request = np.repeat(np.arange(len(requests), dtype=np.uint64), [r.n for r in requests])
        row = np.concatenate([np.arange(r.n, dtype=np.uint64) for r in requests] or [np.zeros(0, np.uint64)])
        base = splitmix64(splitmix64(np.uint64(self.seed)) ^ np.uint64(self.calls))
        self.calls += 1
        return [int(k) for k in splitmix64(splitmix64(base ^ request) ^ row)] if len(row) else []


def row_keys(requests: Sequence[Request], keys: Sequence[int] | None, greedy: bool,
             new_keys: Callable[[Sequence[Request]], list[int]]) -> tuple[list[int], list[int]]:
    """Each row's sampling key and request index (request i's n rows consecutive).

    Keys default to fresh ones from `new_keys`; greedy decoding draws none (all 0).
    """
    n_rows = sum(req.n for req in requests)
    if keys is None:
        keys = [0] * n_rows if greedy else new_keys(requests)
    elif len(keys) != n_rows:
        raise ValueError(f"keys: got {len(keys)}, expected one per row ({n_rows})")
    return list(keys), [i for i, req in enumerate(requests) for _ in range(req.n)]
