"""FAPO flawed-positive penalty (algorithms.md §6.2; yyDing1/FAPO `fapo/fapo_reasoning/reward_fn.py`).

A judge, a function named ``"package.module:function"``, is called as
``judge(prompt, completion, answer)`` on every correct rollout (`Group.correct`) and returns True
when the reasoning is flawed. The paper's judge is a generative process reward model (FAPO-GenRM-4B)
that locates the first wrong step; adarl ships a rule-based one for its built-in arithmetic and
math tasks, `flawed_steps` (the default), and a local judge model can be wrapped as such a function.
It runs in the isolated worker pool of the verifiers
(`adarl.rewards.pool.WorkerPool`, one per FAPO instance, started on first use), so a hanging,
crashing or raising judge is killed or caught. A judge that fails (error, timeout, crash, or a
result that is not a bool) counts as "not flawed" and is counted in `metrics()`.
Column "fapo", for a flawed positive:
    penalty="zero":    −(the reward it had) → its row sum becomes 0, as in the released code
                       ("the reward it had" = the `reward` column if named, else all earlier columns)
    penalty="lambda":  −λ  → R = 1 − λ for a 0/1 verifier (λ = 0.5_guess)
and 0 for every other rollout.

Warm-up. The paper lets flawed positives act as shortcuts early and suppresses them later; §6.2
could not check a schedule against the paper text, and the released code penalises from the first
step. So the default is no warm-up (the code), and `warmup_steps` W / `ramp_steps` K give one: the
penalty of a rollout sampled at training step v (its policy version) is scaled by
    s(v) = 0 for v < W,   min(1, (v − W)/K) after (1 from W on when K = 0)
and rollouts with s = 0 are not judged. (`penalty: lambda` with λ = 0.5 on a 0/1 verifier puts a
flawed positive halfway between right and wrong; under GRPO it then keeps a positive advantage while
its group's mean reward is below 0.5, so the shift from shortcut to penalty also follows accuracy.)

`flawed_steps`, the shipped rule-based judge, flags a correct rollout when
- a step of arithmetic on numbers alone is wrong: "a op b ... = c" (+ − × ÷ * / and parentheses,
  thousands commas allowed) whose left side does not evaluate to c, within c's rounding (half a unit
  of its last decimal place); equations on names, powers or function values are not checked;
- or it states more than one distinct final answer (<answer> blocks, \boxed{}): a guess that the
  verifier happened to read right.
It does not detect a jump in reasoning; for code (humaneval) and SQL tasks it flags nothing.
"""

from __future__ import annotations

import ast
import functools
import operator
import re
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

THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
EQUALS = re.compile(r"(?<![<>!=])=(?!=)")
ARITHMETIC_CHARS = frozenset("0123456789. \t\n+-*/()")
RESULT = re.compile(r"\s*(-?\d+(?:\.(\d+))?)(?![\d.\w])(?!\s*[-+*/]\s*[\d(])")
FINAL_ANSWER = re.compile(r"<answer>(.*?)</answer>|\\boxed\{([^{}]*)\}", re.DOTALL)
OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def _value(node: ast.AST) -> float:
    """The value of + − × ÷ over numbers (ValueError for anything else)."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float) and abs(node.value) <= 1e15:
        return float(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        return -_value(node.operand) if isinstance(node.op, ast.USub) else _value(node.operand)
    if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        return OPERATORS[type(node.op)](_value(node.left), _value(node.right))
    raise ValueError("not arithmetic on numbers")


def wrong_step(text: str) -> bool:
    """Whether some "expression = number" step of `text` is false (see the module docstring)."""
    text = THOUSANDS.sub("", text.replace("×", "*").replace("÷", "/").replace("−", "-"))
    for eq in EQUALS.finditer(text):
        start, lo = eq.start(), max(0, eq.start() - 200)
        while start > lo and text[start - 1] in ARITHMETIC_CHARS:  # the arithmetic just before the "="
            start -= 1
        result = RESULT.match(text, eq.end())
        if result is None:
            continue
        while start < eq.start() and text[start].isspace():
            start += 1
        expression = text[start:eq.start()].strip()
        before = text[start - 1] if start > 0 else " "
        if before.isalnum() or before in "^_.)]}!%$" or not any(op in expression for op in "+-*/"):
            continue
        try:
            tree = ast.parse(expression, mode="eval").body
            if not isinstance(tree, ast.BinOp):
                continue
            value = _value(tree)
        except (SyntaxError, ValueError, ZeroDivisionError, OverflowError, RecursionError):
            continue
        decimals = len(result.group(2) or "")
        if abs(value - float(result.group(1))) > 0.5 * 10.0 ** -decimals + 1e-9:
            return True
    return False


def guessed_answers(text: str) -> bool:
    """Whether `text` states more than one distinct final answer."""
    answers = {"".join((a or b).split()).rstrip(".") for a, b in FINAL_ANSWER.findall(text)}
    return len(answers) > 1


def flawed_steps(prompt: Any, completion: str, answer: Any) -> bool:
    """adarl's rule-based FAPO judge for arithmetic and math tasks: a wrong arithmetic step or a guess."""
    return wrong_step(completion) or guessed_answers(completion)


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
    judge: str = "adarl.shaping.fapo:flawed_steps"  # "package.module:function"; default: the rule-based judge
    penalty: Literal["zero", "lambda"] = "zero"
    lam: float = Field(0.5, ge=0.0)  # λ, _guess (penalty="lambda")
    reward: str | None = None  # penalty="zero": the column a flawed positive loses; None: all earlier columns
    workers: int = Field(2, ge=1, le=MAX_WORKERS)  # the pool's bounds, checked when the recipe loads
    timeout_s: float = Field(60.0, gt=0.0, le=MAX_TIMEOUT_S)
    memory_limit_mb: int | None = Field(4096, gt=0, le=MAX_MEMORY_MB)
    warmup_steps: int = Field(0, ge=0)  # W: no penalty for rollouts sampled before step W (0: the code)
    ramp_steps: int = Field(0, ge=0)  # K: the penalty grows linearly to full over K steps after W

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
                if self.penalty_scale(group.rollouts[i].policy_version) == 0.0:
                    continue  # still warming up: the penalty would be 0
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
            scale = np.array([self.penalty_scale(r.policy_version) for r in group.rollouts])
            add_column(group, self.column, np.where(bad, self.penalty_values(group) * scale, 0.0))

    def penalty_scale(self, step: int) -> float:
        """s(v): the warm-up's share of the penalty for a rollout sampled at training step `step`."""
        if step < self.warmup_steps:
            return 0.0
        return 1.0 if self.ramp_steps == 0 else min(1.0, (step - self.warmup_steps) / self.ramp_steps)

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
