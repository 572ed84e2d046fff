"""Length penalties: a linear per-token cost, or Kimi k1.5's group-relative length reward.

Not in algorithms.md. With |o| the completion length in tokens and L_max = `max_len` (None: the
generator's max_new_tokens):
    mode="linear":  R = −coef · |o| / L_max          (only on correct rollouts if only_correct)
    mode="kimi":    λ_i = 0.5 − (|o_i| − min_j |o_j|) / (max_j |o_j| − min_j |o_j|)   (0 if all equal)
                    R = coef · λ_i  if correct,  coef · min(0, λ_i)  otherwise
                    (Kimi k1.5, arXiv 2501.12599 §2.3.3; `only_correct` does not apply, and
                    min/max run over the rollout's group)
coef = 0.1_guess. Correctness comes from `Group.correct`. Adds column "length_penalty".
"""

from __future__ import annotations

from typing import ClassVar, Literal

import numpy as np
from pydantic import Field
from pydantic.dataclasses import dataclass

from adarl.registry import STRICT, register
from adarl.shaping.base import add_column
from adarl.types import Group


@register("shaping", "length_penalty")
@dataclass(config=STRICT)
class LengthPenalty:
    column: ClassVar[str] = "length_penalty"
    coef: float = Field(0.1, ge=0.0)  # _guess
    max_len: int | None = Field(None, gt=0)  # L_max (mode="linear")
    only_correct: bool = True  # mode="linear": penalise correct rollouts only
    mode: Literal["linear", "kimi"] = "linear"

    def __call__(self, groups: list[Group], max_new_tokens: int) -> None:
        max_len = self.max_len or max_new_tokens
        for group in groups:
            if group.correct is None:
                raise ValueError(f"group {group.problem.id} must be verified before length_penalty shaping")
            correct = np.asarray(group.correct) > 0.5
            length = np.array([len(r) for r in group.rollouts], dtype=np.float64)
            if self.mode == "linear":
                values = -self.coef * length / max_len
                if self.only_correct:
                    values = np.where(correct, values, 0.0)
            else:
                spread = length.max() - length.min()
                lam = 0.5 - (length - length.min()) / spread if spread > 0 else np.zeros_like(length)
                values = self.coef * np.where(correct, lam, np.minimum(lam, 0.0))
            add_column(group, self.column, values)
