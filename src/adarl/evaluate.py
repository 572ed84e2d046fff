"""`adarl eval`: pass@k, avg@k, greedy pass@1 and mean length of a model, a run or a checkpoint.

What is evaluated (`resolve_target`):
- a model: an alias (``smollm2-135m``), a local Hugging Face folder or a ``.gguf`` file;
- a run directory (it has ``config.yaml``): its ``final/`` model if the run finished, else its
  latest checkpoint; the run's recipe gives the task, rewards, rollout settings and prompts;
- a checkpoint (``checkpoints/step_N/``): ``weights.safetensors`` holds the trainable
  parameters only (LoRA adapters for LoRA runs), so the base model comes from the run's
  ``config.yaml`` and the weights are applied on top (adapters merged);
- a run's ``final/`` folder, with the run's recipe for the defaults.

On which problems (`resolve_tasks`): the held-out eval split (``build_task(cfg, seed).eval``) of
the run's own task, of the task and rewards of a recipe YAML file, or of a reasoning-gym
generator named directly (scored with the default ``short_answer`` reward).

How: every problem gets one greedy completion (greedy pass@1) and ``n`` sampled ones from the
run's generation backend (``--backend``, else the recipe's ``rollout.backend``; ``auto`` is
vllm when installed: `adarl.config.pick_backend`). From the c correct of the n samples, pass@k
is the unbiased estimator of Chen et al. (2021) (`adarl.metrics.passk`); avg@k is the mean
accuracy of the first k samples.
"""

from __future__ import annotations

import difflib
import json
import reprlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from adarl.config import Recipe, RewardConfig, RolloutConfig, TaskConfig, load_recipe, pick_backend
from adarl.metrics.passk import ProblemResult, pass_at_k_array, score_problems  # noqa: F401 (score_problems: for users)
from adarl.rollout import build_generator
from adarl.rollout.base import unbranched

DEFAULT_K = (1, 4, 16)


# ---------------------------------------------------------------- what is evaluated


@dataclass
class Target:
    """A model to evaluate, and the run it comes from (if any)."""

    spec: str  # what the user gave
    kind: str  # "model", "run" or "checkpoint"
    model_path: str  # HF folder / alias / .gguf to load (the base model when `weights` is set)
    recipe: Recipe | None = None  # the run's resolved recipe
    run_dir: Path | None = None
    weights: Path | None = None  # trainable parameters to load over the base model
    step: int | None = None

    def describe(self) -> str:
        where = f"{self.kind} {self.spec}"
        if self.step is not None:
            where += f" (step {self.step})"
        return where


def _step_of(path: Path) -> int | None:
    try:
        return int(path.name.removeprefix("step_"))
    except ValueError:
        return None


def _last_step(run_dir: Path) -> int | None:
    from adarl.metrics.sinks import MetricsWriter

    steps = [r["step"] for r in MetricsWriter.read(run_dir) if isinstance(r.get("step"), int)]
    return max(steps) if steps else None


def _run_recipe(run_dir: Path) -> Recipe:
    return load_recipe(run_dir / "config.yaml")


def resolve_target(spec: str | Path) -> Target:
    """Find out what `spec` names: a model, a run directory or a checkpoint (see the module doc)."""
    from adarl.train import checkpoint

    spec = str(spec)
    p = Path(spec).expanduser()
    if p.is_dir() and (p / "config.yaml").is_file():  # a run directory
        recipe = _run_recipe(p)
        final = p / "final"
        if (final / "config.json").is_file():
            return Target(spec, "run", str(final), recipe, p, step=_last_step(p))
        latest = checkpoint.latest(p / "checkpoints")
        if latest is None:
            raise ValueError(f"run directory {spec} has neither a final/ model nor a checkpoint yet")
        return Target(spec, "run", recipe.model.path, recipe, p, latest / "weights.safetensors", _step_of(latest))
    if p.is_dir() and (p / "weights.safetensors").is_file():  # checkpoints/step_N/
        run_dir = next((d for d in (p.parent, p.parent.parent) if (d / "config.yaml").is_file()), None)
        if run_dir is None:
            raise ValueError(f"checkpoint {spec}: its run's config.yaml (two folders up) is missing; a checkpoint "
                             "holds only the trainable weights, the base model is named in the run's recipe")
        recipe = _run_recipe(run_dir)
        return Target(spec, "checkpoint", recipe.model.path, recipe, run_dir, p / "weights.safetensors", _step_of(p))
    if p.is_dir() and (p / "config.json").is_file() and (p.parent / "config.yaml").is_file():  # RUN/final
        return Target(spec, "checkpoint", str(p), _run_recipe(p.parent), p.parent, step=_last_step(p.parent))
    from adarl.models import resolve_model

    resolve_model(spec)  # FileNotFoundError naming what is accepted
    return Target(spec, "model", spec)


