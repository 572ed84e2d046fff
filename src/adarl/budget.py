"""Token and rollout accounting: what every allocator spends from.

Every generated token is counted here, per step and in total, so that every metrics row can
carry the cumulative count and curves can be drawn against tokens spent, not steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from adarl.types import Rollout


@dataclass
class Budget:
    max_tokens: int | None = None  # total generated tokens allowed for the run
    tokens_per_step: int | None = None  # generated tokens an allocator may spend in one step
    rollouts_per_step: int | None = None  # rollouts an allocator may spend in one step
    expected_length: float = 1.0  # tokens per rollout assumed for prompts with no history
    total_tokens: int = 0
    total_rollouts: int = 0
    step_tokens: int = 0
    step_rollouts: int = 0
    last_step: bool = False  # this step gets the rest of max_tokens; none follows it

    def start_step(self) -> None:
        # a step that starts with no more of the run's tokens left than the step before spent gets
        # them all and is the last: what it leaves (rollouts are whole) would pay for a few rollouts
        # or none, not for a step like the others
        left = self.run_tokens_left()
        self.last_step = left is not None and left <= self.step_tokens
        self.step_tokens = 0
        self.step_rollouts = 0

    def spend(self, rollouts: list[Rollout] | int, tokens: int | None = None) -> None:
        """Count rollouts started (a list of them, or how many) and the tokens generating cost.

        `tokens` defaults to the rollouts' length; pass it when they differ (partial and async
        modes: tokens sampled this call, including rollouts still unfinished or cut by the budget).
        """
        if isinstance(rollouts, int):
            count = rollouts
            tokens = 0 if tokens is None else tokens
        else:
            count = len(rollouts)
            tokens = sum(len(r) for r in rollouts) if tokens is None else tokens
        self.step_tokens += tokens
        self.total_tokens += tokens
        self.step_rollouts += count
        self.total_rollouts += count

    def reserve(self, rollouts: int, tokens: float) -> Budget:
        """A copy of this budget with `rollouts` and `tokens` already spent this step: what is left
        for requests made beside ones not yet generated (spare requests of over-provisioning)."""
        view = Budget(**{k: getattr(self, k) for k in self.__dataclass_fields__})
        view.step_rollouts += rollouts
        view.total_rollouts += rollouts
        view.step_tokens += int(math.ceil(tokens))
        view.total_tokens += int(math.ceil(tokens))
        return view

    def run_tokens_left(self) -> int | None:
        """Tokens the run may still generate (None = unlimited)."""
        if self.max_tokens is None:
            return None
        return max(0, self.max_tokens - self.total_tokens)

    def step_tokens_left(self) -> int | None:
        """Tokens still allowed this step (None = unlimited): what is left of `tokens_per_step` or
        of the run's `max_tokens`, whichever is less. So a run never generates more than
        `max_tokens`: its last step is trimmed to the rest, like any step to `tokens_per_step`."""
        step = None if self.tokens_per_step is None else max(0, self.tokens_per_step - self.step_tokens)
        return min((n for n in (step, self.run_tokens_left()) if n is not None), default=None)

    def step_rollouts_left(self) -> int | None:
        """Rollouts still allowed this step (None = unlimited)."""
        if self.rollouts_per_step is None:
            return None
        return max(0, self.rollouts_per_step - self.step_rollouts)

    def exhausted(self) -> bool:
        """No step follows: the run's tokens are spent, or this step got the rest of them."""
        return self.max_tokens is not None and (self.total_tokens >= self.max_tokens or self.last_step)

    def metrics(self) -> dict[str, int]:
        return {
            "tokens": self.total_tokens,
            "rollouts": self.total_rollouts,
            "step_tokens": self.step_tokens,
            "step_rollouts": self.step_rollouts,
        }

    def state_dict(self) -> dict[str, int]:
        # the last step's tokens: whether the next step is the run's last (start_step)
        return {"total_tokens": self.total_tokens, "total_rollouts": self.total_rollouts,
                "step_tokens": self.step_tokens}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.total_tokens = state["total_tokens"]
        self.total_rollouts = state["total_rollouts"]
        self.step_tokens = state.get("step_tokens", 0)  # checkpoints before issue 38 have none


def check_feasible(budget_cfg, n_train: int, task_eval_size: int, eval_size: int | None, n_eval: int) -> None:
    """Budgets the task cannot meet are errors before any model loads (ValueError).

    `budget_cfg` is the recipe's `budget` section; `n_train`/`n_eval` the task's split sizes."""
    b = budget_cfg
    if b.prompts_per_step > n_train:
        raise ValueError(
            f"budget.prompts_per_step is {b.prompts_per_step} but the task has only {n_train} training "
            f"problems (after holding out task.eval_size={task_eval_size}); "
            "lower budget.prompts_per_step or add problems"
        )
    for key, limit in (("tokens_per_step", b.tokens_per_step), ("max_tokens", b.max_tokens)):
        if limit is not None and limit < b.prompts_per_step:
            raise ValueError(
                f"budget.{key} is {limit}, less than one step needs: at least one generated token for "
                f"each of the budget.prompts_per_step={b.prompts_per_step} prompts"
            )
    if eval_size is not None and eval_size > n_eval:
        raise ValueError(
            f"eval.size is {eval_size} but only {n_eval} problems are held out "
            f"(task.eval_size={task_eval_size}); lower eval.size or raise task.eval_size"
        )
