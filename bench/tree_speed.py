"""Sampled tokens per second of the branching policies against independent rows, on one device.

Issue 16 expects forking to be at least as fast as independent sampling, since a fork reuses its
prefix's KV cache. A tree samples in rounds that wait on each other (its roots, then the forks), so it
can be as fast only where a decode step of fewer rows costs less than a full one. This times adarl's
own decoder (the hf backend) and tree samplers (bench/tree_policies.py) on the same prompts, n rows
each, every policy `--repeats` times (the best time is kept, after one warm-up call), and reports
sampled tokens per second (a shared prefix once, pruned branches included) as a ratio to independent
rows, and how many sampled tokens the tree spent against independent rows.

    .venv/bin/python bench/tree_speed.py --policies independent,eptree,eptree7,treepo8 --prompts 32 --n 8

On a GPU machine without the model file or adarl's task dependencies (it needs torch, transformers,
numpy and pydantic), `--random-init` samples from a random model of SmolLM2-135M's shape with a
synthetic tokenizer: eos is then one token in 49k, so nearly every row runs to `--max-new-tokens`,
and fork points (the highest-entropy tokens) fall anywhere. That is the cost of the tree's shape, not
of a trained model's answers:

    python3 bench/tree_speed.py --random-init --device cuda --prompts 100 --n 8 --max-batch 1024 \\
        --out bench/results/branching/tree_speed_gpu.json

`--smoke --model TINY` is the smallest run of every policy (2 prompts, 8 rows each of up to 8 tokens, one
repeat): tests/benchmarks/test_bench_smoke.py runs it on a tiny random model. Its times mean nothing.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from decode_cost import SMOLLM2_SHAPE, random_smollm2, sync, synthetic_tokenizer
from tree_policies import POLICIES, branching_section


def timed(gen, requests, device: torch.device) -> tuple[float, int]:
    from adarl.types import sampled_tokens

    sync(device)
    t0 = time.perf_counter()
    out = gen.generate(requests)
    sync(device)
    seconds = time.perf_counter() - t0
    return seconds, sampled_tokens(out) + getattr(gen, "last_discarded_tokens", 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policies", default="independent,eptree,eptree7,eptree3,treepo8")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--max-batch", type=int, default=64, help="rows decoded at once (rollout.max_batch)")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--random-init", action="store_true")
    parser.add_argument("--out", default=None)
    parser.add_argument("--model", default="smollm2-135m", help="a path or alias (not with --random-init)")
    parser.add_argument("--smoke", action="store_true", help="the smallest run: 2 prompts × 8 rows of up to 8 "
                        "tokens, 1 repeat (with a tiny --model, for tests; times mean nothing)")
    args = parser.parse_args()
    if args.smoke:
        args.prompts, args.n, args.max_new_tokens, args.repeats = 2, 8, 8, 1
    policies = args.policies.split(",")
    if unknown := [p for p in policies if p not in POLICIES]:
        parser.error(f"unknown policy {unknown}; policies: {', '.join(POLICIES)}")
    from adarl.config import RolloutConfig
    from adarl.rollout import build_branching
    from adarl.rollout.hf import HfGenerator
    from adarl.types import Request

    device = torch.device(args.device)
    rng = np.random.default_rng(0)
    if args.random_init:
        model, tok = random_smollm2(args.device, torch.float32), synthetic_tokenizer(SMOLLM2_SHAPE["vocab_size"])
        prompts = [[1] + rng.integers(3, SMOLLM2_SHAPE["vocab_size"], 40).tolist() + [2] for _ in range(args.prompts)]
    else:
        from adarl.config import ModelConfig
        from adarl.models import chat_ids, load_model

        model, tok = load_model(ModelConfig(path=args.model), for_training=False)
        model.to(device)
        prompts = [chat_ids(tok, [{"role": "user", "content": f"What is {a} + {b}? Explain step by step."}])
                   for a, b in rng.integers(10, 100, (args.prompts, 2))]
    cfg = RolloutConfig(temperature=args.temperature, max_new_tokens=args.max_new_tokens, max_batch=args.max_batch)
    requests = [Request(str(i), p, args.n) for i, p in enumerate(prompts)]
    timed(HfGenerator(model, tok, cfg, seed=99), requests[:4], device)  # warm-up: kernels, allocator
    results: dict[str, dict] = {}
    for policy in policies:
        section, runs = branching_section(policy), []
        for r in range(args.repeats):
            gen = HfGenerator(model, tok, cfg, seed=r)
            if section is not None:
                gen = build_branching(gen, section)
            runs.append(timed(gen, requests, device))
        seconds, tokens = min(runs)
        results[policy] = {"seconds": seconds, "sampled_tokens": tokens, "tokens_per_s": tokens / seconds,
                           "runs": [{"seconds": s, "sampled_tokens": t} for s, t in runs]}
        print(f"{policy}: {tokens} tokens in {seconds:.2f} s, {tokens / seconds:.1f} tok/s", flush=True)
    base = results.get("independent")
    print("\n| policy | sampled tokens × independent | tok/s | × independent |\n|---|---|---|---|")
    for policy, r in results.items():
        token_ratio = f"{r['sampled_tokens'] / base['sampled_tokens']:.2f}" if base else "-"
        speed_ratio = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}" if base else "-"
        print(f"| {policy} | {token_ratio} | {r['tokens_per_s']:.1f} | {speed_ratio} |")
    if args.out:
        summary = {"device": str(device), "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None,
                   "random_init": args.random_init, "prompts": args.prompts, "n": args.n,
                   "max_new_tokens": args.max_new_tokens, "max_batch": args.max_batch, "policies": results}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
