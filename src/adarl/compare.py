"""`adarl compare`: several recipes, several seeds, one generated-token budget; then aggregate.

Every (recipe, seed) is an ordinary `adarl train` run in ``OUT/<recipe-name>/seed<k>/`` with the
overrides ``seed=k budget.max_tokens=N budget.max_steps=null``, started as its own process so a
crash of one run never stops the comparison. Invoked again, a comparison picks up where it was:
a finished run (it has ``final/``) is skipped, a run with a checkpoint is resumed with
``adarl train --resume``, a run that died before its first checkpoint is started over.

Aggregation (`aggregate`), per recipe over its finished seeds:
- the final held-out greedy pass@1 (the eval at the run's last step): mean and a 95% Student-t
  interval, mean ± t(0.975, n-1) · s / √n with s the sample standard deviation (ddof 1);
- generated tokens to reach a target pass@1 (default: the first recipe's, the baseline's, final
  mean pass@1): the ``tokens`` of the first eval row at or above it, per seed, and their mean
  over the seeds that reached it;
- wall time, and the tokens and steps actually spent (a run ends within one step of the budget:
  the table shows what each recipe really spent, so an overshoot is visible).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

COMPARISON_FILE = "comparison.json"
PASS1 = "eval/pass@1"

# two-sided 95% quantiles t(0.975, df) of Student's t distribution, df = 1..30
_T975 = (12.7062, 4.3027, 3.1824, 2.7764, 2.5706, 2.4469, 2.3646, 2.3060, 2.2622, 2.2281,
         2.2010, 2.1788, 2.1604, 2.1448, 2.1314, 2.1199, 2.1098, 2.1009, 2.0930, 2.0860,
         2.0796, 2.0739, 2.0687, 2.0639, 2.0595, 2.0555, 2.0518, 2.0484, 2.0452, 2.0423)


def t975(df: int) -> float:
    """t(0.975, df): the table up to 30, then the Cornish–Fisher expansion around z = 1.96."""
    if df < 1:
        raise ValueError("a t interval needs at least 2 values")
    if df <= len(_T975):
        return _T975[df - 1]
    z = 1.959963984540054
    return (z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)
            + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * df**3))


def mean_ci(values: Sequence[float]) -> dict[str, Any]:
    """Mean, sample std and the 95% t interval of `values` (no interval for fewer than 2)."""
    x = np.asarray([v for v in values if v is not None], dtype=np.float64)
    out: dict[str, Any] = {"n": int(x.size), "mean": None, "std": None, "ci95": None}
    if x.size == 0:
        return out
    out["mean"] = float(x.mean())
    if x.size >= 2:
        s = float(x.std(ddof=1))
        half = t975(x.size - 1) * s / math.sqrt(x.size)
        out["std"] = s
        out["ci95"] = [out["mean"] - half, out["mean"] + half]
    return out


# ---------------------------------------------------------------- reading runs

_SEED_DIR = re.compile(r"^seed(\d+)$")


def is_run_dir(path: Path) -> bool:
    return (path / "metrics.jsonl").is_file() or (path / "config.yaml").is_file()


def find_runs(comparison_dir: Path) -> dict[str, list[tuple[int, Path]]]:
    """``{recipe name: [(seed, run dir), ...]}`` of ``DIR/<name>/seed<k>/``, in the comparison's order."""
    comparison_dir = Path(comparison_dir)
    order: list[str] = []
    saved = comparison_dir / COMPARISON_FILE
    if saved.is_file():
        try:
            order = [r["name"] for r in json.loads(saved.read_text()).get("recipes", [])]
        except (json.JSONDecodeError, KeyError, TypeError):
            order = []
    found: dict[str, list[tuple[int, Path]]] = {}
    for d in sorted(p for p in comparison_dir.iterdir() if p.is_dir()):
        runs = sorted((int(m.group(1)), s) for s in d.iterdir() if s.is_dir() and (m := _SEED_DIR.match(s.name))
                      and is_run_dir(s))
        if runs:
            found[d.name] = runs
    names = [n for n in order if n in found] + [n for n in found if n not in order]
    return {n: found[n] for n in names}


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    from adarl.metrics.sinks import MetricsWriter

    return [r for r in MetricsWriter.read(run_dir) if isinstance(r.get("step"), int)]


