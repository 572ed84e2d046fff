"""DAPO soft overlong punishment (algorithms.md §1.3(4); verl `reward_manager/dapo.py`).

With L_exp = L_max − L_buf and |o| the response length in tokens:
    R_len(|o|) = min( −(|o| − L_exp) / L_buf · penalty_factor, 0 )
0 up to L_exp, −penalty_factor at L_max, and (verl's form, unclamped) still falling past L_max.
L_max = `max_len` (None: the generator's max_new_tokens). L_buf = `buffer` (None: L_max // 5,
at least 1: the paper's ratio, 4096 of 20480). Adds column "overlong".
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
from pydantic import Field
from pydantic.dataclasses import dataclass

from adarl.registry import STRICT, register
from adarl.shaping.base import add_column
from adarl.types import Group


@register("shaping", "overlong")
@dataclass(config=STRICT)
class Overlong:
    column: ClassVar[str] = "overlong"
    max_len: int | None = Field(None, gt=0)  # L_max
    buffer: int | None = Field(None, gt=0)  # L_buf
    penalty_factor: float = Field(1.0, ge=0.0)

    def __call__(self, groups: list[Group], max_new_tokens: int) -> None:
        max_len = self.max_len or max_new_tokens
        buffer = self.buffer or max(1, max_len // 5)
        if buffer > max_len:
            raise ValueError(f"overlong: buffer ({buffer}) must be at most max_len ({max_len})")
        expected = max_len - buffer  # L_exp
        for group in groups:
            length = np.array([len(r) for r in group.rollouts], dtype=np.float64)
            add_column(group, self.column, np.minimum(-(length - expected) / buffer * self.penalty_factor, 0.0))
