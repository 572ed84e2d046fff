"""The `adarl` command line: train, sft, eval, compare, report."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from typer.core import TyperCommand, TyperGroup

from adarl.quiet import quiet_start, start_note

if TYPE_CHECKING:
    import click
    from rich.console import Console
    from rich.table import Table



#: the word `--help` shows after an option, by the type typer 0.29 would show (`<int range>`, `<list[str]>`)
METAVARS = {"int": "N", "int range": "N", "float": "X", "float range": "X", "path": "PATH", "str": "TEXT"}


class _BareFlags:
    """`--help` in plain words: nothing after an on/off flag (typer 0.29 prints `<bool>` beside each, `--help`
    too), a word for the value an option takes (`--seeds N`), an argument by its name (`RECIPES...`)."""

    def get_params(self, ctx: click.Context) -> list[click.Parameter]:
        params = super().get_params(ctx)  # type: ignore[misc]
        for param in params:
            if getattr(param, "is_flag", False):
                param.metavar = ""
            elif param.param_type_name == "argument":
                param.metavar = (param.name or "").upper()
                param.display_type_rich = lambda ctx: None  # type: ignore[method-assign]  # not `RECIPE <str>`
            elif param.metavar is None and hasattr(param, "display_type"):
                shown = str(param.display_type(ctx) or "").strip("<>").removeprefix("list[").removesuffix("]")
                param.metavar = METAVARS.get(shown.lower())
        return params


class _Command(_BareFlags, TyperCommand):
    pass


class _Group(_BareFlags, TyperGroup):
    def main(self, args: list[str] | None = None, prog_name: str | None = None, complete_var: str | None = None,
             standalone_mode: bool = True, **extra: Any) -> Any:
        """As click's, with a usage error (a missing option, a bad value, an unknown command) in the one style of
        every adarl error, `error: ...` on one line, instead of a boxed `Error` panel."""
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        try:
            code = super().main(args, prog_name, complete_var, False, **extra)
        except Exception as err:  # click's classes, or typer's vendored copy of them (typer >= 0.29): by name
            kinds = {c.__name__ for c in type(err).__mro__}
            if "NoArgsIsHelpError" in kinds or "UsageError" not in kinds:
                if "ClickException" not in kinds and "Abort" not in kinds:
                    raise
                if "Abort" in kinds:
                    typer.echo("Aborted!", err=True)
                else:
                    err.show()  # type: ignore[attr-defined]
                sys.exit(getattr(err, "exit_code", 1))
            where = err.ctx.command_path if getattr(err, "ctx", None) else "adarl"  # type: ignore[attr-defined]
            typer.secho(f"error: {err.format_message()} (see {where} --help)",  # type: ignore[attr-defined]
                        fg=typer.colors.RED, err=True)
            sys.exit(2)
        sys.exit(code if isinstance(code, int) else 0)


app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False, cls=_Group,
                  rich_markup_mode=None,
                  help="adarl: adaptive, budgeted RL post-training for language models.")


def _version(value: bool) -> None:
    if value:
        from adarl import __version__

        typer.echo(f"adarl {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="print adarl's version and exit")] = False,
) -> None:
    """adarl: adaptive, budgeted RL post-training for language models."""
    quiet_start()
    if not sys.stderr.isatty():  # piped to a log: no progress bars (transformers reads this when it loads)
        import os

        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def _fail(message: str) -> None:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code=2)


def print_table(table: Table, console: Console | None = None) -> None:
    """A table with every cell in full: drawn when it fits the console's width (a terminal's, else COLUMNS, else
    80), otherwise stacked, a block per row of `column  value` lines, never a cell cut to `0.…`."""
    from rich.console import Console

    console = console or Console()
    if Console(width=100_000).measure(table).maximum <= console.width:
        console.print(table)
        return
    header = [str(c.header) for c in table.columns]
    width = max(map(len, header[1:]), default=0)
    lines = [str(table.title)] if table.title else []
    for row in zip(*(list(c.cells) for c in table.columns), strict=True):
        lines.append(f"  {row[0]}")
        lines += [f"    {h:<{width}}  {v}" for h, v in zip(header[1:], row[1:], strict=True)]
    console.print("\n".join(lines), markup=False, highlight=False, soft_wrap=True)


def _run(loaded, target: Path, resume: bool) -> dict:
    """Build the trainer and run it; its errors as the CLI reports them."""
    from adarl.train.trainer import NonFiniteUpdates, ResumeError, Trainer

    try:
        trainer = Trainer(loaded, target)
    except (FileNotFoundError, ValueError) as err:
        _fail(str(err))
    try:
        return trainer.run(resume=resume)
    except NonFiniteUpdates as err:  # a diverged run: a usable checkpoint was saved; exit code 3
        typer.secho(f"error: {err}", fg=typer.colors.RED, err=True)
        raise typer.Exit(code=3) from None
    except ResumeError as err:
        _fail(str(err))


@app.command(cls=_Command)
def train(
    recipe: Annotated[str | None, typer.Argument(help="recipe YAML file, or a built-in recipe's name")] = None,
    overrides: Annotated[list[str] | None, typer.Argument(help="dotted.key=value overrides")] = None,
    run_dir: Annotated[Path | None, typer.Option("--run-dir", help="where the run is written")] = None,
    resume: Annotated[Path | None, typer.Option("--resume", help="continue the run in this directory")] = None,
    trust_checkpoint_pickles: Annotated[bool, typer.Option(
        "--trust-checkpoint-pickles",
        help="load checkpoints that hold pickled Python objects (an older adarl's); loading them can run "
             "code, so only for run directories you trust")] = False,
) -> None:
    """Train with RL on a recipe, or resume a run directory."""
    from adarl.config import RecipeError, load_recipe

    if trust_checkpoint_pickles:  # read where checkpoint files are loaded (train/checkpoint.py: `read`)
        import os

        from adarl.train.checkpoint import TRUST_ENV

        os.environ[TRUST_ENV] = "1"
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
        from adarl.preflight import check_run

        # the same checks as the Python API's train
        for warning in check_run(loaded, target, resume is not None, None if resume is not None else recipe):
            typer.secho(f"warning: {warning}", fg=typer.colors.YELLOW, err=True)
        if note := start_note(loaded):  # what quiet_start hid, in one line
            typer.echo(note, err=True)
    except RecipeError as err:
        _fail(str(err))
    except (ValueError, ImportError) as err:
        _fail(str(err))

    from adarl.train.control import RankFailure

    ranks = None
    if loaded.train.parallel == "fsdp2":  # under torchrun: rank 0 runs the trainer, the others its learner calls
        from adarl.train import sharded
        from adarl.train.build import follow

        if loaded.cluster.learner_ranks > 1:  # this process is rank 0; ranks 1..N-1 are Ray actors
            from adarl.train.ray_ranks import RayLearnerRanks

            try:
                ranks = RayLearnerRanks(loaded)
            except (RuntimeError, ValueError, ImportError) as err:
                _fail(str(err))
        if sharded.init_distributed(loaded.model.device, loaded.train.collective_timeout_s,
                                    loaded.train.heartbeat_timeout_s) != 0:
            try:
                follow(loaded)
            except (RankFailure, FileNotFoundError, ValueError, ImportError) as err:  # rank 0 says it too
                _fail(str(err) if isinstance(err, RankFailure) else f"rank {sharded.rank()}: {err}")
            finally:
                sharded.end_distributed()
            return
    try:
        last = _run(loaded, target, resume is not None)
    except RankFailure as err:  # a learner rank died or hangs (train/control.py)
        _fail(f"{err}\nThe last complete checkpoint is intact: continue with adarl train --resume {target}")
    finally:
        if ranks is not None:  # released, awaited and freed; a rank that failed is named with its own error
            if failure := ranks.close():
                _fail(failure)
        elif loaded.train.parallel == "fsdp2":
            sharded.release_followers()  # also when rank 0 failed before or during its run
            sharded.end_distributed()
    keys = [k for k in ("step", "tokens", "reward", "pass_rate", "eval/pass@1") if k in last]
    typer.echo("done: " + ", ".join(f"{k}={last[k]:.4g}" if isinstance(last[k], float) else f"{k}={last[k]}"
                                   for k in keys) + f"  (run directory: {target})")
    report = Path(target) / "report.html"
    if report.is_file():
        typer.echo(f"report: {report}")
    from adarl.metrics.health import check, selector_of
    from adarl.runs import read_config, read_metrics

    for flag in check(read_metrics(Path(target)), selector=selector_of(read_config(Path(target)))):
        typer.secho(f"health: {flag}", fg=typer.colors.YELLOW)


@app.command(cls=_Command, short_help="Supervised fine-tuning (OTR or NLL) on a recipe's task.")
def sft(
    recipe: Annotated[str, typer.Argument(help="recipe YAML file (model, task, train, budget.max_steps)")],
    overrides: Annotated[list[str] | None, typer.Argument(help="dotted.key=value overrides")] = None,
    objective: Annotated[str, typer.Option("--objective", help="otr (One-Token Rollout) or nll")] = "otr",
    k: Annotated[int, typer.Option("--k", min=1, help="OTR: candidate tokens sampled per position")] = 8,
    steps: Annotated[int | None, typer.Option("--steps", min=1, help="default: budget.max_steps")] = None,
    run_dir: Annotated[Path | None, typer.Option("--run-dir", help="where the run is written")] = None,
    target: Annotated[str, typer.Option("--target", help="what to imitate: the answer, or a text column "
                                        "such as solution (a worked solution)")] = "answer",
) -> None:
    """Supervised fine-tuning on the task's (prompt, answer) pairs, or prompt → a text column such as a
    worked solution (--target); an agent recipe: its environment's demonstration trajectories, tool
    turns masked. With OTR or plain NLL."""
    from adarl.config import RecipeError, load_recipe

    if objective not in ("otr", "nll"):
        _fail(f"--objective must be 'otr' or 'nll', got {objective!r}")
    try:
        loaded = load_recipe(recipe, overrides or [])
    except RecipeError as err:
        _fail(str(err))
    from adarl.train.sft import run_sft

    out = run_dir or Path("runs") / f"{loaded.name}-sft-{objective}"
    try:
        last = run_sft(loaded, out, objective, steps=steps, k=k, target=target)  # type: ignore[arg-type]
    except (FileNotFoundError, ValueError) as err:
        _fail(str(err))
    typer.echo(f"done: step={last.get('step')}, loss={last.get('loss', float('nan')):.4g}, "
               f"target_logprob={last.get('target_logprob', float('nan')):.4g}  (run directory: {out})")


EVAL_HELP = (
    "Held-out pass@k (unbiased estimator), avg@k, greedy pass@1 and mean length of a model, run or checkpoint."
    "\n\n"
    "Every held-out problem of each task gets one greedy completion and N sampled ones (with the run's or "
    "recipe's rollout settings). pass@k is 1 - C(n-c, k) / C(n, k) averaged over problems; avg@k is the mean "
    "accuracy of the first k samples. Prints a table (one row per task) and writes JSON with per-problem c/n."
)

COMPARE_HELP = (
    "Train each recipe with each seed under the same generated-token budget, then aggregate."
    "\n\n"
    "Each run is `adarl train RECIPE seed=K budget.max_tokens=N budget.max_steps=null` in its own process, "
    "in OUT/<recipe name>/seed<K>/. Run the same command again to continue an interrupted comparison: "
    "finished runs are skipped, runs with a checkpoint are resumed, others start over."
    "\n\n"
    "Runs go one after another on this machine. With --ray ADDRESS (the ray package installed, OUT on a "
    "filesystem every node sees) each run is a Ray task with one CPU."
    "\n\n"
    "Every run trains on the same problems and is scored on the same held-out set (task.data_seed); the "
    "training seed varies sampling and order only."
    "\n\n"
    "Prints tables and writes OUT/comparison.json: per recipe, held-out pass@1 at the budget (each seed's "
    "curve, linear between evals, read at the budget), the normalised area under that curve, the generated "
    "tokens to reach each seed's start + --target-gain (or --target), final pass@1, tokens, steps, wall time, "
    "each with a 95% t-interval over seeds; per other recipe, the per-seed differences to the baseline with "
    "their interval and wins/losses/ties (better or worse only when the interval excludes 0); per run, its "
    "pass@1 with a Wilson 95% interval and its health flags. Then OUT/report.html."
)

REPORT_HELP = (
    "Write RUN_OR_COMPARISON/report.html: one self-contained page (plots embedded, no network)."
    "\n\n"
    "Learning curves against generated tokens (mean and min-max band over seeds), pass@k curves (from "
    "`adarl eval` JSON in the run), response lengths, entropy, zero-variance fraction, rollouts per prompt, "
    "prompt x step heat maps of difficulty and allocation (when the run has a prompts.jsonl) and the resolved "
    "recipes side by side."
)


@app.command("eval", help=EVAL_HELP, cls=_Command, short_help="Held-out pass@k, avg@k and greedy pass@1.")
def eval_(
    model_or_run: Annotated[str, typer.Argument(
        help="a model (alias such as smollm2-135m, HF folder, .gguf file), a run directory (its final/ "
             "model, else its latest checkpoint) or a checkpoint directory (checkpoints/step_N)")],
    task: Annotated[list[str] | None, typer.Option(
        "--task", help="a recipe YAML (its task and rewards) or a reasoning-gym generator name (scored with "
                       "the default short_answer reward); repeat for several tasks. Default: the run's own "
                       "task")] = None,
    k: Annotated[str, typer.Option("--k", help="k values for pass@k and avg@k, comma-separated")] = "1,4,16",
    n: Annotated[int | None, typer.Option("--n", min=0, max=100_000, help="sampled completions per problem "
                                                              "(default: the largest k; 0: greedy only)")] = None,
    size: Annotated[int | None, typer.Option("--size", min=1, help="evaluate only the first SIZE held-out "
                                                                   "problems of each task (default: all)")] = None,
    out: Annotated[Path | None, typer.Option(
        "--out", help="JSON file to write (default for a run: RUN/eval.json; for a checkpoint: "
                      "RUN/eval_step_N.json; for a bare model: none)")] = None,
    seed: Annotated[int, typer.Option("--seed", min=0, max=2**63 - 1, help="sampling seed")] = 0,
    task_seed: Annotated[int | None, typer.Option("--task-seed", min=0, max=2**63 - 1,
                                                  help="seed of the task's train/held-out split "
                                                       "(task.data_seed; default: the run's, else 0)")] = None,
    temperature: Annotated[float | None, typer.Option("--temperature", min=0.0, max=100.0,
                                                      help="default: the run's or recipe's "
                                                           "rollout.temperature")] = None,
    max_new_tokens: Annotated[int | None, typer.Option("--max-new-tokens", min=1, max=1_000_000)] = None,
    threads: Annotated[int | None, typer.Option("--threads", min=1, max=1024, help="torch threads")] = None,
    backend: Annotated[str | None, typer.Option(
        "--backend", help="generation backend: hf, vllm or auto (vllm when installed). Default: the run's or "
                          "recipe's rollout.backend")] = None,
) -> None:
    from adarl import evaluate as ev
    from adarl.config import RecipeError
    from adarl.engines import ENGINES

    if backend not in (None, *ENGINES, "auto"):
        _fail(f"--backend {backend}: choose {', '.join(sorted(ENGINES))} or auto")
    try:
        ks = ev.parse_ks(k)
        target = ev.resolve_target(model_or_run)
        tasks = ev.resolve_tasks(task or [], target, task_seed)
        for t in tasks:
            for r in t.rewards:
                if r.type == "callable" and r.function:
                    from adarl.rewards import validate_callable

                    validate_callable(r.function)
        if n is not None and n > 0 and max(ks) > n:
            _fail(f"pass@{max(ks)} needs at least {max(ks)} samples per problem; got --n {n}")
    except (RecipeError, ValueError, FileNotFoundError, ImportError) as err:
        _fail(str(err))
    typer.echo(f"evaluating {target.describe()} on {', '.join(t.name for t in tasks)}", err=True)
    try:
        result = ev.run_eval(target, tasks, ks=ks, n=n, size=size, seed=seed, temperature=temperature,
                             max_new_tokens=max_new_tokens, threads=threads, backend=backend)
    except (ValueError, FileNotFoundError, ImportError) as err:
        _fail(str(err))
    print_table(ev.table(result.data))
    for name, summary in result.data["tasks"].items():
        greedy, sampled = summary.get("greedy_censored", 0), summary.get("censored_fraction", 0.0)
        if greedy or sampled:
            what = " and ".join([f"{greedy} greedy"] * bool(greedy) + [f"{sampled:.1%} of the sampled"] * bool(sampled))
            typer.echo(f"warning: {name}: {what} trajectories were censored (the environment failed, or a call "
                       "ran past rollout.agent.tool_timeout_s) and are scored wrong", err=True)
    path = out or ev.default_out(target)
    if path is not None:
        ev.write_json(result.data, path)
        typer.echo(f"wrote {path}")


@app.command(help=COMPARE_HELP, cls=_Command, short_help="Recipes × seeds at one token budget, compared.")
def compare(
    recipes: Annotated[list[Path], typer.Argument(help="recipe YAML files; the first is the baseline")],
    budget_tokens: Annotated[int, typer.Option("--budget-tokens", min=1, max=10**15,
                                               help="generated tokens each run may spend (budget.max_tokens)")],
    seeds: Annotated[int, typer.Option("--seeds", min=1, max=1000, help="runs per recipe, with seed=0..SEEDS-1")] = 5,
    out: Annotated[Path | None, typer.Option("--out", help="comparison directory "
                                                            "(default: runs/compare-<recipe names>)")] = None,
    set_: Annotated[list[str] | None, typer.Option("--set", help="dotted.key=value override for every recipe, "
                                                                 "e.g. --set eval.every=2 (repeatable)")] = None,
    target: Annotated[float | None, typer.Option("--target", min=0.0, max=1.0,
                                                 help="one pass@1 for 'tokens to reach target' for every seed "
                                                      "(default: each seed's own start + --target-gain)")] = None,
    target_gain: Annotated[float, typer.Option("--target-gain", min=0.0, max=1.0,
                                               help="the gain over a seed's first eval that is its target")] = 0.1,
    baseline: Annotated[str | None, typer.Option("--baseline", help="the recipe (name or YAML path) the others are "
                                                                    "compared with (default: the first)")] = None,
    ray_address: Annotated[str | None, typer.Option(
        "--ray", help="run the runs as Ray tasks on the cluster at this address (e.g. auto); needs the ray "
                      "package and a shared filesystem")] = None,
    report: Annotated[bool, typer.Option("--report/--no-report", help="write OUT/report.html")] = True,
    eval_points: Annotated[int, typer.Option(
        "--eval-points", min=0, max=10_000,
        help="evaluate every run at the same sampled-token points, budget/N apart (eval.every_tokens); 0 keeps "
             "each recipe's eval.every (steps), which gives a recipe that spends more tokens a step fewer "
             "points")] = 10,
    keep_checkpoints: Annotated[bool, typer.Option(
        "--keep-checkpoints", help="keep each finished run's checkpoints/ (weights + optimizer state, about 3x "
                                   "the model's size); by default only final/ and the metrics are kept")] = False,
) -> None:
    import adarl.compare as cmp
    import adarl.comparison as comparison
    from adarl.config import RecipeError

    if ray_address is not None:
        try:
            import ray  # noqa: F401
        except ImportError:
            _fail("--ray needs the ray package: pip install 'adarl[ray]' (without --ray, runs are sequential)")
        from adarl.cluster import connect

        try:  # the cluster joined before any run is planned: none at the address is one error line
            connect(ray_address)
        except ValueError as err:
            _fail(str(err).replace("cluster.address=", "--ray "))
    try:
        jobs = cmp.plan(recipes, range(seeds), budget_tokens, Path("."), set_ or [], eval_points,
                        warn=lambda w: typer.secho(f"warning: {w}", fg=typer.colors.YELLOW, err=True))
        names = list(dict.fromkeys(j.name for j in jobs))
        comparison.pick_baseline(names, baseline, [str(next(j.recipe for j in jobs if j.name == n)) for n in names])
        for r in recipes:  # fail fast on a callable reward that does not import
            from adarl.config import load_recipe
            from adarl.rewards import validate_callable

            for rw in load_recipe(r, set_ or []).rewards:
                if rw.type == "callable" and rw.function:
                    validate_callable(rw.function)
    except (RecipeError, ValueError, ImportError) as err:
        _fail(str(err))
    out = out or Path("runs") / ("compare-" + "-vs-".join(names))
    typer.echo(f"comparing {', '.join(names)} × {seeds} seed{'s' if seeds > 1 else ''} at "
               f"{budget_tokens} generated tokens each, in {out}")
    result = cmp.compare(recipes, seeds, budget_tokens, out, extra=set_ or [], target=target,
                         target_gain=target_gain, baseline=baseline, ray_address=ray_address, echo=typer.echo,
                         keep_checkpoints=keep_checkpoints, eval_points=eval_points)
    for t in comparison.tables(result):
        print_table(t)
    typer.echo(comparison.NOTES)
    typer.echo(f"wrote {out / cmp.COMPARISON_FILE}")
    if report:
        from adarl.report import write_report

        typer.echo(f"wrote {write_report(out)}")
    failed = [run["dir"] for rec in result["recipes"] for run in rec["runs"] if run["status"] != "finished"]
    if failed:
        typer.secho(f"{len(failed)} run(s) did not finish: {', '.join(failed)}; run the same command again "
                    "to resume them", fg=typer.colors.YELLOW, err=True)
        raise typer.Exit(code=1)


@app.command(cls=_Command, short_help="The recipe's JSON schema, every component's options.")
def schema(
    stage: Annotated[str | None, typer.Argument(help="only this stage's components (e.g. allocate)")] = None,
) -> None:
    """Print the recipe's JSON schema with every registered component's options."""
    import json

    from adarl import registry
    from adarl.config import recipe_schema
    from adarl.config.loader import did_you_mean

    out = recipe_schema()
    if stage is not None:
        if stage not in registry.STAGES:
            _fail(f"unknown stage {stage!r}{did_you_mean(stage, list(registry.STAGES))} (stages: "
                  f"{', '.join(registry.STAGES)})")
        out = out["components"][stage]
    typer.echo(json.dumps(out, indent=1))


@app.command(help=REPORT_HELP, cls=_Command, short_help="A run's or comparison's report.html.")
def report(
    run_or_comparison: Annotated[Path, typer.Argument(help="a run directory or an `adarl compare` directory")],
) -> None:
    from adarl.report import write_report

    try:
        path = write_report(run_or_comparison)
    except (FileNotFoundError, ValueError) as err:
        _fail(str(err))
    typer.echo(f"wrote {path}")


def entry() -> None:
    """The `adarl` command: the app, with a path too long for the system (a 5,000-character argument) as one
    error line instead of an OSError traceback from wherever the path was first touched."""
    import errno

    try:
        app()
    except OSError as err:
        if err.errno != errno.ENAMETOOLONG:
            raise
        from adarl.config.loader import _clip

        name = str(err.filename or "")
        typer.secho(f"error: a path is too long for this system ({len(name):,} characters): {_clip(name)}",
                    fg=typer.colors.RED, err=True)
        sys.exit(2)


if __name__ == "__main__":
    entry()
