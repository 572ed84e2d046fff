"""What every task source shares: the `TaskSource` container, stable ids, prompt rendering, and
the held-out split rule (`split_held_out`)."""

from __future__ import annotations

import hashlib
import json
import logging
import random
from dataclasses import dataclass
from typing import Any

from adarl.config import TaskConfig
from adarl.types import Problem

log = logging.getLogger(__name__)


@dataclass
class TaskSource:
    """Training problems and a held-out eval split; no eval id ever appears in `train`."""

    train: list[Problem]
    eval: list[Problem]
    name: str
    skipped: int = 0  # bad data lines skipped (task.skip_bad_lines)
    first_bad: str | None = None  # the first skipped line's error message

    def __repr__(self) -> str:
        return f"TaskSource(name={self.name!r}, train={len(self.train)}, eval={len(self.eval)})"


def problem_id(text: str | list[dict[str, str]]) -> str:
    """A stable content hash (16 hex chars of sha1), the same on every run and machine."""
    if not isinstance(text, str):
        text = json.dumps(text, sort_keys=True, ensure_ascii=False)
    return hashlib.sha1(text.encode("utf-8")).hexdigest()[:16]


def render_prompt(question: str, cfg: TaskConfig) -> list[dict[str, str]]:
    """Chat messages for one question: optional system message, then the templated user turn.

    Only the literal ``{prompt}`` in `cfg.prompt_template` is substituted, so other braces in
    the template (or in the question) are left alone.
    """
    messages = []
    if cfg.system_prompt:
        messages.append({"role": "system", "content": cfg.system_prompt})
    messages.append({"role": "user", "content": cfg.prompt_template.replace("{prompt}", question)})
    return messages


def is_scalar(value: Any) -> bool:
    """True for the JSON-serialisable scalars kept as columns."""
    return value is None or isinstance(value, (str, int, float, bool))


def dedupe(problems: list[Problem]) -> list[Problem]:
    """Keep the first problem of each id, in order."""
    seen: set[str] = set()
    out = []
    for p in problems:
        if p.id not in seen:
            seen.add(p.id)
            out.append(p)
    return out


def prompt_key(problem: Problem) -> str:
    """The problem's prompt as one string, to compare prompts across splits."""
    return json.dumps(problem.prompt, sort_keys=True, ensure_ascii=False)


def remove_held(train: list[Problem], held: list[Problem]) -> list[Problem]:
    """`train` without any problem whose id or prompt is also in `held`."""
    held_ids = {p.id for p in held}
    held_prompts = {prompt_key(p) for p in held}
    return [p for p in train if p.id not in held_ids and prompt_key(p) not in held_prompts]


def split_held_out(
    pool: list[Problem], eval_size: int, seed: int | str, *, train_size: int | None = None, what: str = "task"
) -> tuple[list[Problem], list[Problem]]:
    """(train, eval): the one held-out rule of every task source.

    The de-duplicated `pool` is shuffled by `random.Random(seed)`; its last `eval_size` problems
    are held out, in shuffled order (so any prefix of eval is a random sample too), and the rest
    is training, in pool order, at most `train_size` of it. A random split of one pool gives
    eval the training distribution; "the generator's items that are not in training" would not,
    since when training covers most of a small problem space those are its rarest leftovers.

    Eval is filled first. When `train_size` is given and the pool has fewer than
    `train_size + eval_size` distinct problems, a warning says how many were found and asked.
    No problem whose id or prompt is held out stays in training.
    """
    unique = dedupe(pool)
    n_eval = min(eval_size, len(unique))
    order = list(range(len(unique)))
    random.Random(seed).shuffle(order)
    cut = len(order) - n_eval
    held = [unique[i] for i in order[cut:]]
    train = remove_held([unique[i] for i in sorted(order[:cut])], held)
    if train_size is not None:
        train = train[:train_size]
        if len(unique) < train_size + eval_size:
            log.warning("%s: only %d distinct problems, of the %d asked (task.size %d + task.eval_size %d); "
                        "eval holds %d and training %d. Lower task.size or task.eval_size, or widen the task",
                        what, len(unique), train_size + eval_size, train_size, eval_size, len(held), len(train))
    return train, held


