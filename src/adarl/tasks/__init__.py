"""Task sources: training problems and a held-out eval split, as `adarl.types.Problem`.

`build_task(cfg)` picks the recipe's source (tasks/base.py holds what every source shares; each
source module imports it, and only this module imports the sources)."""

from __future__ import annotations

import logging

from adarl.config import TaskConfig
from adarl.tasks.base import TaskSource, dedupe, problem_id, render_prompt, split_held_out
from adarl.tasks.hf_datasets import load_hf_datasets
from adarl.tasks.humaneval import N_PROBLEMS, load_humaneval
from adarl.tasks.jsonl import load_jsonl, read_jsonl
from adarl.tasks.mixture import load_mixture
from adarl.tasks.reasoning_gym import load_reasoning_gym
from adarl.tasks.text_to_sql import load_text_to_sql
from adarl.types import Problem

__all__ = ["TaskSource", "build_task", "load_by_path", "problem_id", "render_prompt"]
log = logging.getLogger("adarl.tasks.base")  # the logger build_task always used


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
        return load_text_to_sql(cfg)
    if cfg.source not in ("reasoning_gym", "jsonl", "humaneval", "hf_datasets"):
        raise ValueError(f"unknown task source '{cfg.source}' (choices: reasoning_gym, jsonl, humaneval, "
                         "hf_datasets, sql, retrieval, compute, text_to_sql)")
    if cfg.source == "hf_datasets":  # it applies the eval_size default below itself, reading the data once
        return load_hf_datasets(cfg, cfg.data_seed)
    if "eval_size" not in cfg.model_fields_set and cfg.source != "reasoning_gym" and not cfg.eval_path:
        distinct = N_PROBLEMS if cfg.source == "humaneval" else len(dedupe(read_jsonl(cfg.path or "", cfg)))
        if 2 * cfg.eval_size > distinct:
            log.info("%s has %d distinct problems: holding out %d (task.eval_size defaults to %d)",
                     cfg.path or cfg.source, distinct, distinct // 2, cfg.eval_size)
            cfg.eval_size = distinct // 2
    if cfg.source == "reasoning_gym":
        if cfg.mixture is not None:  # one pool per share (tasks/mixture.py)
            return load_mixture(cfg, cfg.data_seed)
        return load_reasoning_gym(cfg, cfg.data_seed)
    if cfg.source == "jsonl":
        return load_jsonl(cfg, cfg.data_seed)
    return load_humaneval(cfg, cfg.data_seed)
