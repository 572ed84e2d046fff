"""A loss whose learner rank 1 fails in its first update (tests/cluster/test_ray_learners.py): it raises,
or its process exits as a crash in native code would. Rank 0 and a one-process run train as ppo_clip."""

from __future__ import annotations

import os
from typing import Literal

from pydantic.dataclasses import dataclass

from adarl.loss.ppo import PpoClip
from adarl.registry import STRICT


@dataclass(config=STRICT)
class FailsOnRank1(PpoClip):
    how: Literal["raise", "exit"] = "raise"

    def surrogate(self, x):
        if os.environ.get("RANK") == "1":
            if self.how == "exit":
                os._exit(7)
            raise RuntimeError("a learner fault on rank 1")
        return super().surrogate(x)
