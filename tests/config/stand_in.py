"""A shipped recipe at test size: `stand_in_overrides` (dotted keys for `load_recipe`) and `stand_in_recipes`
(a copy of recipes/ with them written in, for commands run as a page shows them).

The tiny local model stands in for SmolLM2 (conftest.make_tiny_model_dir), hf on one CPU thread, one step of
2 prompts × 4 rollouts of 8 new tokens, no evaluation or checkpoint; everything else is the recipe's own: its
task, rewards, selector, allocator, estimator, shapings, loss, scheduler mode, branching, hints, teacher or agent.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import yaml

from adarl.config import load_recipe
from adarl.config.loader import _set_dotted

ROOT = Path(__file__).resolve().parents[2]


def stand_in_overrides(recipe_path: Path, model_dir: Path, data: dict | None = None) -> dict[str, Any]:
    """The recipe at test size, as dotted overrides (`data`: overrides the recipe needs to load at all)."""
    recipe = load_recipe(recipe_path, dict(data or {}))
    over = {**(data or {}),
        "model.path": str(model_dir), "model.device": "cpu", "model.threads": 1,
        "rollout.backend": "hf", "rollout.max_new_tokens": 8, "reward_workers": 1,
        "budget.max_steps": 1, "budget.prompts_per_step": 2, "train.micro_batch_tokens": 512,
        "task.eval_size": 4, "eval.every": 0, "eval.at_start": False, "checkpoint.every": 0,
        "log.trackers": [], "log.progress": False, "log.rollouts_every": 0,
    }
    if recipe.task.mixture:  # a mixed pool: its shares' sizes are the task's, cut each share instead
        over.pop("task.eval_size")
        over["task.mixture"] = [{**share.model_dump(exclude_none=True), "size": 6, "eval_size": 1}
                                for share in recipe.task.mixture]
    elif recipe.task.source not in ("humaneval", "hf_datasets"):
        over["task.size"] = 16
    allocate = recipe.allocate if isinstance(recipe.allocate, dict) else recipe.allocate.model_dump()
    if "n" in allocate:
        over["allocate.n"] = 4
    if "n_max" in allocate:
        over["allocate.n_max"] = 8
    if recipe.rollout.agent is not None:
        over["rollout.agent.max_context_tokens"] = 64
    return over


def stand_in_recipes(folder: Path, model_dir: Path, extra: dict[str, Any] | None = None) -> None:
    """recipes/ copied into `folder/recipes` at test size (plus `extra`), and docs/examples.
    The header comments stay (errors quote its `hardware:`).
    A recipe reading a local dataset keeps its `task.path` (a page makes it first: hf_datasets.yaml's header)."""
    (folder / "recipes").mkdir(parents=True)
    for path in sorted((ROOT / "recipes").glob("*.yaml")):
        text = path.read_text()
        recipe = yaml.safe_load(text)
        loads_with = {"task.path": str(folder)} if recipe["task"].get("source") == "hf_datasets" else {}
        over = {k: v for k, v in stand_in_overrides(path, model_dir, loads_with).items() if k not in loads_with}
        for key, value in {**over, **(extra or {})}.items():
            _set_dotted(recipe, key, value)  # as a command line's override is set
        recipe["rollout"].pop("vllm", None)
        header = "".join(line for line in text.splitlines(keepends=True)[:40] if line.startswith("#"))
        (folder / "recipes" / path.name).write_text(header + yaml.safe_dump(recipe, sort_keys=False))
    shutil.copytree(ROOT / "docs" / "examples", folder / "docs" / "examples")