def load_by_path(cfg: TaskConfig, source: str | None = None) -> TaskSource:
    """A task source named by import path: ``function(cfg) -> list[Problem] | TaskSource``, without packaging.
    A list is split like every source's pool (`split_held_out` by `cfg.data_seed`, at most `cfg.size` trained)."""
    import importlib

    source = source or cfg.source
    module, _, attr = source.partition(":")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"task.source {source!r} cannot be loaded ({type(err).__name__}: {err})") from None
    out = fn(cfg)
    if isinstance(out, TaskSource):
        return out
    problems = list(out)
    if not all(isinstance(p, Problem) for p in problems):
        raise ValueError(f"task.source {source!r} must return a list of adarl.types.Problem or a TaskSource")
    train, held = split_held_out(problems, cfg.eval_size, cfg.data_seed, train_size=cfg.size, what=source)
    return TaskSource(train, held, cfg.name or attr)


def build_task(cfg: TaskConfig, seed: int | None = None) -> TaskSource:
    """Build the task `cfg` describes. Its problems and held-out split depend on `cfg.data_seed` only.

    `seed` (the recipe's training seed, passed by older callers) is not used: the training seed varies
    sampling and the order prompts are drawn in, never which problems there are, so every seed of a
    comparison is scored on the same held-out set. A `cfg.eval_size` left at its default on a finite
    task (a jsonl file without eval_path, humaneval) with fewer than twice that many distinct problems
    becomes half of them; the number is written back to `cfg.eval_size`, so config.yaml records it.
    """
    del seed  # see the docstring: the data seed alone decides the task
    if ":" in cfg.source:
        return load_by_path(cfg)
    if cfg.source in ("sql", "retrieval"):  # tasks that need tools (tasks/tool_tasks.py)
        return load_by_path(cfg, f"adarl.tasks.tool_tasks:{cfg.source}")
    if cfg.source == "compute":  # arithmetic for the Python tool (tasks/compute.py)
        return load_by_path(cfg, "adarl.tasks.compute:compute")
    if cfg.source == "text_to_sql":  # a shipped corpus with its own held-out split (tasks/text_to_sql.py)
        from adarl.tasks.text_to_sql import load_text_to_sql

        return load_text_to_sql(cfg)
    if cfg.source not in ("reasoning_gym", "jsonl", "humaneval", "hf_datasets"):
        raise ValueError(f"unknown task source '{cfg.source}' (choices: reasoning_gym, jsonl, humaneval, "
                         "hf_datasets, sql, retrieval, compute, text_to_sql)")
    if cfg.source == "hf_datasets":  # it applies the eval_size default below itself, reading the data once
        from adarl.tasks.hf_datasets import load_hf_datasets

        return load_hf_datasets(cfg, cfg.data_seed)
    if "eval_size" not in cfg.model_fields_set and cfg.source != "reasoning_gym" and not cfg.eval_path:
        if cfg.source == "humaneval":
            from adarl.tasks.humaneval import N_PROBLEMS as distinct
        else:
            from adarl.tasks.jsonl import read_jsonl

            distinct = len(dedupe(read_jsonl(cfg.path or "", cfg)))
        if 2 * cfg.eval_size > distinct:
            log.info("%s has %d distinct problems: holding out %d (task.eval_size defaults to %d)",
                     cfg.path or cfg.source, distinct, distinct // 2, cfg.eval_size)
            cfg.eval_size = distinct // 2
    if cfg.source == "reasoning_gym":
        from adarl.tasks.reasoning_gym import load_reasoning_gym

        return load_reasoning_gym(cfg, cfg.data_seed)
    if cfg.source == "jsonl":
        from adarl.tasks.jsonl import load_jsonl

        return load_jsonl(cfg, cfg.data_seed)
    from adarl.tasks.humaneval import load_humaneval

    return load_humaneval(cfg, cfg.data_seed)
