"""The `adarl` command line: train (and, as they land, eval, compare, report)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="adarl: adaptive, budgeted RL post-training for language models.")


def _fail(message: str) -> None:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code=2)


@app.callback()
def main() -> None:
    # adarl never touches a model hub at run time
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@app.command()
def train(
    recipe: Annotated[str | None, typer.Argument(help="recipe YAML file")] = None,
    overrides: Annotated[list[str] | None, typer.Argument(help="dotted.key=value overrides")] = None,
    run_dir: Annotated[Path | None, typer.Option("--run-dir", help="where the run is written")] = None,
    resume: Annotated[Path | None, typer.Option("--resume", help="continue the run in this directory")] = None,
) -> None:
    """Train with RL on a recipe, or resume a run directory."""
    from adarl.config import RecipeError, load_recipe

    try:
        if resume is not None and recipe is not None and "=" in recipe:
            overrides, recipe = [recipe, *(overrides or [])], None
        if resume is not None:
            if recipe is not None:
                _fail("give either a recipe or --resume RUN_DIR, not both")
            config = resume / "config.yaml"
            if not config.is_file():
                _fail(f"--resume {resume}: no config.yaml there (is it a run directory?)")
            loaded = load_recipe(config, overrides or [])
            target = resume
        else:
            if recipe is None:
                _fail("missing recipe: adarl train RECIPE.yaml [key=value ...]")
            loaded = load_recipe(recipe, overrides or [])
            target = run_dir or Path("runs") / loaded.name
            if (target / "checkpoints").exists() and any((target / "checkpoints").iterdir()):
                _fail(f"{target} already holds a run: resume it with --resume {target}, "
                      "or choose another --run-dir")
        from adarl.rewards import validate_callable

        for r in loaded.rewards:
            if r.type == "callable" and r.function:
                validate_callable(r.function)
    except RecipeError as err:
        _fail(str(err))
    except (ValueError, ImportError) as err:
        _fail(str(err))

    from adarl.train.trainer import Trainer

    try:
        trainer = Trainer(loaded, target)
    except (FileNotFoundError, ValueError) as err:
        _fail(str(err))
    last = trainer.run(resume=resume is not None)
    keys = [k for k in ("step", "tokens", "reward", "pass_rate", "eval/pass@1") if k in last]
    typer.echo("done: " + ", ".join(f"{k}={last[k]:.4g}" if isinstance(last[k], float) else f"{k}={last[k]}"
                                   for k in keys) + f"  (run directory: {target})")


if __name__ == "__main__":
    sys.exit(app())
