"""Uniform selection: epochs over the training set, each a fresh permutation, no replacement."""

from __future__ import annotations

from typing import Any

import numpy as np
from pydantic.dataclasses import dataclass

from adarl.registry import STRICT, register
from adarl.select.base import NoDecay
from adarl.select.store import DifficultyStore
from adarl.types import Group


@register("select", "uniform")
@dataclass(config=STRICT)
class Uniform(NoDecay):
    def __post_init__(self) -> None:
        self.order: list[int] = []
        self.cursor = 0
        self.epoch = 0

    def select(self, store: DifficultyStore, k: int, rng: np.random.Generator) -> list[int]:
        n_problems = len(store)
        chosen: list[int] = []
        while len(chosen) < k:
            if self.cursor >= len(self.order):
                self.order = rng.permutation(n_problems).tolist()
                self.cursor = 0
                self.epoch += 1
            take = self.order[self.cursor : self.cursor + k - len(chosen)]
            chosen += take
            self.cursor += len(take)
        return chosen

    def observe(self, store: DifficultyStore, groups: list[Group]) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {"order": self.order, "cursor": self.cursor, "epoch": self.epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.order, self.cursor, self.epoch = list(state["order"]), state["cursor"], state["epoch"]