@dataclass
class RunSummary:
    dir: Path
    seed: int | None
    status: str  # finished | incomplete | not started
    steps: int | None = None
    tokens: int | None = None
    wall_s: float | None = None
    final_pass1: float | None = None  # the eval at the last step of a finished run
    curve: list[tuple[int, float]] | None = None  # (tokens, eval/pass@1), in step order

    def tokens_to(self, target: float) -> int | None:
        for tokens, value in self.curve or []:
            if value >= target - 1e-9:
                return tokens
        return None


def summarize_run(run_dir: Path, seed: int | None = None) -> RunSummary:
    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    finished = (run_dir / "final").is_dir()
    status = "finished" if finished else ("incomplete" if rows else "not started")
    s = RunSummary(run_dir, seed, status)
    if not rows:
        return s
    last = rows[-1]
    s.steps = last["step"]
    s.tokens = last.get("tokens")
    s.wall_s = next((r["wall_s"] for r in reversed(rows) if r.get("wall_s") is not None), None)
    s.curve = [(int(r.get("tokens") or 0), float(r[PASS1])) for r in rows if r.get(PASS1) is not None]
    if finished and last.get(PASS1) is not None:
        s.final_pass1 = float(last[PASS1])
    return s


def aggregate(groups: dict[str, list[RunSummary]], target: float | None = None,
              budget_tokens: int | None = None) -> dict[str, Any]:
    """Per-recipe statistics over seeds (see the module doc); the first recipe is the baseline."""
    recipes = []
    for name, runs in groups.items():
        finished = [r for r in runs if r.status == "finished"]
        recipes.append({
            "name": name,
            "seeds": [r.seed for r in runs],
            "finished": len(finished),
            "final_pass@1": mean_ci([r.final_pass1 for r in finished if r.final_pass1 is not None]),
            "tokens": mean_ci([r.tokens for r in finished if r.tokens is not None]),
            "steps": mean_ci([r.steps for r in finished if r.steps is not None]),
            "wall_s": mean_ci([r.wall_s for r in finished if r.wall_s is not None]),
            "runs": [{"seed": r.seed, "dir": str(r.dir), "status": r.status, "steps": r.steps, "tokens": r.tokens,
                      "wall_s": r.wall_s, "final_pass@1": r.final_pass1} for r in runs],
        })
    target_from = "given"
    if target is None and recipes and recipes[0]["final_pass@1"]["mean"] is not None:
        target, target_from = recipes[0]["final_pass@1"]["mean"], f"baseline {recipes[0]['name']} final mean"
    for rec, runs in zip(recipes, groups.values(), strict=True):
        finished = [r for r in runs if r.status == "finished"]
        per_seed = [r.tokens_to(target) if target is not None else None for r in finished]
        reached = [t for t in per_seed if t is not None]
        rec["tokens_to_target"] = {
            "per_seed": per_seed, "reached": len(reached), "of": len(finished),
            "mean": float(np.mean(reached)) if reached else None,
        }
        for run, t in zip((x for x in rec["runs"] if x["status"] == "finished"), per_seed, strict=True):
            run["tokens_to_target"] = t
    return {
        "budget_tokens": budget_tokens,
        "target": {"pass@1": target, "from": target_from if target is not None else None},
        "recipes": recipes,
    }


def aggregate_dir(comparison_dir: Path, target: float | None = None) -> dict[str, Any]:
    """`aggregate` of the runs found in a comparison directory."""
    comparison_dir = Path(comparison_dir)
    budget = None
    saved = comparison_dir / COMPARISON_FILE
    if saved.is_file():
        try:
            budget = json.loads(saved.read_text()).get("budget_tokens")
        except json.JSONDecodeError:
            budget = None
    groups = {name: [summarize_run(d, seed) for seed, d in runs] for name, runs in find_runs(comparison_dir).items()}
    return aggregate(groups, target, budget)


