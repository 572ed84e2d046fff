"""HBPO hierarchical budget advantage (algorithms.md §6.1; ZJU-REAL/HBPO `verl/trainer/ppo/core_algos.py`).

Inside each group, the rollouts generated under the same budget b (parsed from their text with
`adarl.sentences.parse_budget`) form a subgroup. With R the rollout's reward (the row sum,
R_HBPO when the "hbpo" shaping ran):
    A^inter_i = (R_i − mean_group R) / (std_group R + ε)     GRPO over the whole group, ε = 1e-6
    A^intra_i = μ_{b(i)} − f_2(b(i)),   μ_b = mean R of subgroup b,  f_2(b) = β·cos(π b / (2 L_max))
    A_i       = A^intra_i + A^inter_i
A^intra is added once (the paper's form; the released code adds it twice). A rollout whose text
states no budget gets `default_budget` (None: L_max, the code's default 4096, so f_2 = 0). β and
L_max must match the "hbpo" shaping's. A group of size 1 gets A^intra = 0 (as in the code) and
GRPO's singleton convention for A^inter (mean 0, std 1).
"""

from __future__ import annotations

import numpy as np
from pydantic import Field
from pydantic.dataclasses import dataclass

from adarl.advantage.grpo import Grpo
from adarl.registry import STRICT, register
from adarl.sentences import parse_budget
from adarl.shaping.hbpo import f2
from adarl.types import Batch


@register("advantage", "hbpo")
@dataclass(config=STRICT)
class Hbpo:
    beta: float = Field(4.0, gt=0.0)  # β
    max_len: int = Field(4096, gt=0)  # L_max
    default_budget: int | None = Field(None, gt=0)  # None: L_max
    eps: float = Field(1e-6, ge=0.0)

    def __call__(self, batch: Batch) -> np.ndarray:
        inter = Grpo(eps=self.eps)(batch)
        intra = np.zeros_like(inter)
        default = self.max_len if self.default_budget is None else self.default_budget
        offset = 0
        for group in batch.groups:
            size = group.size
            if size > 1:
                reward = group.reward.astype(np.float64)
                budgets = np.array([b if (b := parse_budget(r.text)) is not None else default
                                    for r in group.rollouts])
                for b in np.unique(budgets):
                    members = budgets == b
                    intra[offset:offset + size][members] = reward[members].mean() - f2(b, self.beta, self.max_len)
            offset += size
        return intra + inter
