"""Uniform GRPO against adaptive selection/allocation at an equal generated-token budget.

Every method trains the same model from the same recipe (the quickstart unless `--recipe`)
until it has generated `--budget-tokens` tokens, with a held-out greedy pass@1 every
`--eval-every` steps. Reported per method and task: final pass@1 (mean ± std over seeds), and
the tokens its seed-mean curve needs to reach uniform GRPO's final mean pass@1 (curves are
linearly interpolated between eval points), as a ratio to uniform's budget. Target: the best
adaptive ratio ≤ 0.5. A second ratio divides by the tokens uniform's own mean curve first needed
to reach that value, which is smaller when uniform peaks before its end. `--plot` draws the curves.

    .venv/bin/python bench/allocation.py --methods uniform,vade,dars --seeds 0,1,2 \
        --budget-tokens 10000 [--tasks addition,chain_sum] [--out bench/out/allocation.json]

Runs take minutes each on a 2-core CPU. Finished runs are kept under --runs (keyed by task,
budget, method and seed) and not redone, so an interrupted benchmark continues where it
stopped. Several processes can share one benchmark: each claims a run before starting it
(`--threads 1` in two processes used this machine's 2 cores better than one process with 2).
"""

from __future__ import annotations

import argparse
import json
from functools import partial
from pathlib import Path

import numpy as np

from equal_budget import CHAIN_SUM3_WORKED, budget_overrides, cold_start, curve, mean_curve, tokens_to_reach, train_run
from methods import METHODS  # every method's sections, read from its recipe (recipes/)

TASKS: dict[str, list[str]] = {
    "addition": [],
    "chain_sum": ["task.name=chain_sum", "task.params={min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 2}"],
    # a task the base model rarely solves, for the ladder (bench/ladder.py)
    "chain_sum3": ["task.name=chain_sum", "task.params={min_terms: 3, max_terms: 3, min_digits: 2, max_digits: 2}"],
    # the same sums from a model that first learned to write the worked solution (equal_budget.cold_start)
    "chain_sum3_worked": CHAIN_SUM3_WORKED,
}


def run_one(recipe: str, method: str, task: str, seed: int, args: argparse.Namespace) -> list[dict] | None:
    run_dir = Path(args.runs) / task / f"b{args.budget_tokens}" / method / f"seed{seed}"
    overrides = budget_overrides(seed, args.budget_tokens, args.eval_every, args.eval_size, args.threads)
    results = Path(args.results) / task / f"b{args.budget_tokens}" / method / f"seed{seed}"
    return train_run(recipe, overrides + TASKS[task] + METHODS[method], run_dir, f"{task} {method} seed {seed}",
                     args.report_only, results, start=partial(cold_start, task, recipe, TASKS[task]))


def report_task(task: str, methods: list[str], curves: dict[str, list], budget: int, seeds: list[int]) -> list[dict]:
    finals = {m: np.array([acc[-1] for _, acc in cs]) for m, cs in curves.items()}
    baseline = "uniform" if "uniform" in curves else methods[0]
    target = float(finals[baseline].mean())
    base_spent = float(np.mean([tok[-1] for tok, _ in curves[baseline]]))
    print(f"\n### {task}: {budget:,} generated tokens per run, seeds {seeds}; "
          f"target = {baseline}'s final mean pass@1 {target:.3f} after {base_spent:,.0f} tokens\n")
    # uniform's own curve may pass its final value before the end (a peak, then a decline): the
    # second ratio divides by the tokens uniform's curve first needed, not by all it spent
    base_reach = tokens_to_reach(*mean_curve(curves[baseline]), target)
    print("| method | seeds | start | final pass@1 (mean ± std) | tokens to target (mean curve) | ratio "
          f"| ratio to {baseline}'s first reach | seeds reaching it |")
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    for m, cs in curves.items():
        reach = tokens_to_reach(*mean_curve(cs), target)
        ratio = reach / base_spent if reach is not None else None
        ratio_first = reach / base_reach if reach is not None and base_reach else None
        hits = sum(tokens_to_reach(tok, acc, target) is not None for tok, acc in cs)
        start = float(np.mean([acc[0] for _, acc in cs]))
        rows.append({"method": m, "seeds": len(cs), "start": start, "final_mean": float(finals[m].mean()),
                     "final_std": float(finals[m].std()), "tokens_to_target": reach, "ratio": ratio,
                     "ratio_to_first_reach": ratio_first, "seeds_reaching": hits,
                     "curves": [{"tokens": tok.tolist(), "pass@1": acc.tolist()} for tok, acc in cs]})
        print(f"| {m} | {len(cs)} | {start:.3f} | {finals[m].mean():.3f} ± {finals[m].std():.3f} | "
              f"{f'{reach:,.0f}' if reach is not None else 'not reached'} | "
              f"{f'{ratio:.2f}' if ratio is not None else '-'} | "
              f"{f'{ratio_first:.2f}' if ratio_first is not None else '-'} | {hits}/{len(cs)} |")
    return rows