# ---------------------------------------------------------------- printing


def fmt_tokens(n: float | None) -> str:
    from adarl.metrics.progress import format_count

    return "-" if n is None else format_count(n)


def fmt_ci(stat: dict[str, Any], digits: int = 3) -> str:
    if stat.get("mean") is None:
        return "-"
    text = f"{stat['mean']:.{digits}f}"
    if stat.get("ci95"):
        lo, hi = stat["ci95"]
        text += f" [{lo:.{digits}f}, {hi:.{digits}f}]"
    return text


def fmt_to_target(t: dict[str, Any]) -> str:
    if not t["of"]:
        return "-"
    if not t["reached"]:
        return "not reached"
    text = fmt_tokens(t["mean"])
    return text if t["reached"] == t["of"] else f"{text} ({t['reached']}/{t['of']} seeds)"


def summary_rows(result: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the comparison table (shared by the terminal and the report)."""
    from adarl.metrics.progress import format_duration

    target = result["target"]["pass@1"]
    header = ["recipe", "seeds", "final pass@1 [95% CI]",
              f"tokens to pass@1 ≥ {target:.3f}" if target is not None else "tokens to target",
              "tokens spent", "steps", "wall time"]
    rows = []
    for r in result["recipes"]:
        seeds = f"{r['finished']}/{len(r['seeds'])}"
        wall = format_duration(r["wall_s"]["mean"]) if r["wall_s"]["mean"] is not None else "-"
        steps = f"{r['steps']['mean']:.3g}" if r["steps"]["mean"] is not None else "-"
        rows.append([r["name"], seeds, fmt_ci(r["final_pass@1"]), fmt_to_target(r["tokens_to_target"]),
                     fmt_tokens(r["tokens"]["mean"]), steps, wall])
    return header, rows


def table(result: dict[str, Any]):
    from rich.table import Table

    header, rows = summary_rows(result)
    budget = result.get("budget_tokens")
    title = f"comparison at {fmt_tokens(budget)} generated tokens" if budget else "comparison"
    t = Table(title=title, title_justify="left")
    for i, h in enumerate(header):
        t.add_column(h, justify="left" if i == 0 else "right")
    for row in rows:
        t.add_row(*row)
    return t


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
         extra: Sequence[str] = ()) -> list[Job]:
    """One job per (recipe, seed); every recipe is validated first (RecipeError on a problem)."""
    from adarl.config import RecipeError, load_recipe

    names: list[str] = []
    loaded = []
    for path in recipes:
        base = [*extra, f"budget.max_tokens={budget_tokens}", "budget.max_steps=null"]
        recipe = load_recipe(path, base)
        loaded.append((Path(path), base))
        names.append(recipe.name)
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
            target: float | None = None, ray_address: str | None = None,
            echo: Callable[[str], None] = print, keep_checkpoints: bool = False) -> dict[str, Any]:
    """Run (or resume) the comparison, then aggregate it into ``OUT/comparison.json``."""
    out = Path(out)
    jobs = plan(recipes, range(seeds), budget_tokens, out, extra)
    out.mkdir(parents=True, exist_ok=True)
    names = list(dict.fromkeys(j.name for j in jobs))
    header = {"budget_tokens": budget_tokens, "seeds": list(range(seeds)), "extra_overrides": list(extra),
              "recipes": [{"name": n, "path": str(next(j.recipe for j in jobs if j.name == n))} for n in names]}
    write_comparison(out, header)  # the recipe order, for an interrupted comparison's report
    status = run_jobs(jobs, echo=echo, ray_address=ray_address, keep_checkpoints=keep_checkpoints)
    groups = {n: [summarize_run(j.run_dir, j.seed) for j in jobs if j.name == n] for n in names}
    result = aggregate(groups, target, budget_tokens)
    for rec, meta in zip(result["recipes"], header["recipes"], strict=True):
        rec["path"] = meta["path"]
        for run in rec["runs"]:
            run["this_invocation"] = status.get(Path(run["dir"]))
    result = {**header, **result, "recipes": result["recipes"]}
    write_comparison(out, result)
    return result
