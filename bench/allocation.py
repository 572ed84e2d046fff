"""Uniform GRPO against adaptive selection/allocation at an equal generated-token budget.

Every method trains the same model from the same recipe (the quickstart unless `--recipe`)
until it has generated `--budget-tokens` tokens, with a held-out greedy pass@1 every
`--eval-every` steps. Reported per method: final pass@1 (mean ± std over seeds), and the
tokens it needed to reach uniform GRPO's final mean pass@1 (linear interpolation between
eval points) as a ratio to uniform's own budget. Target: best adaptive ratio ≤ 0.5.

    .venv/bin/python bench/allocation.py --methods uniform,vade,dars --seeds 0,1,2 \
        --budget-tokens 12000 [--task chain_sum] [--out bench/out/allocation.json]

Runs are sequential in this process and take minutes each on a 2-core CPU: run it on a
quiet machine. Finished runs are kept under --runs and not redone.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from adarl.config import load_recipe
from adarl.train.trainer import Trainer

METHODS: dict[str, list[str]] = {
    "uniform": [],
    "vade": ["select.name=vade"],
    "curriculum": ["select.name=curriculum"],
    "gdro": ["select.name=gdro", "allocate={name: gdro, n_mean: 8}"],
    "dapo": ["allocate={name: dapo, n: 8, max_batches: 3}"],
    "dars": ["allocate={name: dars, n: 8, n_max: 24, schedule: hardness}", "advantage.name=drgrpo"],
    "xrpo": ["allocate={name: xrpo, n: 8}"],
    "vade+dars": ["select.name=vade", "allocate={name: dars, n: 8, n_max: 24}", "advantage.name=drgrpo"],
}
TASKS: dict[str, list[str]] = {
    "addition": [],
    "chain_sum": ["task.name=chain_sum", "task.params={min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 2}"],
}


def run_one(recipe: str, method: str, task: str, seed: int, budget: int, eval_every: int, eval_size: int,
            runs: Path) -> list[dict]:
    run_dir = runs / task / method / f"seed{seed}"
    if (run_dir / "final").exists():
        return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    overrides = [f"seed={seed}", f"budget.max_tokens={budget}", "budget.max_steps=null", f"eval.every={eval_every}",
                 f"eval.size={eval_size}", "checkpoint.every=0", "log.progress=false", "log.tensorboard=false",
                 *TASKS[task], *METHODS[method]]
    Trainer(load_recipe(recipe, overrides), run_dir).run()
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def curve(rows: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    points = [(r["tokens"], r["eval/pass@1"]) for r in rows if "eval/pass@1" in r]
    return np.array([p[0] for p in points], float), np.array([p[1] for p in points], float)


def tokens_to_reach(tokens: np.ndarray, acc: np.ndarray, target: float) -> float | None:
    for i in range(1, len(acc)):
        if acc[i] >= target:
            if acc[i] == acc[i - 1]:
                return float(tokens[i])
            f = (target - acc[i - 1]) / (acc[i] - acc[i - 1])
            return float(tokens[i - 1] + max(f, 0.0) * (tokens[i] - tokens[i - 1]))
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="recipes/quickstart.yaml")
    parser.add_argument("--methods", default="uniform,vade,dars,xrpo,dapo,gdro")
    parser.add_argument("--tasks", default="addition")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--budget-tokens", type=int, default=12000)
    parser.add_argument("--eval-every", type=int, default=4)
    parser.add_argument("--eval-size", type=int, default=100)
    parser.add_argument("--runs", default="runs/bench-allocation")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    methods, tasks = args.methods.split(","), args.tasks.split(",")
    seeds = [int(s) for s in args.seeds.split(",")]
    unknown = [m for m in methods if m not in METHODS] + [t for t in tasks if t not in TASKS]
    if unknown:
        parser.error(f"unknown method/task {unknown}; methods: {', '.join(METHODS)}; tasks: {', '.join(TASKS)}")
    report: dict = {"budget_tokens": args.budget_tokens, "seeds": seeds, "tasks": {}}
    for task in tasks:
        curves = {m: [curve(run_one(args.recipe, m, task, s, args.budget_tokens, args.eval_every, args.eval_size,
                                    Path(args.runs))) for s in seeds] for m in methods}
        finals = {m: np.array([acc[-1] for _, acc in cs]) for m, cs in curves.items()}
        baseline = "uniform" if "uniform" in methods else methods[0]
        target = float(finals[baseline].mean())
        spent = {m: float(np.mean([tok[-1] for tok, _ in cs])) for m, cs in curves.items()}
        rows = []
        print(f"\n{task}: {args.budget_tokens} generated tokens per run, seeds {seeds}, "
              f"target = {baseline}'s final pass@1 {target:.3f}")
        print(f"{'method':<12}{'start':>7}{'final pass@1':>16}{'tokens to target':>18}{'ratio':>8}")
        for m, cs in curves.items():
            reach = [tokens_to_reach(tok, acc, target) for tok, acc in cs]
            hit = [r for r in reach if r is not None]
            mean_reach = float(np.mean(hit)) if len(hit) == len(reach) else None
            ratio = mean_reach / spent[baseline] if mean_reach is not None else None
            start = float(np.mean([acc[0] for _, acc in cs]))
            rows.append({"method": m, "final_mean": float(finals[m].mean()), "final_std": float(finals[m].std()),
                         "start": start, "tokens_to_target": mean_reach, "ratio": ratio,
                         "curves": [{"tokens": tok.tolist(), "pass@1": acc.tolist()} for tok, acc in cs]})
            print(f"{m:<12}{start:>7.3f}{finals[m].mean():>10.3f} ± {finals[m].std():.3f}"
                  f"{(f'{mean_reach:,.0f}' if mean_reach else 'not reached'):>18}"
                  f"{(f'{ratio:.2f}' if ratio is not None else '-'):>8}")
        report["tasks"][task] = rows
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
