"""The Python API: what the command line does, from a notebook or a script.

    from adarl import api

    recipe = api.load_recipe("recipes/quickstart.yaml", {"budget.max_steps": 5})
    last = api.train(recipe, run_dir="runs/notebook", callbacks=[print_reward])
    scores = api.evaluate("runs/notebook", k=[1, 4])
    table = api.compare(["a.yaml", "b.yaml"], seeds=3, budget_tokens=6000, out="runs/cmp")

Input is checked as the CLI checks it, with the same messages: a bad recipe or option raises
`RecipeError` (or `ValueError`) before any model loads and before anything is written. What the CLI
prints as `warning: ...` (a token budget below one full step: its first step's groups are trimmed) is a
`UserWarning` here. As the CLI does, `train` and `evaluate` hide vLLM's start-up notices that say
nothing a user can act on (`adarl.quiet`); `train` says so in one line on stderr.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from adarl.config import Recipe, RecipeError
from adarl.config import load_recipe as _load
from adarl.preflight import check_run
from adarl.quiet import quiet_start, start_note


def load_recipe(source: str | Path | dict[str, Any] | Recipe,
                overrides: dict[str, Any] | Sequence[str] | None = None) -> Recipe:
    """A validated recipe from a YAML file, a dict or a recipe, with dotted-key overrides
    (`{"train.lr": 1e-5}` or `["train.lr=1e-5"]`)."""
    if isinstance(source, Recipe):
        source = source.model_dump(mode="json")
    if isinstance(source, dict):
        return _load(data=source, overrides=overrides)
    return _load(source, overrides)


def train(recipe: str | Path | dict[str, Any] | Recipe, run_dir: str | Path | None = None, *,
          overrides: dict[str, Any] | Sequence[str] | None = None, resume: bool = False,
          callbacks: Sequence[Any] = ()) -> dict[str, Any]:
    """Train (or, with `resume`, continue the run in `run_dir`); the last metrics row.

    `callbacks`: objects with any of `on_step(step, row)`, `on_eval(step, metrics)`,
    `on_checkpoint(step, path)`, or plain functions called as `on_step`. Returning True from
    `on_step` or `on_eval` stops training after that step (checkpoint and `final/` are written).

    A budget too small for one step's groups of two raises `RecipeError`; one below a full step warns
    (`UserWarning`, the CLI's `warning: ...` line) and trains with the first step's groups trimmed.
    """
    from adarl.train.trainer import Trainer

    quiet_start()
    if resume:
        if run_dir is None:
            raise RecipeError("resume needs the run directory")
        loaded = load_recipe(Path(run_dir) / "config.yaml", overrides)
    else:
        loaded = load_recipe(recipe, overrides)
    target = Path(run_dir) if run_dir is not None else Path("runs") / loaded.name
    for warning in check_run(loaded, target, resume):
        warnings.warn(warning, UserWarning, stacklevel=2)
    if loaded.cluster.learner_ranks > 1:  # the CLI starts and watches them (train/ray_ranks.py)
        raise RecipeError(f"cluster.learner_ranks {loaded.cluster.learner_ranks}: learner ranks on Ray start from "
                          "the command line (`adarl train RECIPE`); here set cluster.learner_ranks 1")
    if note := start_note(loaded):
        print(note, file=sys.stderr)
    return Trainer(loaded, target).run(resume=resume, callbacks=callbacks)


def evaluate(model_or_run: str | Path, tasks: Sequence[str] = (), *, k: Sequence[int] = (1,),
             n: int | None = None, size: int | None = None, seed: int = 0, backend: str | None = None,
             out: str | Path | None = None) -> dict[str, Any]:
    """Held-out pass@k (unbiased), avg@k and greedy pass@1, as `adarl eval`; the JSON-ready result.

    `tasks`: recipe files or reasoning-gym generator names (default: the run's own task)."""
    from adarl import evaluate as ev

    quiet_start()
    ks = ev.parse_ks(",".join(str(x) for x in k))
    target = ev.resolve_target(str(model_or_run))
    resolved = ev.resolve_tasks(list(tasks), target, None)
    result = ev.run_eval(target, resolved, ks=ks, n=n, size=size, seed=seed, backend=backend)
    if out is not None:
        ev.write_json(result.data, Path(out))
    return result.data


def compare(recipes: Sequence[str | Path], *, budget_tokens: int, seeds: int = 5, out: str | Path | None = None,
            overrides: Sequence[str] = (), **options: Any) -> dict[str, Any]:
    """Train every recipe with every seed at one token budget and aggregate them, as `adarl compare`
    (`options`: the other keyword arguments of `adarl.compare.compare`); a budget below one full step of a
    recipe warns (`UserWarning`), as in `train`."""
    from adarl import compare as cmp

    if budget_tokens < 1 or seeds < 1:
        raise ValueError(f"budget_tokens and seeds must be at least 1, got {budget_tokens} and {seeds}")
    for r in recipes:
        for rw in load_recipe(r, list(overrides)).rewards:
            if rw.type == "callable" and rw.function:
                from adarl.rewards import validate_callable

                validate_callable(rw.function)
    names = [Path(r).stem for r in recipes]
    target = Path(out) if out is not None else Path("runs") / ("compare-" + "-vs-".join(names))
    options.setdefault("warn", lambda w: warnings.warn(w, UserWarning, stacklevel=2))
    return cmp.compare([Path(r) for r in recipes], seeds, budget_tokens, target, extra=list(overrides), **options)
