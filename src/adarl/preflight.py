"""What must hold before a run starts, checked before any model loads or anything is written: the run
directory, the recipe's callables, packages and environment, the files it needs (model, tokenizer, data),
and a token budget that buys one step of its groups. `adarl train`, `adarl compare` and `adarl.api` call them
alike, with the same messages (RecipeError)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from adarl.config import Recipe, RecipeError


def check_groups(recipe: Recipe, max_tokens_name: str = "budget.max_tokens") -> list[str]:
    """A token budget too small for one step of the recipe's groups, found before any model loads.

    The first step knows no completion lengths, so it prices every rollout at rollout.max_new_tokens and trims
    its groups to what the budget allows (allocate/base.py: `fit`). A budget that cannot give each of the
    step's prompts two rollouts at that price draws groups of one, which a group-relative advantage learns
    nothing from: a RecipeError naming the minimum. A budget below the step's full groups runs with them
    trimmed: a warning (returned). A recipe whose allocator itself plans groups of one is left alone."""
    from adarl import registry
    from adarl.budget import Budget
    from adarl.select.store import DifficultyStore
    from adarl.types import Problem

    allocator = registry.build("allocate", recipe.allocate)
    problems = [Problem(f"p{i}", "") for i in range(allocator.candidates(recipe.budget.prompts_per_step))]
    try:
        sizes = list(allocator.plan(problems, DifficultyStore([p.id for p in problems], problems=problems),
                                    Budget()).values())
    except Exception:  # noqa: BLE001 (a plugin allocator that needs real problems to plan: the run will tell)
        return []
    if not sizes or min(sizes) < 2:
        return []
    b, length, prompts = recipe.budget, recipe.rollout.max_new_tokens, len(sizes)
    full = f"{sum(sizes):,} rollouts × {length} new tokens = {sum(sizes) * length:,} tokens"
    out = []
    for name, limit, pairs, whole in ((max_tokens_name, b.max_tokens, 2 * prompts * length, sum(sizes) * length),
                                      ("budget.tokens_per_step", b.tokens_per_step, 2 * prompts * length,
                                       sum(sizes) * length),
                                      ("budget.rollouts_per_step", b.rollouts_per_step, 2 * prompts, sum(sizes))):
        if limit is None or limit >= whole:
            continue
        unit = "rollouts" if name.endswith("rollouts_per_step") else "tokens"
        if limit < pairs:
            need = f"{prompts} prompts × 2 rollouts" + (f" × {length} new tokens" if unit == "tokens" else "")
            raise RecipeError(
                f"{name} is {limit:,}, too small for one step of {recipe.name}: groups of two need {need} = "
                f"{pairs:,} {unit} at least (its full step: {full}); with less, its first step draws groups of one "
                f"rollout, from which {recipe.advantage.get('name', 'the advantage')} learns nothing. Give at least "
                f"{pairs:,}, or fewer budget.prompts_per_step")
        out.append(f"{name} {limit:,} is below one full step of {recipe.name} ({full}): its first step's groups "
                   "are trimmed to fit")
    return out


def check_files(recipe: Recipe, source: str | Path | None = None) -> None:
    """The model (with its tokenizer) and the task's data, looked for before anything loads: every one missing
    named in one RecipeError, with the hardware the recipe is written for (the `# hardware:` line of `source`, the
    recipe's file or built-in name) and the commands that fetch them. Nothing is loaded or downloaded here: a Hub
    id is looked up in the Hugging Face cache, else (online) the Hub is asked whether it would serve it."""
    from adarl import hub
    from adarl.models import resolve_model

    missing, fetch = [], []
    ids = [("model.path", recipe.model.path, "model", "the model and its tokenizer")]
    if recipe.task.source == "hf_datasets":
        ids += [(f"task.{key}", value, "dataset", "the task's data")
                for key, value in (("path", recipe.task.path), ("eval_path", recipe.task.eval_path)) if value]
    for key, value, kind, what in ids:
        if hub.is_hub_id(value):
            if why := _not_here(value, kind):
                missing.append(f"{key} {value} ({what}): {why}")
                fetch.append(f"hf download {value}" + (" --repo-type dataset" if kind == "dataset" else ""))
        elif kind == "model":
            try:
                resolve_model(value)
            except FileNotFoundError as err:
                missing.append(str(err))
    if not missing:
        return
    lines = [f"{recipe.name} needs what this machine does not have:", *(f"  {m}" for m in missing)]
    if hardware := _hardware(source):
        lines.append(f"This recipe is written for {hardware}")
    if fetch:
        lines += ["Fetch them where there is network, then copy the Hugging Face cache here (or point HF_HUB_CACHE "
                  "at a copy):", *(f"  {c}" for c in fetch)]
    raise RecipeError("\n".join(lines))


def _not_here(repo_id: str, kind: Literal["model", "dataset"]) -> str | None:
    """Why a Hub id cannot be had here (None: it is in the cache, or the Hub would serve it)."""
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    from adarl import hub

    try:
        snapshot_download(repo_id, repo_type=kind, cache_dir=hub.cache_dir(), local_files_only=True)
        return None
    except LocalEntryNotFoundError:
        pass
    where = f"not in the Hugging Face cache ({hub.cache_dir()})"
    if hub.offline():
        return f"{where}, and HF_HUB_OFFLINE is set"
    try:
        HfApi().repo_info(repo_id, repo_type=kind, timeout=10)
        return None  # downloaded when the run needs it
    except Exception as err:  # no network, not on the Hub, gated: one reason for all
        return f"{where}, and the Hub did not serve it ({type(err).__name__})"


def _hardware(source: str | Path | None) -> str | None:
    """The first sentence of a recipe file's `# hardware:` line (every shipped recipe has one), else None."""
    from adarl.config.loader import builtin_recipe

    if source is None:
        return None
    path = builtin_recipe(str(source)) or Path(source)
    try:
        head = path.read_text(errors="replace")[:20_000]
    except OSError:
        return None
    found = re.search(r"^#\s*hardware:\s*(.+)$", head, flags=re.MULTILINE)
    return re.split(r"(?<=\.)\s", found.group(1).strip())[0] if found else None


def check_run(recipe: Recipe, run_dir: Path, resume: bool, source: str | Path | None = None) -> list[str]:
    """What must hold before a run starts or resumes in `run_dir` (RecipeError / ValueError otherwise); the
    warnings to show (`check_groups`). `source`: the recipe's file or built-in name (`check_files`)."""
    from adarl.rewards import validate_callable
    from adarl.train.build import missing_packages
    from adarl.train.checkpoint import list_checkpoints

    if run_dir.exists() and not run_dir.is_dir():
        raise RecipeError(f"--run-dir {run_dir}: a file is there, not a directory")
    if not resume and list_checkpoints(run_dir / "checkpoints"):  # complete ones only: a torn *.tmp is no run
        raise RecipeError(f"{run_dir} already holds a run: resume it with --resume {run_dir}, "
                          "or choose another --run-dir")
    metrics = run_dir / "metrics.jsonl"
    if not resume and metrics.is_file() and metrics.stat().st_size:  # a run stopped before its first checkpoint
        raise RecipeError(f"{run_dir} holds the metrics of an earlier run that left no checkpoint to resume; a new "
                          "run there would append its rows to them: choose another --run-dir, or delete that one")
    for r in recipe.rewards:
        if r.type == "callable" and r.function:
            validate_callable(r.function)
    if missing := missing_packages(recipe.rollout, recipe.cluster):
        raise RecipeError("; ".join(missing))
    if recipe.rollout.agent is not None:  # its module imported in a worker, under a deadline, before any model
        from adarl.rollout.tools import validate_environment

        try:
            validate_environment(recipe.rollout.agent.environment)
        except ValueError as err:
            raise RecipeError(str(err)) from None
    check_files(recipe, source)
    return check_groups(recipe)
