"""The learner's update alone, on one batch of rollouts, with its forwards laid out three ways.

    .venv/bin/python bench/learner_update.py [--prompts 8] [--n 8] [--completion 2,32] [--rounds 1]
                                             [--threads T] [--recipe recipes/quickstart.yaml] [--model PATH]

The batch: `--prompts` of the recipe's training problems (its chat template and system prompt), `--n` rollouts
each, completions of random tokens with lengths drawn uniformly from `--completion` (a short-answer task's
are a few tokens, the quickstart's cap is 64), random nonzero advantages: every rollout trains. The same batch
and the same starting weights for each layout (train/logprobs.py):

- padded: one right-padded row per rollout, micro-batches of `train.micro_batch_tokens` padded tokens;
- packed: rows end to end, positions restarting per rollout, no padding, each prompt forwarded per rollout;
- shared: packed, and a group's prompt (any common token prefix) forwarded and back-propagated once.

Each round runs the three in turn (a warm-up update first, excluded). Reported per layout: the update's
seconds (median over rounds), the tokens forwarded, and the trained (completion) tokens per second; the
ratios are against padded. The update is the same in all three (tests/train/test_packing.py).

`--smoke --model TINY` is the smallest run (2 prompts × 2 rollouts): tests/train/test_learner_update_bench.py
runs it on a tiny random model. Its figures mean nothing.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "quickstart.yaml"
LAYOUTS = ("padded", "packed", "shared")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default=str(RECIPE))
    ap.add_argument("--model", default=None, help="a path or alias (default: the recipe's)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=8, help="rollouts per prompt")
    ap.add_argument("--completion", default="2,32", help="min,max completion tokens (uniform)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="also write every number as JSON")
    ap.add_argument("--smoke", action="store_true", help="2 prompts × 2 rollouts of 2-4 tokens (figures mean nothing)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.prompts, args.n, args.completion, args.rounds = 2, 2, "2,4", 1
    low, high = (int(x) for x in args.completion.split(","))
    if not 1 <= low <= high:
        ap.error(f"--completion {args.completion!r}: give min,max with 1 <= min <= max")
    args.completion_range = (low, high)
    return args


def build(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """The recipe, its model (float32, as loaded for training) and a batch of `prompts` × `n` rollouts."""
    import torch

    from adarl.config import load_recipe
    from adarl.models import chat_ids, load_model
    from adarl.tasks import build_task
    from adarl.types import Batch, Group, Rollout

    overrides = [f"model.path={args.model}"] if args.model else []
    if args.smoke:  # a small task: only `prompts` of its problems are used
        overrides += ["task.size=16", "task.eval_size=4"]
    recipe = load_recipe(args.recipe, overrides)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model(recipe.model, for_training=True)
    problems = build_task(recipe.task, recipe.seed).train[: args.prompts]
    rng = np.random.default_rng(args.seed)
    vocab = model.get_output_embeddings().weight.shape[0]
    low, high = args.completion_range
    groups = []
    for p in problems:
        rollouts = []
        for _ in range(args.n):
            ids = rng.integers(1, vocab, int(rng.integers(low, high + 1))).tolist()
            rollouts.append(Rollout(p.id, ids, (-rng.random(len(ids))).tolist(), "stop"))
        groups.append(Group(p, chat_ids(tokenizer, p.messages), rollouts))
    size = len(groups) * args.n
    batch = Batch(groups, advantages=rng.choice([-1.0, 1.0], size) * rng.uniform(0.5, 1.5, size))
    return recipe, model, batch


def forwarded_tokens(learner: Any, batch: Any) -> int:
    """The tokens the update's micro-batches forward under the learner's layout (padding included)."""
    from adarl.train.logprobs import micro_batches, pack

    prompts = [g.prompt_ids for g in batch.groups for _ in g.rollouts]
    rows = [(p, r.completion_ids) for p, r in zip(prompts, batch.rollouts, strict=True)]
    seqs = [p + c for p, c in rows]
    layout = learner._layout()
    total = 0
    for micro in micro_batches(list(range(len(rows))), [len(s) for s in seqs], learner.cfg.micro_batch_tokens,
                               None if layout == "padded" else seqs):
        total += pack([rows[i][0] for i in micro], [rows[i][1] for i in micro], learner.pad_id, layout).tokens
    return total


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from adarl import registry
    from adarl.train.learner import Learner

    recipe, model, batch = build(args)
    start = copy.deepcopy(model.state_dict())
    loss = registry.build("loss", dict(recipe.loss))

    def learner(layout: str) -> Learner:
        model.load_state_dict(start)
        out = Learner(model, loss, recipe.train, temperature=recipe.rollout.temperature, pad_id=0,
                      max_len=recipe.rollout.max_new_tokens, rng=np.random.default_rng(0))
        out.layout = layout
        return out

    trained = sum(len(r) for r in batch.rollouts)
    t0 = time.perf_counter()
    learner("shared").update(batch)  # warm-up
    print(f"  warm-up (shared): {time.perf_counter() - t0:.2f} s", flush=True)
    seconds: dict[str, list[float]] = {k: [] for k in LAYOUTS}
    norms: dict[str, float] = {}
    for _ in range(args.rounds):
        for layout in LAYOUTS:
            one = learner(layout)
            t0 = time.perf_counter()
            row = one.update(batch)
            seconds[layout].append(time.perf_counter() - t0)
            print(f"  {layout}: {seconds[layout][-1]:.2f} s", flush=True)
            norms[layout] = row["grad_norm"]
    out: dict[str, Any] = {"prompts": args.prompts, "n": args.n, "completion": list(args.completion_range),
                           "prompt_tokens_mean": float(np.mean([len(g.prompt_ids) for g in batch.groups])),
                           "trained_tokens": trained, "micro_batch_tokens": recipe.train.micro_batch_tokens,
                           "threads": torch.get_num_threads(), "rounds": args.rounds, "layouts": {}}
    for layout in LAYOUTS:
        s = statistics.median(seconds[layout])
        out["layouts"][layout] = {"update_s": s, "update_s_all": seconds[layout], "trained_tokens_per_s": trained / s,
                                  "forwarded_tokens": forwarded_tokens(learner(layout), batch),
                                  "grad_norm": norms[layout]}
    base = out["layouts"]["padded"]
    for layout in LAYOUTS:
        row = out["layouts"][layout]
        row["update_s_vs_padded"] = row["update_s"] / base["update_s"]
        row["tokens_per_s_vs_padded"] = row["trained_tokens_per_s"] / base["trained_tokens_per_s"]
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load = os.getloadavg()
    result = run(args)
    result["load_before"] = list(load)
    print(f"{result['prompts']} prompts × {result['n']} rollouts, prompts {result['prompt_tokens_mean']:.0f} tokens "
          f"(mean), completions {args.completion}, {result['trained_tokens']} trained tokens, "
          f"{result['threads']} threads, load before {load[0]:.1f}")
    print(f"{'layout':8} {'update s':>9} {'forwarded':>10} {'trained tok/s':>14} {'s vs padded':>12} "
          f"{'tok/s vs padded':>16}")
    for name, row in result["layouts"].items():
        print(f"{name:8} {row['update_s']:9.2f} {row['forwarded_tokens']:10d} {row['trained_tokens_per_s']:14.1f} "
              f"{row['update_s_vs_padded']:12.2f} {row['tokens_per_s_vs_padded']:16.2f}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
