"""`adarl compare`: several recipes, several seeds, one generated-token budget; then aggregate.

Every (recipe, seed) is an ordinary `adarl train` run in ``OUT/<recipe-name>/seed<k>/`` with the
overrides ``seed=k budget.max_tokens=N budget.max_steps=null``, started as its own process so a
crash of one run never stops the comparison. The training seed varies sampling and the order
prompts are drawn in; ``task.data_seed`` (the same for every run) fixes the problems, so every
run is scored on the same held-out set. Invoked again, a comparison picks up where it was: a
finished run (it has ``final/``) is skipped, a run with a checkpoint is resumed with
``adarl train --resume``, a run that died before its first checkpoint is started over.

The summaries, the aggregation and the tables are `adarl.comparison`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from adarl.comparison import aggregate, fmt_tokens, pick_baseline, summarize_run
from adarl.runs import COMPARISON_FILE

PASS1 = "eval/pass@1"
TARGET_GAIN = 0.1
EVAL_POINTS = 10  # evaluations at fixed sampled-token points over the budget (plan)


# ---------------------------------------------------------------- running


@dataclass
class Job:
    recipe: Path
    name: str
    seed: int
    run_dir: Path
    overrides: list[str]


def run_state(run_dir: Path) -> str:
    """``done`` (has final/), ``resume`` (has a checkpoint) or ``fresh``."""
    from adarl.train import checkpoint

    if (run_dir / "final").is_dir():
        return "done"
    if checkpoint.latest(run_dir / "checkpoints") is not None:
        return "resume"
    return "fresh"


def plan(recipes: Sequence[str | Path], seeds: Sequence[int], budget_tokens: int, out: Path,
         extra: Sequence[str] = (), eval_points: int = EVAL_POINTS,
         warn: Callable[[str], None] = lambda _: None) -> list[Job]:
    """One job per (recipe, seed); every recipe is validated first (RecipeError on a problem), its files
    (`preflight.check_files`) and its budget too (`preflight.check_groups`: refused when too small for one step of its
    groups; `warn` told when it trims them).

    `eval_points` > 0: every run evaluates where its sampled tokens first reach each multiple of
    budget / `eval_points` (`eval.every_tokens`, `eval.every: 0`), so every recipe's curve and AUC rest on
    the same token points whatever its tokens per step; 0 keeps each recipe's `eval.every` (steps). An
    `eval.*` key in `extra` still wins."""
    from adarl.config import RecipeError, load_recipe
    from adarl.preflight import check_files, check_groups

    names: list[str] = []
    loaded = []
    data_seeds = []
    points = [f"eval.every_tokens={max(1, budget_tokens // eval_points)}", "eval.every=0"] if eval_points else []
    for path in recipes:
        base = [*points, *extra, f"budget.max_tokens={budget_tokens}", "budget.max_steps=null"]
        recipe = load_recipe(path, base)
        check_files(recipe, path)
        for warning in check_groups(recipe, "--budget-tokens"):
            warn(warning)
        loaded.append((Path(path), base))
        names.append(recipe.name)
        data_seeds.append(recipe.task.data_seed)
    if len(set(data_seeds)) > 1:  # paired differences need the same held-out problems
        raise RecipeError(f"the recipes set different task.data_seed values ({data_seeds}), so they would be "
                          "scored on different held-out problems; give them one, e.g. --set task.data_seed=0")
    for i, (path, _) in enumerate(loaded):  # the directory names must differ
        if names.count(names[i]) > 1:
            names[i] = path.stem
    for i in range(len(names)):
        if names.count(names[i]) > 1:
            names[i] = f"{names[i]}-{i + 1}"
    if len(set(names)) != len(names):
        raise RecipeError(f"recipes need distinct names: {names}")
    jobs = []
    for (path, base), name in zip(loaded, names, strict=True):
        for seed in seeds:
            jobs.append(Job(path, name, seed, Path(out) / name / f"seed{seed}", [f"seed={seed}", *base]))
    return jobs


def command(job: Job, state: str) -> list[str]:
    """The `adarl train` command line of a job (a fresh start, or a resume)."""
    cli = [sys.executable, "-m", "adarl.cli", "train"]
    if state == "resume":
        return [*cli, "--resume", str(job.run_dir)]
    return [*cli, str(job.recipe), *job.overrides, "--run-dir", str(job.run_dir)]


def _run_logged(cmd: list[str], log_path: str, cwd: str, env: dict[str, str]) -> int:
    with open(log_path, "a", encoding="utf-8") as log:
        log.write(f"\n$ {' '.join(cmd)}\n")
        log.flush()
        return subprocess.call(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                               stdin=subprocess.DEVNULL)


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def prepare(job: Job) -> str:
    """The job's state; a run that never reached a checkpoint is cleared so it starts over cleanly."""
    state = run_state(job.run_dir)
    if state == "fresh" and job.run_dir.exists():
        log = job.run_dir / "train.log"
        kept = log.read_text(errors="replace") if log.is_file() else ""
        shutil.rmtree(job.run_dir)
        job.run_dir.mkdir(parents=True)
        if kept:
            log.write_text(kept)
    job.run_dir.mkdir(parents=True, exist_ok=True)
    return state


