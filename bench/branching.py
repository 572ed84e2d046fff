"""Branching policies against independent sampling on one model, before any training: for each
held-out prompt, n leaves per policy; pass@k (k = 1..n, the unbiased estimator over the n leaves),
distinct correct answers per group, the useful-token fraction (sampled tokens that would carry a
non-zero GRPO advantage: a shared prefix once, with the mean advantage of its leaves), the sampled
tokens each spent (a shared prefix once, pruned branches included) and sampled tokens per second.

    .venv/bin/python bench/branching.py --tasks addition,chain_sum --policies independent,eptree,latr,treepo \
        --seeds 0,1,2 --prompts 100 --n 8
    .venv/bin/python bench/branching.py --report-only --tasks addition,chain_sum --seeds 0,1,2

Every (task, policy, seed) is written to bench/results/branching/<task>/<policy>/seed<k>.json as it
finishes, and skipped when it is already there, as a file or packed into the folder's runs.tar.gz
(bench/results/README.md): a stopped run continues. Target (issue 16): a
branching policy reaches independent sampling's pass@8 with at most 0.6x the sampled tokens. The
model is the recipe's (the quickstart: SmolLM2-135M-Instruct); `addition` is the quickstart's task,
`chain_sum` reasoning-gym's 2-term chain sums; the held-out problems are fixed by task.data_seed.

`chain_sum3_worked` is the setting trees are for: answers that write their steps. Three 2-digit
terms, and a model that first learns to write the worked solution ("12 + 45 = 57; 57 - 30 = 27. The
answer is 27.") by 60 steps of SFT on the task's `solution` column (equal_budget.cold_start,
trained once into runs/cold-start/<task>-sft/final, the ladder's start too). Its openings copy the
question (low entropy) and its uncertainty sits on the result digits, so forks there share most of
a leaf. `eptree7` forks one chain at its 7 highest-entropy tokens, one child each (8 leaves, all
but the root sharing a prefix); `eptree3` forks each of 2 chains at its 3 highest-entropy tokens.
`eptree7d` and `eptree3d` are the same trees with distinct forks (`distinct: true`): a child may not
redraw its parent's token at the fork point, so no fork repeats its parent's path.

`--smoke --model TINY` is the smallest run of every policy (2 prompts × 8 leaves of up to 8 tokens, seed 0, a
reward a random model earns, bench/smoke.py): tests/benchmarks/test_bench_smoke.py runs it on a tiny
random model. Its figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from adarl.advantage.grpo import Grpo
from adarl.config import load_recipe
from adarl.metrics.passk import pass_at_k_array
from adarl.models import chat_ids, load_model
from adarl.rewards import Rewards
from adarl.rewards.short_answer import extract
from adarl.rollout import build_branching
from adarl.rollout.hf import HfGenerator
from adarl.tasks import build_task
from adarl.train.learner import token_advantages
from adarl.types import Batch, Group, Request, sampled_tokens, trainable_masks
from equal_budget import CHAIN_SUM3_WORKED, CHAIN_SUM4_WORKED, cold_start, read_kept
from smoke import smoke_overrides
from tree_policies import POLICIES, branching_section

TASKS = {
    "addition": [],
    "chain_sum": ["task.name=chain_sum", "task.params={min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 2}"],
    "chain_sum3_worked": CHAIN_SUM3_WORKED,
    "chain_sum4_worked": CHAIN_SUM4_WORKED,
}
OUT = Path("bench/results/branching")


def useful_fraction(groups: list[Group]) -> float:
    """Sampled tokens (a shared span once) whose GRPO token advantage is not 0, over all sampled tokens."""
    batch = Batch(groups)
    rollouts = batch.rollouts
    masks = trainable_masks(rollouts)
    adv = token_advantages(rollouts, Grpo()(batch), masks)
    useful = sum(int(((a != 0.0) & (m > 0)).sum()) for a, m in zip(adv, masks, strict=True))
    return useful / max(sampled_tokens(rollouts), 1)


def run(task: str, policy: str, seed: int, args: argparse.Namespace, model, tok, recipe) -> dict:
    problems = build_task(recipe.task).eval[: args.prompts]
    prompt_ids = {p.id: chat_ids(tok, p.messages) for p in problems}
    rewards = Rewards(recipe.rewards, workers=1)
    try:
        base = HfGenerator(model, tok, recipe.rollout, seed=seed)
        section = branching_section(policy)
        gen = base if section is None else build_branching(base, section)
        t0 = time.perf_counter()
        rollouts = gen.generate([Request(p.id, prompt_ids[p.id], args.n) for p in problems])
        seconds = time.perf_counter() - t0
        groups = [Group(p, prompt_ids[p.id], rollouts[i * args.n:(i + 1) * args.n]) for i, p in enumerate(problems)]
        rewards.score(groups)
    finally:
        rewards.close()
    c = np.array([int(g.correct.sum()) for g in groups])
    ns = np.full(len(groups), args.n)
    tokens = sum(sampled_tokens(g.rollouts) for g in groups) + getattr(gen, "last_discarded_tokens", 0)
    distinct_correct = [len({extract(r.text) for r, ok in zip(g.rollouts, g.correct, strict=True) if ok})
                        for g in groups]
    return {"task": task, "policy": policy, "seed": seed, "prompts": len(groups), "n": args.n,
            "pass@k": {k: float(pass_at_k_array(ns, c, k).mean()) for k in range(1, args.n + 1)},
            "sampled_tokens": int(tokens), "seconds": seconds, "tokens_per_s": tokens / seconds,
            "distinct_answers": float(np.mean([len({x.text.strip() for x in g.rollouts}) for g in groups])),
            "distinct_correct": float(np.mean(distinct_correct)), "useful_token_fraction": useful_fraction(groups),
            "branch_metrics": gen.metrics() if section is not None else {}}


def equal_token_pass(independent: dict, tokens: float, n: int) -> float:
    """Independent sampling's pass@k at the same sampled tokens: k = n · tokens / its tokens for n
    samples, linear between whole k (pass@0 = 0), at most pass@n."""
    k = min(n * tokens / independent["sampled_tokens"], float(n))
    curve = [0.0] + [independent["pass@k"][str(j)] for j in range(1, n + 1)]
    lo = int(k)
    return curve[lo] if lo == n else curve[lo] + (k - lo) * (curve[lo + 1] - curve[lo])


def report(tasks: list[str], policies: list[str], seeds: list[int], n: int, out: Path = OUT) -> None:
    for task in tasks:
        rows = {p: [json.loads(text) for s in seeds if (text := read_kept(out / task / p / f"seed{s}.json"))]
                for p in policies}
        base = rows.get("independent") or []
        if not base:
            print(f"{task}: no independent runs yet")
            continue
        print(f"\n{task} (n = {n}; mean ± std over seeds; tokens relative to independent, same seed)\n")
        print(f"| policy | seeds | pass@1 | pass@{n} | independent at equal tokens | sampled tokens | × independent | "
              f"distinct correct / group | useful tokens | tok/s × independent |\n" + "|---" * 10 + "|")
        by_seed = {r["seed"]: r for r in base}
        for p, rs in rows.items():
            if not rs:
                continue
            ratio = [r["sampled_tokens"] / by_seed[r["seed"]]["sampled_tokens"] for r in rs if r["seed"] in by_seed]
            speed = [r["tokens_per_s"] / by_seed[r["seed"]]["tokens_per_s"] for r in rs if r["seed"] in by_seed]

            def ms(values: list[float], fmt: str = ".3f") -> str:
                return f"{np.mean(values):{fmt}} ± {np.std(values, ddof=1) if len(values) > 1 else 0.0:{fmt}}"

            first, last = ms([r["pass@k"]["1"] for r in rs]), ms([r["pass@k"][str(n)] for r in rs])
            useful = ms([r["useful_token_fraction"] for r in rs])
            equal = ms([equal_token_pass(by_seed[r["seed"]], r["sampled_tokens"], n)
                        for r in rs if r["seed"] in by_seed])
            print(f"| {p} | {len(rs)} | {first} | {last} | {equal} | {ms([r['sampled_tokens'] for r in rs], '.0f')} | "
                  f"{ms(ratio, '.2f')} | {ms([r['distinct_correct'] for r in rs], '.2f')} | {useful} | "
                  f"{ms(speed, '.2f')} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="recipes/quickstart.yaml")
    parser.add_argument("--tasks", default="addition")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--prompts", type=int, default=100)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--model", default=None, help="a path or alias (default: the recipe's)")
    parser.add_argument("--smoke", action="store_true", help="the smallest run: 2 prompts × 8 leaves of 8 tokens, "
                        "seed 0 (with a tiny --model, for tests; figures mean nothing)")
    args = parser.parse_args()
    extra = [f"model.path={args.model}"] if args.model else []
    if args.smoke:
        args.seeds, args.prompts, args.n = "0", 2, 8
        extra += smoke_overrides()
    tasks, policies = args.tasks.split(","), args.policies.split(",")
    seeds = [int(s) for s in args.seeds.split(",")]
    unknown = [t for t in tasks if t not in TASKS] + [p for p in policies if p not in POLICIES]
    if unknown:
        parser.error(f"unknown task/policy {unknown}; tasks: {', '.join(TASKS)}; policies: {', '.join(POLICIES)}")
    if not args.report_only:
        models: dict[str, tuple] = {}  # model path -> (model, tokenizer), loaded once
        for seed in seeds:  # every task's first seed before any second one: a stopped run has both tasks
            for task in tasks:
                overrides, recipe = [f"model.threads={args.threads}", *TASKS[task], *extra], None
                for policy in policies:
                    path = args.out / task / policy / f"seed{seed}.json"
                    if read_kept(path) is not None:  # kept: as a file, or in the folder's runs.tar.gz
                        continue
                    if recipe is None:  # its cold start is trained only when a policy still has to run
                        recipe = load_recipe(args.recipe, overrides + cold_start(task, args.recipe, overrides))
                    if str(recipe.model.path) not in models:
                        models[str(recipe.model.path)] = load_model(recipe.model, for_training=False)
                    model, tok = models[str(recipe.model.path)]
                    r = run(task, policy, seed, args, model, tok, recipe)
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_text(json.dumps(r, indent=2))
                    print(f"{task} {policy} seed {seed}: pass@1 {r['pass@k'][1]:.3f}, pass@{args.n} "
                          f"{r['pass@k'][args.n]:.3f}, {r['sampled_tokens']} tokens, {r['tokens_per_s']:.1f} tok/s, "
                          f"useful {r['useful_token_fraction']:.2f}", flush=True)
    report(tasks, policies, seeds, args.n, args.out)


if __name__ == "__main__":
    main()
