"""Prompt-GDRO: EMA-debiased multiplicative weights over difficulty bins (§2.4, our reading).

Online difficulty classifier: each prompt's pass@k from its latest group, binned into K
equal-width bins of [0, 1] (a prompt never seen sits in the bin of 0.5). Per step:
    draw a bin with probability w_g, then a prompt uniformly inside it
after verification, with ℓ_g the mean hardness 1 − p̂_q of bin g's prompts this step and
f_g the fraction of the batch drawn from bin g:
    L̄_g ← (1 − ν) L̄_g + ν ℓ_g / f_g        (dividing by f_g: frequent bins gain no weight
                                              just by being sampled)
    w_g ← w_g · exp(η_w L̄_g);  normalise;  w ← (1 − γ) w + γ/K
The weights are published on the store (`store.gdro_weights`) for Rollout-GDRO, whose `bins`
must match (checked when the recipe loads).
Constants `_guess`: K = 5, k = 8, ν = 0.1, η_w = 0.1, γ = 0.1.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from pydantic import Field
from pydantic.dataclasses import dataclass

from adarl.registry import STRICT, register
from adarl.select.base import NoDecay
from adarl.select.store import DifficultyStore
from adarl.types import Group


def pass_at_k_latest(store: DifficultyStore, idx: np.ndarray, k: int) -> np.ndarray:
    """pass@k of each prompt's latest group (k capped by its size); 0.5 if never seen."""
    n, c = store.last_n[idx].astype(float), store.last_c[idx].astype(float)
    kk = np.minimum(k, np.maximum(n, 1.0))
    fail = np.ones(len(idx))
    for j in range(int(kk.max(initial=1))):  # Π_{j<k} (n − c − j)/(n − j): all k draws fail
        active = j < kk
        ratio = np.where(active, np.clip(n - c - j, 0, None) / np.maximum(n - j, 1.0), 1.0)
        fail *= ratio
    return np.where(n > 0, 1.0 - fail, 0.5)


def difficulty_bins(store: DifficultyStore, idx: np.ndarray, bins: int, k: int) -> np.ndarray:
    return np.minimum((pass_at_k_latest(store, idx, k) * bins).astype(np.int64), bins - 1)


@register("select", "gdro")
@dataclass(config=STRICT)
class PromptGdro(NoDecay):
    bins: int = Field(5, gt=1)
    k: int = Field(8, gt=0)
    ema: float = Field(0.1, gt=0.0, le=1.0)  # ν
    lr: float = Field(0.1, gt=0.0)  # η_w
    mix: float = Field(0.1, ge=0.0, le=1.0)  # γ

    def __post_init__(self) -> None:
        self.weights = np.full(self.bins, 1.0 / self.bins)
        self.loss = np.zeros(self.bins)
        self._bin_of: np.ndarray | None = None

    def _bin_array(self, store: DifficultyStore) -> np.ndarray:
        if self._bin_of is None or len(self._bin_of) != len(store):
            self._bin_of = difficulty_bins(store, np.arange(len(store)), self.bins, self.k)
        return self._bin_of

    def select(self, store: DifficultyStore, k: int, rng: np.random.Generator) -> list[int]:
        bin_of = self._bin_array(store)
        counts = rng.multinomial(k, self.weights)
        chosen: list[np.ndarray] = []
        spill = 0
        order = np.argsort(-self.weights)
        left: list[np.ndarray] = []
        for g in order:  # heaviest bins first; bins with too few prompts pass their draws on
            members = np.flatnonzero(bin_of == g)
            want = counts[g] + spill
            take = min(want, len(members))
            spill = want - take
            members = rng.permutation(members)
            chosen.append(members[:take])
            left.append(members[take:])
        for rest in left:  # draws still unplaced (the lighter bins were short too): heaviest bins' leftovers
            take = min(spill, len(rest))
            chosen.append(rest[:take])
            spill -= take
        picked = np.concatenate(chosen).astype(np.int64) if chosen else np.zeros(0, dtype=np.int64)
        self._last_bins = bin_of[picked].copy()
        return picked.tolist()

    def observe(self, store: DifficultyStore, groups: list[Group]) -> None:
        idx = np.array([store.index[g.problem.id] for g in groups], dtype=np.int64)
        bin_of = self._bin_array(store)
        hardness = 1.0 - store.last_c[idx] / np.maximum(store.last_n[idx], 1)
        batch_bins = bin_of[idx]
        for g in range(self.bins):
            inside = batch_bins == g
            if inside.any():
                frac = inside.mean()
                self.loss[g] = (1 - self.ema) * self.loss[g] + self.ema * hardness[inside].mean() / frac
        w = self.weights * np.exp(self.lr * self.loss)
        w /= w.sum()
        self.weights = (1 - self.mix) * w + self.mix / self.bins
        bin_of[idx] = difficulty_bins(store, idx, self.bins, self.k)  # prompts may change bin
        store.gdro_weights = self.weights.copy()

    def state_dict(self) -> dict[str, Any]:
        return {"weights": self.weights.copy(), "loss": self.loss.copy()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.weights, self.loss = np.array(state["weights"]), np.array(state["loss"])
        self._bin_of = None
