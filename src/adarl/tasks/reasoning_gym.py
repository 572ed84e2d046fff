"""Problems from a reasoning-gym procedural generator, with a held-out eval split.

Training items are ``cfg.size`` items of the generator (duplicates dropped, so there may be
fewer); eval items come from a second, independently seeded generator, skipping every item
whose id is already in training. Both generator seeds are derived from the task seed by
hashing, because reasoning-gym seeds item ``i`` with ``seed + i``: plain ``seed`` and
``seed + 1`` would give nearly the same items.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import logging
from typing import Any

from adarl.config import TaskConfig
from adarl.tasks.base import TaskSource, dedupe, is_scalar, problem_id, render_prompt
from adarl.types import Problem

log = logging.getLogger(__name__)

RESERVED_PARAMS = ("seed", "size")  # set from task.seed / task.size


def derive_seed(seed: int, tag: str) -> int:
    """A 32-bit generator seed for `tag` ("train", "eval"), stable across machines."""
    return int(hashlib.sha256(f"adarl:{tag}:{seed}".encode()).hexdigest()[:8], 16)


def eval_attempts(eval_size: int) -> int:
    """How many generator items are tried at most to collect `eval_size` held-out ones."""
    return max(1000, 20 * eval_size)


def _registry() -> dict[str, Any]:
    from reasoning_gym.factory import DATASETS

    return DATASETS


def _create(name: str, params: dict[str, Any], size: int, seed: int) -> Any:
    """`reasoning_gym.create_dataset`, with unknown names and bad params as clear ValueErrors."""
    import reasoning_gym

    datasets = _registry()
    if name not in datasets:
        close = difflib.get_close_matches(name, list(datasets), n=3, cutoff=0.5)
        hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        raise ValueError(
            f"unknown reasoning_gym generator '{name}'{hint} "
            f"({len(datasets)} generators; list them with reasoning_gym.factory.DATASETS)"
        )
    config_cls = datasets[name][1]
    valid = [f.name for f in dataclasses.fields(config_cls) if f.name not in RESERVED_PARAMS]
    for key in params:
        if key in RESERVED_PARAMS:
            raise ValueError(f"task.params.{key} for '{name}': set task.{key} instead")
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


def to_problem(item: dict[str, Any], cfg: TaskConfig) -> Problem:
    """One generator item as a `Problem`: scalar metadata and the raw question go to columns."""
    question = str(item["question"])
    answer = item.get("answer")
    metadata = item.get("metadata") or {}
    columns = {k: v for k, v in metadata.items() if isinstance(k, str) and is_scalar(v)}
    columns["question"] = question
    return Problem(
        id=problem_id(question),
        prompt=render_prompt(question, cfg),
        answer=None if answer is None else str(answer),
        columns=columns,
    )


def load_reasoning_gym(cfg: TaskConfig, seed: int) -> TaskSource:
    """Generate the training set and a disjoint held-out eval set for `cfg.name`."""
    name = cfg.name
    if not name:
        raise ValueError("task.name is required for source 'reasoning_gym' (e.g. basic_arithmetic)")
    params = dict(cfg.params)

    train_ds = _create(name, params, size=cfg.size, seed=derive_seed(seed, "train"))
    train = dedupe([to_problem(train_ds[i], cfg) for i in range(cfg.size)])
    if len(train) < cfg.size:
        log.info("%s: %d of %d training items were duplicates and were dropped",
                 name, cfg.size - len(train), cfg.size)

    held: list[Problem] = []
    if cfg.eval_size > 0:
        attempts = eval_attempts(cfg.eval_size)
        eval_ds = _create(name, params, size=attempts, seed=derive_seed(seed, "eval"))
        seen = {p.id for p in train}
        for i in range(attempts):
            p = to_problem(eval_ds[i], cfg)
            if p.id in seen:
                continue
            seen.add(p.id)
            held.append(p)
            if len(held) == cfg.eval_size:
                break
        else:
            raise ValueError(
                f"reasoning_gym generator '{name}' gave only {len(held)} distinct held-out problems "
                f"not in the {len(train)} training ones after {attempts} tries; task.eval_size is "
                f"{cfg.eval_size}. Lower task.eval_size or task.size, or widen task.params"
            )
    return TaskSource(train=train, eval=held, name=name)
