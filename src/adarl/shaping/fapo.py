"""FAPO flawed-positive penalty (algorithms.md §6.2; yyDing1/FAPO `fapo/fapo_reasoning/reward_fn.py`).

A judge, a user function named ``"package.module:function"``, is called as
``judge(prompt, completion, answer)`` on every correct rollout (`Group.correct`) and returns True
when the reasoning is flawed. It runs in the isolated worker pool of the verifiers
(`adarl.rewards.pool.WorkerPool`, one per FAPO instance, started on first use), so a hanging,
crashing or raising judge is killed or caught. A judge that fails (error, timeout, crash, or a
result that is not a bool) counts as "not flawed" and is counted in `metrics()`.
Column "fapo", for a flawed positive:
    penalty="zero":    −(the reward it had) → its row sum becomes 0, as in the released code
                       ("the reward it had" = the `reward` column if named, else all earlier columns)
    penalty="lambda":  −λ  → R = 1 − λ for a 0/1 verifier (λ = 0.5_guess)
and 0 for every other rollout. The paper's warm-up schedule is [paper, unverified]: not done.
"""

from __future__ import annotations

import functools
from collections import Counter
from typing import Any, ClassVar, Literal

import numpy as np
from pydantic import Field
from pydantic.dataclasses import dataclass

from adarl.registry import STRICT, register
from adarl.rewards.callable import load_function
from adarl.rewards.pool import MAX_MEMORY_MB, MAX_TIMEOUT_S, MAX_WORKERS, WorkerPool
from adarl.shaping.base import add_column
from adarl.types import Group

_load_judge = functools.cache(load_function)  # per worker process: import each judge once


def call_judge(spec: str, prompt: Any, completion: str, answer: Any) -> bool:
    """Run the judge named by `spec` on one correct rollout (inside a worker); True = flawed."""
    out = _load_judge(spec)(prompt, completion, answer)
    if not isinstance(out, (bool, np.bool_)):
        raise TypeError(f"judge {spec!r} returned a {type(out).__name__}, not a bool: {out!r:.100}")
    return bool(out)


@register("shaping", "fapo")
@dataclass(config=STRICT)
class Fapo:
    column: ClassVar[str] = "fapo"
    judge: str  # "package.module:function"
    penalty: Literal["zero", "lambda"] = "zero"
    lam: float = Field(0.5, ge=0.0)  # λ, _guess (penalty="lambda")
    reward: str | None = None  # penalty="zero": the column a flawed positive loses; None: all earlier columns
    workers: int = Field(2, ge=1, le=MAX_WORKERS)  # the pool's bounds, checked when the recipe loads
    timeout_s: float = Field(60.0, gt=0.0, le=MAX_TIMEOUT_S)
    memory_limit_mb: int | None = Field(4096, gt=0, le=MAX_MEMORY_MB)

    def __post_init__(self) -> None:
        try:
            load_function(self.judge)  # fail now, with a clear ValueError, rather than every step
        except ValueError as exc:
            raise ValueError(f"fapo judge: {exc}") from None
        self._pool: WorkerPool | None = None
        self._counts: Counter[str] = Counter()

    def __call__(self, groups: list[Group], max_new_tokens: int) -> None:
        jobs: list[tuple[int, int]] = []  # (group, rollout) of every correct rollout
        args: list[tuple[Any, ...]] = []
        for g, group in enumerate(groups):
            if group.correct is None or group.rewards is None:
                raise ValueError(f"group {group.problem.id} must be verified before fapo shaping")
            for i in np.flatnonzero(np.asarray(group.correct) > 0.5):
                jobs.append((g, int(i)))
                args.append((self.judge, group.problem.prompt, group.rollouts[i].text, group.problem.answer))
        results = self._run(args)
        flawed = [np.zeros(group.size, dtype=bool) for group in groups]
        for (g, i), (value, status) in zip(jobs, results, strict=True):
            self._counts["judged"] += 1
            if status != "ok":
                self._counts[{"error": "judge_errors", "timeout": "judge_timeouts"}.get(status, "judge_crashes")] += 1
            elif value:
                flawed[g][i] = True
                self._counts["flawed"] += 1
        for group, bad in zip(groups, flawed, strict=True):
            add_column(group, self.column, np.where(bad, self.penalty_values(group), 0.0))

    def penalty_values(self, group: Group) -> np.ndarray:
        """The column value a flawed positive of this group would get, per rollout."""
        assert group.rewards is not None
        if self.penalty == "lambda":
            return np.full(group.size, -self.lam)
        if self.reward is None:
            return -group.rewards.sum(axis=1)
        if self.reward not in group.reward_names:
            raise ValueError(f"fapo: reward column {self.reward!r} not found; the group has {group.reward_names}")
        return -group.rewards[:, group.reward_names.index(self.reward)]

    def _run(self, args: list[tuple[Any, ...]]) -> list[tuple[Any, str]]:
        if not args:
            return []
        if self._pool is None:
            module = self.judge.partition(":")[0].strip()
            self._pool = WorkerPool(self.workers, self.timeout_s, memory_limit_mb=self.memory_limit_mb,
                                    preload=(__name__, module))
        return self._pool.map(call_judge, args)

    def metrics(self) -> dict[str, float]:
        """Counts since the previous call: judged, flawed, judge_errors, judge_timeouts, judge_crashes."""
        keys = ("judged", "flawed", "judge_errors", "judge_timeouts", "judge_crashes")
        out = {f"fapo/{k}": float(self._counts[k]) for k in keys}
        self._counts.clear()
        return out

    def close(self) -> None:
        """Stop the judge's worker processes."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None
