"""PromptSelector protocol: which training problems a step uses, reading the difficulty store."""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from adarl.select.store import DifficultyStore
from adarl.types import Group


class PromptSelector(Protocol):
    def select(self, store: DifficultyStore, k: int, rng: np.random.Generator) -> list[int]:
        """Indices into the task's training problems (and the store) for this step."""
        ...

    def observe(self, store: DifficultyStore, groups: list[Group]) -> None:
        """Called after the store was updated with the step's verified groups."""
        ...

    def store_decay(self) -> tuple[float, float]:
        """(γ_short, γ_long): the posterior decay the difficulty store applies (1, 1: none)."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def candidates(store: DifficultyStore, m: int, rng: np.random.Generator) -> np.ndarray:
    """m distinct prompt indices drawn uniformly (all of them if the store is smaller)."""
    n = len(store)
    if m >= n:
        return rng.permutation(n)
    # sampling with replacement then de-duplicating is O(m), unlike rng.choice(replace=False) on 1M
    out = np.unique(rng.integers(0, n, size=int(m * 1.2) + 8))
    while len(out) < m:
        out = np.unique(np.concatenate([out, rng.integers(0, n, size=m)]))
    return rng.permutation(out)[:m]


class NoDecay:
    """Mixin for selectors whose difficulty store keeps all evidence (no posterior decay)."""

    def store_decay(self) -> tuple[float, float]:
        return 1.0, 1.0


class Stateless(NoDecay):
    """Mixin for selectors that learn nothing across steps beyond what the store holds (the
    registry gives them the no-op `state_dict`/`load_state_dict`/`metrics`)."""

    def observe(self, store: DifficultyStore, groups: list[Group]) -> None:
        pass