def paired_task(task: str, curves: dict[str, list], seeds_of: dict[str, list[int]], budget: int) -> list[dict]:
    """Per-seed differences to uniform (same seed: same held-out problems) at `budget` tokens and in
    normalised AUC, with t intervals over seeds; a method is better only when its interval excludes 0."""
    from adarl.comparison import at_tokens, normalised_auc
    from adarl.stats import holm, paired

    baseline = "uniform" if "uniform" in curves else next(iter(curves))

    def per_seed(method: str, fn) -> dict[int, float | None]:
        return {s: fn(list(zip(tok.tolist(), acc.tolist(), strict=True)))
                for s, (tok, acc) in zip(seeds_of[method], curves[method], strict=True)}

    def at_budget(c):
        return at_tokens(c, budget)

    def auc(c):
        return normalised_auc(c, budget)

    base_at, base_auc = per_seed(baseline, at_budget), per_seed(baseline, auc)
    tests = {m: (paired(per_seed(m, at_budget), base_at), paired(per_seed(m, auc), base_auc))
             for m in curves if m != baseline}
    # Holm over the methods compared with the baseline, each metric its own family
    for i in (0, 1):
        for m, adjusted in holm({m: t[i]["p"] for m, t in tests.items()}).items():
            tests[m][i].update(adjusted)
    print(f"\n#### {task}: paired differences to {baseline} at {budget:,} tokens (same seed, same held-out set; "
          f"Holm over the {len(tests)} methods)\n")
    print("| method | paired seeds | Δ pass@1 at budget [95% CI] | W/L/T | verdict | Holm p | "
          "Δ AUC [95% CI] | W/L/T | verdict | Holm p |")
    print("|---|---|---|---|---|---|---|---|---|---|")

    def cell(x):
        ci = x.get("ci95")
        interval = f" [{ci[0]:+.3f}, {ci[1]:+.3f}]" if ci else ""
        return f"{x['mean']:+.3f}{interval}" if x.get("mean") is not None else "-"

    def holm_cell(x):
        return f"{x['holm_p']:.3f} ({x['holm_verdict']})" if x.get("holm_p") is not None else "-"

    rows = []
    for m, (p, a) in tests.items():
        print(f"| {m} | {p['n']} | {cell(p)} | {p['wins']}/{p['losses']}/{p['ties']} | {p['verdict']} | "
              f"{holm_cell(p)} | {cell(a)} | {a['wins']}/{a['losses']}/{a['ties']} | {a['verdict']} | {holm_cell(a)} |")
        rows.append({"method": m, "pass@1_at_budget": p, "auc": a})
    return rows


def plot(report: dict, path: str) -> None:
    """Seed-mean held-out pass@1 against generated tokens, one panel per task, one line per method."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    tasks = report["tasks"]
    fig = Figure(figsize=(6.5 * len(tasks), 4.8))
    FigureCanvasAgg(fig)
    for i, (task, rows) in enumerate(tasks.items()):
        ax = fig.add_subplot(1, len(tasks), i + 1)
        for j, row in enumerate(rows):
            cs = [(np.array(c["tokens"]), np.array(c["pass@1"])) for c in row["curves"]]
            tok, acc = mean_curve(cs)
            style = {"color": "black", "lw": 2.5} if row["method"] == "uniform" else {"lw": 1.4}
            ax.plot(tok, acc, ls="-" if j < 6 else "--", label=f"{row['method']} ({row['seeds']})", **style)
        uniform = next((r for r in rows if r["method"] == "uniform"), None)
        if uniform is not None:
            ax.axhline(uniform["final_mean"], color="black", ls=":", lw=1)
        ax.set(title=f"{task}: {report['budget_tokens']:,} generated tokens per run",
               xlabel="generated tokens", ylabel="held-out greedy pass@1 (seed mean)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, title="method (seeds)", title_fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="recipes/quickstart.yaml")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--tasks", default="addition")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--budget-tokens", type=int, default=10000)
    parser.add_argument("--eval-every", type=int, default=2)
    parser.add_argument("--eval-size", type=int, default=100)
    parser.add_argument("--threads", type=int, default=None, help="torch threads per run")
    parser.add_argument("--runs", default="runs/bench-allocation")
    parser.add_argument("--results", default="bench/results/allocation", help="finished runs' metrics (in git)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--plot", default=None, help="PNG of pass@1 against tokens per task")
    parser.add_argument("--report-only", action="store_true", help="train nothing; tabulate finished runs")
    parser.add_argument("--partial", action="store_true", help="tabulate each method over its finished seeds")
    args = parser.parse_args()
    methods, tasks = args.methods.split(","), args.tasks.split(",")
    seeds = [int(s) for s in args.seeds.split(",")]
    unknown = [m for m in methods if m not in METHODS] + [t for t in tasks if t not in TASKS]
    if unknown:
        parser.error(f"unknown method/task {unknown}; methods: {', '.join(METHODS)}; tasks: {', '.join(TASKS)}")
    report: dict = {"budget_tokens": args.budget_tokens, "seeds": seeds, "eval_every": args.eval_every,
                    "eval_size": args.eval_size, "tasks": {}}
    for task in tasks:
        # seed-major, so an interrupted benchmark holds whole seeds
        results = {(m, s): run_one(args.recipe, m, task, s, args) for s in seeds for m in methods}
        busy = [k for k, v in results.items() if v is None]
        if busy:
            print(f"\n{task}: {len(busy)} run(s) not finished (in another process, or --report-only): "
                  + ", ".join(f"{m} seed {s}" for m, s in busy))
            if not args.partial:
                continue
        # with --partial, each method over the seeds it has finished
        curves = {m: [curve(results[m, s]) for s in seeds if results[m, s] is not None] for m in methods}
        curves = {m: cs for m, cs in curves.items() if cs}
        if curves:
            report["tasks"][task] = report_task(task, list(curves), curves, args.budget_tokens, seeds)
            seeds_of = {m: [s for s in seeds if results[m, s] is not None] for m in curves}
            report.setdefault("paired", {})[task] = paired_task(task, curves, seeds_of, args.budget_tokens)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2))
    if args.plot and report["tasks"]:
        plot(report, args.plot)


if __name__ == "__main__":
    main()
