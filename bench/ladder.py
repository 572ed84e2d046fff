"""The allocation ladder at an equal sampled-token budget, on a task the base model rarely solves
(`chain_sum3`: three 2-digit terms): uniform GRPO, Pilot-Commit, GRPO + hints (Guide, SEELE,
ADHint), SDAR self-distillation with the worked solution as privileged context, and, with
`--teacher <a model adarl trained>`, on-policy distillation from it.

    .venv/bin/python bench/ladder.py --seeds 0,1,2 --budget-tokens 10000 [--teacher runs/x/final]

On chain_sum3 uniform GRPO does not move at budgets this CPU affords (0.01 → 0.01 at 10k tokens), so
"tokens to reach uniform's final pass@1" is degenerate there. `--task addition` is the quickstart's
additions of two numbers 0-100: the base model samples 5.6% correct answers and 80% of its groups of 8 are all-fail
(../shared/docs/platform.md), yet uniform moves (about 0.27 → 0.5 at 10k tokens), so the ladder's
token ratio can be read. Its teacher for OPD is the quickstart's own run (`make demo`, 30 steps):

    ADARL_AUTO_BACKEND=hf .venv/bin/python bench/ladder.py --task addition --seeds 0,1,2 --budget-tokens 10000 \
        --teacher runs/<quickstart>/final --results bench/results/ladder --runs runs/bench-ladder

Runs go through bench/allocation.py's queue (resumable, results kept under bench/results/allocation/
<task>/b<budget>/<method>/, packed into its runs.tar.gz: bench/results/README.md); its tables give the
paired differences to uniform. This adds what the
ladder is for: how many all-failed groups a hint turned into mixed (trainable) groups, the rung
counts, and the teacher's extra forward tokens per sampled token.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import allocation  # noqa: E402
from equal_budget import curve  # noqa: E402
from methods import opd  # noqa: E402

LADDER = ["uniform", "pilot_commit", "guide", "seele", "adhint", "xrpo_seeding", "sdar"]


def ladder_table(results: dict[tuple[str, int], list[dict] | None], methods: list[str], seeds: list[int]) -> None:
    print("\n| method | seeds | hinted groups | of them mixed | rungs plain / more / hinted / distilled | "
          "teacher forward tokens per sampled token |\n|---|---|---|---|---|---|")
    for m in methods:
        runs = [results[m, s] for s in seeds if results.get((m, s))]
        if not runs:
            continue

        def total(key: str, runs: list[list[dict]] = runs) -> float:
            return float(sum(r.get(key, 0.0) for rows in runs for r in rows))

        hinted, mixed = total("hints/groups"), total("hints/groups_mixed")
        rungs = " / ".join(f"{total(f'ladder/{k}'):.0f}" for k in ("plain", "more", "hinted", "distilled"))
        teacher = [max((r.get("distill/teacher_forward_tokens", 0.0) for r in rows), default=0.0)
                   / max(rows[-1].get("tokens", 1), 1) for rows in runs]
        share = f"{mixed / hinted:.2f}" if hinted else "-"
        print(f"| {m} | {len(runs)} | {hinted:.0f} | {share} | {rungs} | {np.mean(teacher):.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="recipes/quickstart.yaml")
    parser.add_argument("--task", default="chain_sum3")
    parser.add_argument("--methods", default=",".join(LADDER))
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--budget-tokens", type=int, default=10000)
    parser.add_argument("--eval-every", type=int, default=2)
    parser.add_argument("--eval-size", type=int, default=100)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--teacher", default=None, help="a model adarl trained: adds on-policy distillation from it")
    parser.add_argument("--runs", default="runs/bench-allocation")
    parser.add_argument("--results", default="bench/results/allocation")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--partial", action="store_true")
    args = parser.parse_args()
    methods, seeds = args.methods.split(","), [int(s) for s in args.seeds.split(",")]
    if args.teacher:
        allocation.METHODS["opd"] = opd(args.teacher)
        methods.append("opd")
    unknown = [m for m in methods if m not in allocation.METHODS]
    if unknown or args.task not in allocation.TASKS:
        parser.error(f"unknown method/task {unknown or args.task}")
    results = {(m, s): allocation.run_one(args.recipe, m, args.task, s, args) for s in seeds for m in methods}
    done = {k: v for k, v in results.items() if v is not None}
    curves = {m: [curve(done[m, s]) for s in seeds if (m, s) in done] for m in methods}
    curves = {m: cs for m, cs in curves.items() if cs}
    if not curves or (len(done) < len(results) and not args.partial):
        print(f"{len(results) - len(done)} run(s) not finished; --partial tabulates the finished ones")
        if not args.partial:
            return
    allocation.report_task(args.task, list(curves), curves, args.budget_tokens, seeds)
    if "uniform" in curves:
        seeds_of = {m: [s for s in seeds if (m, s) in done] for m in curves}
        allocation.paired_task(args.task, curves, seeds_of, args.budget_tokens)
    ladder_table(done, [m for m in methods if m in curves], seeds)


if __name__ == "__main__":
    main()