def load_target(target: Target, threads: int | None = None):
    """The model (frozen, eval mode) and tokenizer of `target`."""
    import torch
    from safetensors.torch import load_file

    from adarl.config import ModelConfig
    from adarl.models import load_model

    dtype = target.recipe.model.dtype if target.recipe is not None else "float32"
    if target.weights is None:
        cfg = ModelConfig(path=target.model_path, dtype=dtype, threads=threads)
        model, tokenizer = load_model(cfg, for_training=False)
    else:
        assert target.recipe is not None
        cfg = target.recipe.model.model_copy(update={"threads": threads or target.recipe.model.threads})
        model, tokenizer = load_model(cfg, for_training=True)  # with LoRA adapters when the run had them
        weights = load_file(str(target.weights))
        params = dict(model.named_parameters())
        missing = [n for n, q in params.items() if q.requires_grad and n not in weights]
        unknown = [n for n in weights if n not in params]
        if missing or unknown:
            raise ValueError(f"checkpoint {target.weights.parent} does not match the model of its recipe: "
                             f"missing {missing[:3]}, unexpected {unknown[:3]}")
        with torch.no_grad():
            for name, tensor in weights.items():
                params[name].copy_(tensor)
        if hasattr(model, "merge_and_unload"):
            model = model.merge_and_unload()
        model.requires_grad_(False)
    return model.eval(), tokenizer


# ---------------------------------------------------------------- on which problems


@dataclass
class EvalTask:
    name: str
    task: TaskConfig
    rewards: list[RewardConfig]
    seed: int  # the task's data seed: which problems are held out
    source: str = ""  # where it came from, for the JSON


def _gym_names() -> list[str]:
    from reasoning_gym.factory import DATASETS

    return list(DATASETS)


def resolve_tasks(specs: list[str], target: Target, seed: int | None = None) -> list[EvalTask]:
    """The tasks to evaluate on: recipe files, reasoning-gym names, or (none given) the run's task.

    `seed` (`--task-seed`) replaces each task's `data_seed`, which decides its held-out problems;
    by default a run's or recipe's own data seed is used, so a run is scored on its held-out set."""
    tasks: list[EvalTask] = []
    if not specs:
        if target.recipe is None:
            raise ValueError(f"{target.spec} is a model, not a run: say which task with --task RECIPE.yaml "
                             "or --task REASONING_GYM_NAME")
        r = target.recipe
        name = r.task.name or Path(r.task.path or "task").stem
        tasks.append(EvalTask(name, r.task, list(r.rewards), r.task.data_seed, f"run {target.run_dir}"))
    for spec in specs:
        p = Path(spec).expanduser()
        try:
            is_file = p.is_file()
        except OSError:  # a name too long for a path (ENAMETOOLONG) is no file
            is_file = False
        if p.suffix in (".yaml", ".yml") or is_file:
            r = load_recipe(p)
            tasks.append(EvalTask(p.stem, r.task, list(r.rewards), r.task.data_seed, f"recipe {spec}"))
            continue
        names = _gym_names()
        if spec not in names:
            close = difflib.get_close_matches(spec, names, n=3, cutoff=0.5) if len(spec) <= 200 else []
            hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
            from adarl.config.loader import _clip

            raise ValueError(f"--task {_clip(spec)}: not a recipe file nor a reasoning_gym generator{hint}")
        # a run's prompt format (system prompt, template) carries over to other tasks
        base = target.recipe.task if target.recipe is not None else TaskConfig(name=spec)
        cfg = TaskConfig(source="reasoning_gym", name=spec, system_prompt=base.system_prompt,
                         prompt_template=base.prompt_template)
        tasks.append(EvalTask(spec, cfg, [RewardConfig(type="short_answer")], cfg.data_seed, f"reasoning_gym {spec}"))
    if seed is not None:
        for t in tasks:
            t.task, t.seed = t.task.model_copy(update={"data_seed": seed}), seed
    seen: dict[str, int] = {}
    for t in tasks:  # distinct names for the per-task breakdown
        seen[t.name] = seen.get(t.name, 0) + 1
        if seen[t.name] > 1:
            t.name = f"{t.name}#{seen[t.name]}"
    return tasks


