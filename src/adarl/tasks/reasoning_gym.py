"""Problems from a reasoning-gym procedural generator, with a held-out eval split.

One pool of ``task.size + task.eval_size`` distinct items is drawn from the generator
(duplicates are skipped, up to `pool_attempts` draws) and split at random into training and
eval by `adarl.tasks.base.split_held_out`, so eval has the training distribution. A pool that
comes up short (a small problem space) is a warning, and eval is filled first. The generator
seed and the split seed are derived from ``task.data_seed`` by hashing, because reasoning-gym seeds
item ``i`` with ``seed + i``: plain ``seed`` and ``seed + 1`` would give nearly the same items.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import re
from typing import Any

from adarl.config import TaskConfig
from adarl.tasks.base import TaskSource, is_scalar, problem_id, render_prompt, split_held_out
from adarl.types import Problem

RESERVED_PARAMS = ("seed", "size")  # set from task.data_seed / task.size


def derive_seed(seed: int, tag: str) -> int:
    """A 32-bit seed for `tag` ("pool", "split"), stable across machines."""
    return int(hashlib.sha256(f"adarl:{tag}:{seed}".encode()).hexdigest()[:8], 16)


def pool_attempts(wanted: int) -> int:
    """How many generator items are drawn at most to collect `wanted` distinct ones."""
    # 4x leaves room for generators that spend many draws in a small corner: with 1- and 2-digit
    # operands half the draws are among 121 one-digit sums, and 1200 distinct take ~2,300 draws
    return max(1000, 4 * wanted)


def _registry() -> dict[str, Any]:
    from reasoning_gym.factory import DATASETS

    return DATASETS


def _create(name: str, params: dict[str, Any], size: int, seed: int) -> Any:
    """`reasoning_gym.create_dataset`, with unknown names and bad params as clear ValueErrors."""
    import reasoning_gym

    datasets = _registry()
    if name not in datasets:
        close = difflib.get_close_matches(name, list(datasets), n=3, cutoff=0.5) if len(name) <= 200 else []
        hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        from adarl.config.loader import _clip  # a 100k-character name is not echoed whole

        raise ValueError(
            f"unknown reasoning_gym generator '{_clip(name)}'{hint} "
            f"({len(datasets)} generators; list them with reasoning_gym.factory.DATASETS)"
        )
    config_cls = datasets[name][1]
    valid = [f.name for f in dataclasses.fields(config_cls) if f.name not in RESERVED_PARAMS]
    for key in params:
        if key in RESERVED_PARAMS:
            instead = "task.data_seed (task.seed is its old name)" if key == "seed" else f"task.{key}"
            raise ValueError(f"task.params.{key} for '{name}': set {instead} instead")
        if key not in valid:
            close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise ValueError(
                f"unknown parameter '{key}' for reasoning_gym generator '{name}'{hint} "
                f"(valid: {', '.join(valid)})"
            )
    try:
        return reasoning_gym.create_dataset(name, size=size, seed=seed, **params)
    except (AssertionError, TypeError, ValueError, KeyError) as err:
        shown = ", ".join(f"{k}={v!r}" for k, v in params.items()) or "defaults"
        raise ValueError(f"bad parameters for reasoning_gym generator '{name}' ({shown}): {err}") from err


_CHAIN = re.compile(r"\s*(-?\d+)((?:\s*[+-]\s*\d+)+)\s*")


def arithmetic_solution(expression: str) -> str | None:
    """A worked solution of a chain of + and − (left to right), the hint source for arithmetic tasks
    (`hints.source: solution`); None for any other expression."""
    m = _CHAIN.fullmatch(expression)
    if m is None:
        return None
    value, steps = int(m.group(1)), []
    for op, number in re.findall(r"([+-])\s*(\d+)", m.group(2)):
        new = value + int(number) if op == "+" else value - int(number)
        steps.append(f"{value} {op} {number} = {new}")
        value = new
    return f"{'; '.join(steps)}. The answer is {value}."


def to_problem(item: dict[str, Any], cfg: TaskConfig) -> Problem:
    """One generator item as a `Problem`: scalar metadata and the raw question go to columns."""
    question = str(item["question"])
    answer = item.get("answer")
    metadata = item.get("metadata") or {}
    columns = {k: v for k, v in metadata.items() if isinstance(k, str) and is_scalar(v)}
    columns["question"] = question
    if "solution" not in columns and isinstance(columns.get("expression"), str):
        solution = arithmetic_solution(columns["expression"])
        if solution is not None:
            columns["solution"] = solution
    return Problem(
        id=problem_id(question),
        prompt=render_prompt(question, cfg),
        answer=None if answer is None else str(answer),
        columns=columns,
    )


def distinct_problems(name: str, params: dict[str, Any], wanted: int, seed: int, cfg: TaskConfig,
                      taken: set[str] | frozenset[str] = frozenset()) -> list[Problem]:
    """Up to `wanted` distinct problems of generator `name` (none whose id is in `taken`), in at most
    `pool_attempts(wanted)` draws seeded by `seed`."""
    attempts = pool_attempts(wanted)
    ds = _create(name, dict(params), size=attempts, seed=seed)
    pool: list[Problem] = []
    seen = set(taken)
    for i in range(attempts):
        p = to_problem(ds[i], cfg)
        if p.id not in seen:
            seen.add(p.id)
            pool.append(p)
            if len(pool) == wanted:
                break
    return pool


def load_reasoning_gym(cfg: TaskConfig, data_seed: int) -> TaskSource:
    """One pool of distinct generator items for `cfg.name`, split into training and held-out eval
    (a mixture of generators is tasks/mixture.py's)."""
    name = cfg.name
    if not name:
        raise ValueError("task.name is required for source 'reasoning_gym' (e.g. basic_arithmetic)")
    attempts = pool_attempts(cfg.size + cfg.eval_size)
    pool = distinct_problems(name, cfg.params, cfg.size + cfg.eval_size, derive_seed(data_seed, "pool"), cfg)
    if len(pool) <= cfg.eval_size:
        raise ValueError(
            f"reasoning_gym generator '{name}' gave only {len(pool)} distinct problems in {attempts} draws "
            f"and task.eval_size is {cfg.eval_size}: at least one must be left for training. Lower "
            "task.eval_size, or widen task.params"
        )
    train, held = split_held_out(pool, cfg.eval_size, derive_seed(data_seed, "split"), train_size=cfg.size,
                                 what=f"reasoning_gym generator '{name}' ({attempts} draws)")
    return TaskSource(train=train, eval=held, name=name)
