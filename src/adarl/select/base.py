"""PromptSelector protocol: which problems a step trains on."""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np


class PromptSelector(Protocol):
    def select(self, n_problems: int, k: int, rng: np.random.Generator) -> list[int]:
        """Indices into the task's training problems for this step."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...