# ---------------------------------------------------------------- scoring


MAX_K = 100_000


def parse_ks(text: str) -> list[int]:
    """``"1,4,16"`` -> ``[1, 4, 16]`` (sorted, distinct, each >= 1)."""
    shown = reprlib.repr(text)
    try:
        ks = sorted({int(k) for k in text.replace(" ", "").split(",") if k})
    except ValueError:
        raise ValueError(f"--k {shown}: expected comma-separated integers like 1,4,16") from None
    if not ks or ks[0] < 1 or ks[-1] > MAX_K:
        raise ValueError(f"--k {shown}: every k must be between 1 and {MAX_K}")
    return ks


def summarize(results: list[ProblemResult], ks: list[int], n: int) -> dict[str, Any]:
    """The task-level numbers of a list of per-problem results."""
    out: dict[str, Any] = {"problems": len(results)}
    if not results:
        return out
    greedy = [r.greedy for r in results if r.greedy is not None]
    if greedy:
        out["greedy_pass@1"] = float(np.mean(greedy))
        out["greedy_mean_length"] = float(np.mean([r.greedy_length for r in results if r.greedy_length is not None]))
        out["greedy_censored"] = sum(r.greedy_censored for r in results)  # an environment failure, scored wrong
    if n > 0:
        ns = np.array([r.n for r in results])
        cs = np.array([r.c for r in results])
        out["pass@k"] = {str(k): float(pass_at_k_array(ns, cs, k).mean()) for k in ks}
        out["avg@k"] = {str(k): float(np.mean([np.mean(r.first[:k]) for r in results])) for k in ks}
        out["pass@k_curve"] = [float(pass_at_k_array(ns, cs, k).mean()) for k in range(1, n + 1)]
        out["mean_accuracy"] = float((cs / ns).mean())
        out["mean_length"] = float(np.mean([r.length for r in results]))
        out["truncated_fraction"] = float(sum(r.truncated for r in results) / ns.sum())
        out["censored_fraction"] = float(sum(r.censored for r in results) / ns.sum())
    return out


def evaluate_task(generator, tokenizer, task: EvalTask, *, ks: list[int], n: int, seed: int = 0,
                  size: int | None = None, workers: int = 2,
                  timeout_s: float = 10.0) -> tuple[dict[str, Any], list[ProblemResult]]:
    """Greedy and `n` sampled completions per held-out problem of `task`, from `generator` (hf or vllm).

    The generator's sample stream restarts at `seed`, so a task's samples do not depend on the
    tasks evaluated before it. Returns the task's summary (JSON-ready, with per-problem c/n) and
    the per-problem results.
    """
    from adarl.models import chat_ids
    from adarl.rewards import Rewards
    from adarl.tasks import build_task

    problems = build_task(task.task, task.seed).eval
    if size is not None:
        problems = problems[:size]
    if not problems:
        raise ValueError(f"task {task.name}: the held-out split is empty (task.eval_size is 0?)")
    from adarl.rollout.agent import AgentGenerator

    chat = lambda p: p.messages  # noqa: E731
    if isinstance(generator, AgentGenerator):  # tool use: the loop runs, its environments see these problems
        generator.problems = {**generator.problems, **{p.id: p for p in problems}}
        chat = generator.messages
    prompt_ids = {p.id: chat_ids(tokenizer, chat(p)) for p in problems}
    generator.rng.set_state({"seed": seed, "calls": 0})
    rewards = Rewards(task.rewards, workers=workers, timeout_s=timeout_s)
    try:
        results = score_problems(unbranched(generator), rewards, problems, prompt_ids, n=n, label=task.name)
    finally:
        rewards.close()
    out = {"source": task.source, "seed": task.seed, **summarize(results, ks, n)}
    out["per_problem"] = [
        {"id": r.id, "c": r.c, "n": r.n, "greedy": r.greedy, "length": round(r.length, 2),
         "greedy_length": r.greedy_length, **({"greedy_censored": 1} if r.greedy_censored else {}),
         **({"censored": r.censored} if r.censored else {})}
        for r in results
    ]
    return out, results