def run_jobs(jobs: Sequence[Job], echo: Callable[[str], None] = print, ray_address: str | None = None,
             runner: Callable[[list[str], str, str, dict[str, str]], int] = _run_logged,
             keep_checkpoints: bool = False) -> dict[Path, str]:
    """Run every job that is not done; returns ``{run dir: skipped | finished | resumed | failed (rc)}``."""
    status: dict[Path, str] = {}
    todo: list[tuple[Job, str]] = []
    for job in jobs:
        state = prepare(job)
        if state == "done":
            status[job.run_dir] = "skipped"
            echo(f"{job.name} seed {job.seed}: finished before, skipped")
        else:
            todo.append((job, state))
    env = dict(os.environ)
    cwd = os.getcwd()
    if ray_address is not None and todo:
        return {**status, **_run_on_ray(todo, ray_address, env, cwd, echo, keep_checkpoints)}
    for i, (job, state) in enumerate(todo, 1):
        what = "resuming" if state == "resume" else "training"
        echo(f"[{i}/{len(todo)}] {job.name} seed {job.seed}: {what} in {job.run_dir} (log: train.log)")
        t0 = time.perf_counter()
        rc = runner(command(job, state), str(job.run_dir / "train.log"), cwd, env)
        status[job.run_dir] = _outcome(job, state, rc, time.perf_counter() - t0, echo, keep_checkpoints)
    return status


def drop_checkpoints(run_dir: Path) -> int:
    """Delete a finished run's ``checkpoints/``; the bytes freed."""
    folder = run_dir / "checkpoints"
    size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) if folder.is_dir() else 0
    shutil.rmtree(folder, ignore_errors=True)
    return size


def _outcome(job: Job, state: str, rc: int, seconds: float, echo: Callable[[str], None],
             keep_checkpoints: bool = False) -> str:
    from adarl.metrics.progress import format_duration

    if rc == 0 and run_state(job.run_dir) == "done":
        s = summarize_run(job.run_dir, job.seed)
        p1 = f", final pass@1 {s.final_pass1:.3f}" if s.final_pass1 is not None else ""
        freed = "" if keep_checkpoints else f"; deleted checkpoints/ ({drop_checkpoints(job.run_dir) / 2**30:.2f} GiB)"
        echo(f"    done in {format_duration(seconds)}: {fmt_tokens(s.tokens)} tokens, {s.steps} steps{p1}{freed}")
        return "resumed" if state == "resume" else "finished"
    echo(f"    FAILED (exit code {rc}); last lines of {job.run_dir / 'train.log'}:\n{_tail(job.run_dir / 'train.log')}")
    return f"failed ({rc})"


def _run_on_ray(todo: list[tuple[Job, str]], address: str, env: dict[str, str], cwd: str,
                echo: Callable[[str], None], keep_checkpoints: bool = False) -> dict[Path, str]:
    """Each run as a Ray task (one CPU each); the comparison directory must be on a shared filesystem."""
    try:
        import ray
    except ImportError:
        raise RuntimeError("--ray needs the ray package (pip install 'adarl[ray]')") from None
    ray.init(address=address, ignore_reinit_error=True, log_to_driver=False)
    remote = ray.remote(num_cpus=1)(_run_logged)
    refs = {remote.remote(command(job, state), str(job.run_dir / "train.log"), cwd, env): (job, state)
            for job, state in todo}
    echo(f"submitted {len(refs)} runs to Ray at {address}")
    status: dict[Path, str] = {}
    t0 = time.perf_counter()
    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        job, state = refs[ready[0]]
        echo(f"{job.name} seed {job.seed}:")
        status[job.run_dir] = _outcome(job, state, ray.get(ready[0]), time.perf_counter() - t0, echo,
                                       keep_checkpoints)
    return status


def write_comparison(out: Path, result: dict[str, Any]) -> Path:
    path = Path(out) / COMPARISON_FILE
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    tmp.replace(path)
    return path


def compare(recipes: Sequence[str | Path], seeds: int, budget_tokens: int, out: Path, *, extra: Sequence[str] = (),
            target: float | None = None, target_gain: float = TARGET_GAIN, baseline: str | None = None,
            ray_address: str | None = None, echo: Callable[[str], None] = print,
            keep_checkpoints: bool = False, eval_points: int = EVAL_POINTS,
            warn: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Run (or resume) the comparison, then aggregate it into ``OUT/comparison.json`` (`warn`: as `plan`'s)."""
    out = Path(out)
    jobs = plan(recipes, range(seeds), budget_tokens, out, extra, eval_points, warn)
    names = list(dict.fromkeys(j.name for j in jobs))
    paths = [str(next(j.recipe for j in jobs if j.name == n)) for n in names]
    base = pick_baseline(names, baseline, paths)
    out.mkdir(parents=True, exist_ok=True)
    header = {"budget_tokens": budget_tokens, "seeds": list(range(seeds)), "extra_overrides": list(extra),
              "eval_points": eval_points,
              "baseline": base, "target": {"pass@1": target, "gain": None if target is not None else target_gain},
              "recipes": [{"name": n, "path": p} for n, p in zip(names, paths, strict=True)]}
    write_comparison(out, header)  # the recipe order and settings, for an interrupted comparison's report
    status = run_jobs(jobs, echo=echo, ray_address=ray_address, keep_checkpoints=keep_checkpoints)
    groups = {n: [summarize_run(j.run_dir, j.seed) for j in jobs if j.name == n] for n in names}
    result = aggregate(groups, target, budget_tokens, baseline=base, target_gain=target_gain)
    for rec, meta in zip(result["recipes"], header["recipes"], strict=True):
        rec["path"] = meta["path"]
        for run in rec["runs"]:
            run["this_invocation"] = status.get(Path(run["dir"]))
    result = {**header, **result, "recipes": result["recipes"]}
    write_comparison(out, result)
    return result
