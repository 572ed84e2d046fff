"""Per-step overhead of selection + allocation + store update with 1,000,000 prompts.

No model: rollouts are simulated (rewards drawn from each prompt's hidden pass rate), so
what is timed is only adarl's bookkeeping: the selector, the allocator's stages, and the
difficulty-store updates, as the trainer calls them. Target: ≤ 50 ms per step.

    .venv/bin/python bench/allocation_overhead.py [--prompts 1000000] [--k 64] [--steps 20]

`--smoke` is the smallest run through every combination (1,000 prompts, 8 selected, 3 steps):
tests/benchmarks/test_bench_smoke.py runs it. Its times mean nothing.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from adarl import registry
from adarl.budget import Budget
from adarl.select.store import DifficultyStore
from adarl.types import Group, Problem, Rollout

COMBOS = [
    ({"name": "uniform"}, {"name": "fixed", "n": 8}),
    ({"name": "vade"}, {"name": "fixed", "n": 8}),
    ({"name": "curriculum"}, {"name": "dars", "n": 8}),
    ({"name": "gdro"}, {"name": "gdro", "n_mean": 8}),
    ({"name": "vade"}, {"name": "xrpo", "n": 8}),
    ({"name": "uniform"}, {"name": "dapo", "n": 8}),
]


def simulate(problems: dict[str, Problem], counts: dict[str, int], truth: np.ndarray, store: DifficultyStore,
             rng: np.random.Generator) -> list[Group]:
    groups = []
    for q, n in counts.items():
        c = (rng.random(n) < truth[store.index[q]]).astype(float)
        rollouts = [Rollout(q, [0] * 20, [0.0] * 20, "stop") for _ in range(n)]
        groups.append(Group(problems[q], [0], rollouts, rewards=c[:, None], reward_names=("r",), correct=c))
    return groups


def run(n_prompts: int, k: int, steps: int, select: dict, allocate: dict, seed: int = 0) -> float:
    rng = np.random.default_rng(seed)
    ids = [f"q{i}" for i in range(n_prompts)]
    truth = rng.beta(0.5, 0.5, size=n_prompts)
    selector, allocator = registry.build("select", select), registry.build("allocate", allocate)
    store = DifficultyStore(ids, *selector.store_decay())
    times = []
    for step in range(1, steps + 1):
        budget = Budget(rollouts_per_step=k * 8)
        budget.start_step()
        t0 = time.perf_counter()
        chosen = selector.select(store, allocator.candidates(k), rng)
        problems = {ids[i]: Problem(ids[i], "") for i in chosen}
        counts = allocator.plan(list(problems.values()), store, budget)
        groups: dict[str, Group] = {}
        sim = 0.0
        while counts:
            s0 = time.perf_counter()
            fresh = simulate(problems, counts, truth, store, rng)  # stands in for generate + verify
            sim += time.perf_counter() - s0
            budget.spend([r for g in fresh for r in g.rollouts])
            store.update(fresh, step)
            for g in fresh:
                groups.setdefault(g.problem.id, g)
            counts = allocator.more(list(groups.values()), store, budget)
        selector.observe(store, list(groups.values()))
        allocator.finish(list(groups.values()))
        times.append(time.perf_counter() - t0 - sim)
    return float(np.median(times[1:]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=1_000_000)
    parser.add_argument("--k", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default=None)
    parser.add_argument("--smoke", action="store_true",
                        help="the smallest run: 1,000 prompts, 8 selected, 3 steps (for tests; times mean nothing)")
    args = parser.parse_args()
    if args.smoke:
        args.prompts, args.k, args.steps = 1000, 8, 3
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the first step is excluded as a warm-up)")
    rows = []
    print(f"{args.prompts:,} prompts, {args.k} selected per step, median over {args.steps - 1} steps")
    print(f"{'select':<12}{'allocate':<10}{'ms/step':>10}")
    for select, allocate in COMBOS:
        ms = 1000 * run(args.prompts, args.k, args.steps, select, allocate)
        rows.append({"select": select["name"], "allocate": allocate["name"], "ms_per_step": round(ms, 2)})
        print(f"{select['name']:<12}{allocate['name']:<10}{ms:>10.2f}")
    worst = max(r["ms_per_step"] for r in rows)
    print(f"worst: {worst:.2f} ms per step (target <= 50 ms)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