@dataclass
class EvalResult:
    data: dict[str, Any]
    results: dict[str, list[ProblemResult]] = field(default_factory=dict)


def run_eval(target: Target, tasks: list[EvalTask], *, ks: list[int], n: int | None = None,
             size: int | None = None, seed: int = 0, temperature: float | None = None,
             max_new_tokens: int | None = None, threads: int | None = None,
             backend: str | None = None) -> EvalResult:
    """Evaluate `target` on every task; the JSON-ready result (``data``) and per-problem results.

    `backend` (hf, vllm, auto) defaults to the run's or recipe's ``rollout.backend``."""
    n = max(ks) if n is None else n
    if n > 0 and max(ks) > n:
        raise ValueError(f"pass@{max(ks)} needs at least {max(ks)} samples per problem; got --n {n}")
    ks = [k for k in ks if k <= n] if n > 0 else []
    rollout = target.recipe.rollout if target.recipe is not None else RolloutConfig()
    if target.recipe is None:  # a bare model: take the rollout settings of the first recipe task, if any
        for t in tasks:
            if t.source.startswith("recipe "):
                rollout = load_recipe(t.source.removeprefix("recipe ")).rollout
                break
    update = {k: v for k, v in (("temperature", temperature), ("max_new_tokens", max_new_tokens),
                                ("backend", backend)) if v is not None}
    rollout = rollout.model_copy(update=update)
    rollout = rollout.model_copy(update={"backend": pick_backend(rollout)})
    from adarl.train.build import missing_packages

    if missing := missing_packages(rollout):
        raise ImportError("; ".join(missing))
    if problems := rollout.unsupported():
        raise ValueError("; ".join(problems))
    t0 = time.perf_counter()
    model, tokenizer = load_target(target, threads=threads)
    data: dict[str, Any] = {
        "target": target.spec, "kind": target.kind, "model": target.model_path,
        "weights": str(target.weights) if target.weights else None, "step": target.step,
        "n": n, "k": ks, "seed": seed, "temperature": rollout.temperature, "top_p": rollout.top_p,
        "max_new_tokens": rollout.max_new_tokens, "backend": rollout.backend, "tasks": {},
    }
    all_results: dict[str, list[ProblemResult]] = {}
    generator = build_generator(model, tokenizer, rollout, seed=seed)
    try:
        for task in tasks:
            summary, results = evaluate_task(generator, tokenizer, task, ks=ks, n=n, seed=seed, size=size,
                                             workers=target.recipe.reward_workers if target.recipe else 2)
            data["tasks"][task.name] = summary
            all_results[task.name] = results
    finally:
        generator.close()
    if len(tasks) > 1:
        data["overall"] = summarize([r for rs in all_results.values() for r in rs], ks, n)
    data["wall_s"] = round(time.perf_counter() - t0, 2)
    return EvalResult(data, all_results)


# ---------------------------------------------------------------- output


def default_out(target: Target) -> Path | None:
    """Where `adarl eval` writes its JSON without --out: into the run (the report reads it there)."""
    if target.run_dir is None:
        return None
    if target.kind == "checkpoint" and target.weights is not None and target.step is not None:
        return target.run_dir / f"eval_step_{target.step}.json"
    return target.run_dir / "eval.json"


def write_json(data: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)


def table(data: dict[str, Any]):
    """A rich table: one row per task (and one for all of them)."""
    from rich.table import Table

    ks = data["k"]
    title = f"{data['target']}" + (f" (step {data['step']})" if data.get("step") is not None else "")
    t = Table(title=title, title_justify="left")
    t.add_column("task")
    t.add_column("problems", justify="right")
    t.add_column("greedy pass@1", justify="right")
    for k in ks:
        t.add_column(f"pass@{k}", justify="right")
    for k in ks:
        t.add_column(f"avg@{k}", justify="right")
    t.add_column("mean length", justify="right")
    rows = list(data["tasks"].items())
    if "overall" in data:
        rows.append(("all", data["overall"]))
    for name, s in rows:
        cells = [name, str(s["problems"]), f"{s.get('greedy_pass@1', float('nan')):.3f}"]
        cells += [f"{s['pass@k'][str(k)]:.3f}" for k in ks]
        cells += [f"{s['avg@k'][str(k)]:.3f}" for k in ks]
        length = s.get("mean_length", s.get("greedy_mean_length"))
        cells.append(f"{length:.1f}" if length is not None else "-")
        t.add_row(*cells)
    return t
