"""The Ray rollout pool against in-process generation, and a scaling model from the measured figures.

First, generation alone: one sampling call (8 prompts × 8 rollouts, 64 new tokens, the same
sampling keys) through each set-up, best of a few calls, and whether the pool drew exactly the
in-process tokens. Then three set-ups train the quickstart (SmolLM2-135M, 8 prompts × 8
rollouts, 64 new tokens) for a few steps from the same seed: the in-process generator (2 torch
threads), one Ray worker (2 CPUs, 2 threads) and two Ray workers (1 CPU, 1 thread each). Reported
per set-up, over the steps after
the first: sampled tokens per second of generation, step time, and the weight broadcast (the
pool's object-store put + every worker's load + its health generation), as ratios to in-process.
On a 2-core machine two workers are not expected to be faster: the figures show the pool's
overhead. Run it with nothing else busy on the machine.

Then a scaling model on paper (`scaling_model`): N workers each sampling `per_worker` tokens/s, a
step of G sampled tokens, a trainer update of U seconds and a broadcast of S bytes that every
node pulls from the head at B bytes/s:

    t_step(N) = G / (N · per_worker) + U + t_sync + (nodes(N) − 1) · S / B
    tokens/s(N) = G / t_step(N)

t_sync is the broadcast measured on one node (put, load, health generation); every further node
pulls the S bytes from the head. The CPU rows use the measured figures; the GPU rows use assumed
ones (flags), since no GPU was measured here. The broadcast becomes the bottleneck where its time
passes the generation time.

    .venv/bin/python bench/scale.py [--steps 3] [--out bench/results/scale/scale.json]

`--smoke --model TINY` is the smallest run of the set-ups named by `--setups` (generation: 2 prompts × 2
rollouts of up to 8 tokens, 2 calls; training: 2 steps of 2 prompts × 2): tests/benchmarks/test_bench_smoke.py
runs it on a tiny random model. Its figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import numpy as np

from smoke import smoke_overrides

SETUPS = {
    "in-process": {"backend": "local"},
    "ray-1-worker": {"backend": "ray", "workers": 1, "resources": {"num_cpus": 2, "threads": 2}},
    "ray-2-workers": {"backend": "ray", "workers": 2, "resources": {"num_cpus": 1, "threads": 1}},
}


def generation_only(setups: list[str], repeats: int, model_path: str = "smollm2-135m", prompts: int = 8, n: int = 8,
                    max_new_tokens: int = 64) -> dict:
    """The same sampling call (8 prompts × 8 rollouts, 64 new tokens, the same keys) through each set-up:
    sampled tokens per second, and whether the pool sampled exactly the in-process tokens."""
    import torch

    from adarl.cluster.ray_pool import RayRolloutPool
    from adarl.config import ClusterConfig, ModelConfig, RolloutConfig
    from adarl.models import chat_ids, load_model
    from adarl.rollout.hf import HfGenerator
    from adarl.types import Request

    torch.set_num_threads(2)
    model, tok = load_model(ModelConfig(path=model_path), for_training=True)
    cfg = RolloutConfig(backend="hf", max_new_tokens=max_new_tokens, temperature=0.7)
    system = {"role": "system", "content": "You are a concise calculator. Reply with only the final number."}
    requests = [Request(f"p{i}", chat_ids(tok, [system, {"role": "user", "content": f"Calculate {11 + 7 * i} + "
                                                         f"{25 + 3 * i}."}]), n) for i in range(prompts)]
    out: dict = {}
    reference = None
    for name in setups:
        cluster = SETUPS[name]
        gen = HfGenerator(model, tok, cfg, seed=0) if cluster["backend"] == "local" else \
            RayRolloutPool(model, tok, cfg, ClusterConfig.model_validate(cluster), seed=0)
        try:
            times, tokens = [], 0
            for rep in range(repeats):
                gen.rng.set_state({"seed": 0, "calls": rep})
                t0 = time.perf_counter()
                rollouts = gen.generate(requests)
                times.append(time.perf_counter() - t0)
                tokens = sum(len(r) for r in rollouts)
            ids = [r.completion_ids for r in rollouts]
            reference = reference or ids
            out[name] = {"tokens": tokens, "seconds": times, "tokens_per_s": tokens / min(times),
                         "same_tokens_as_first": ids == reference}
            print(f"generation only, {name}: {tokens} tokens, best of {repeats} {min(times):.2f} s, "
                  f"{tokens / min(times):.1f} tok/s, same tokens: {ids == reference}", flush=True)
        finally:
            if hasattr(gen, "close"):
                gen.close()
    return out


def run_setup(name: str, cluster: dict, steps: int, out: Path, extra: list[str] = ()) -> dict:
    from adarl.config import load_recipe
    from adarl.train.trainer import Trainer

    recipe = load_recipe(Path(__file__).parents[1] / "recipes" / "quickstart.yaml",
                         [f"budget.max_steps={steps}", "model.threads=2", "log.progress=false",
                          "log.tensorboard=false", "eval.at_start=false", "eval.every=0", "checkpoint.every=0",
                          *extra])
    recipe.cluster = recipe.cluster.model_validate(cluster)
    t0 = time.perf_counter()
    trainer = Trainer(recipe, out / name)
    start_s = time.perf_counter() - t0
    rows = []
    try:
        for _ in range(steps):
            rows.append(trainer.train_step())
            print(f"{name}: step {len(rows)}: {rows[-1]['step_s']:.1f} s, generate {rows[-1]['generate_s']:.1f} s, "
                  f"{rows[-1]['tokens_per_s']:.1f} tok/s, weight sync {rows[-1]['weight_sync_s']:.2f} s", flush=True)
    finally:
        trainer.generator.close()
    later = rows[1:] or rows  # the first step also warms up every worker
    return {"start_s": start_s,
            "tokens_per_s": float(np.mean([r["tokens_per_s"] for r in later])),
            "generate_s": float(np.mean([r["generate_s"] for r in later])),
            "step_s": float(np.mean([r["step_s"] for r in later])),
            "train_s": float(np.mean([r["train_s"] for r in later])),
            "weight_sync_s": float(np.mean([r["weight_sync_s"] for r in later])),
            "step_tokens": float(np.mean([r["step_tokens"] for r in later])),
            "broadcast_mb": float(later[-1].get("cluster/broadcast_mb", 0.0)),
            "steps": [{k: v for k, v in r.items() if isinstance(v, (int, float))} for r in rows]}


def scaling_model(per_worker: float, step_tokens: float, update_s: float, sync_s: float, weight_bytes: float,
                  bandwidth: float, workers_per_node: int, counts=(1, 2, 4, 8, 16, 32, 64)) -> list[dict]:
    """Tokens per second of the whole loop for N workers (module docstring)."""
    table = []
    for n in counts:
        nodes = math.ceil(n / workers_per_node)
        gen = step_tokens / (n * per_worker)
        broadcast = sync_s + (nodes - 1) * weight_bytes / bandwidth
        step = gen + update_s + broadcast
        table.append({"workers": n, "nodes": nodes, "generate_s": gen, "broadcast_s": broadcast, "step_s": step,
                      "tokens_per_s": step_tokens / step, "broadcast_bound": broadcast > gen})
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--setups", default=",".join(SETUPS))
    ap.add_argument("--out", type=Path, default=Path("bench/results/scale/scale.json"))
    ap.add_argument("--gpu-tokens-per-s", type=float, default=20000.0,
                    help="per-worker sampling rate assumed for the GPU rows of the model (not measured here)")
    ap.add_argument("--gpu-step-tokens", type=float, default=2**20, help="tokens a step samples, GPU rows (assumed)")
    ap.add_argument("--gpu-update-s", type=float, default=10.0, help="the trainer's update, GPU rows (assumed)")
    ap.add_argument("--report-only", action="store_true", help="print the tables of --out without running")
    ap.add_argument("--generate-repeats", type=int, default=3, help="calls per set-up of the generation-only part")
    ap.add_argument("--bandwidth-gb-s", type=float, default=1.25, help="head egress for the broadcast (10 GbE)")
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--runs", type=Path, default=Path("runs/bench-scale"))
    ap.add_argument("--model", default=None, help="a path or alias (default: the quickstart's, SmolLM2-135M)")
    ap.add_argument("--smoke", action="store_true", help="the smallest run: generation of 2 prompts × 2 rollouts of 8 "
                    "tokens, 2 calls; 2 training steps of 2 × 2 (with a tiny --model, for tests; figures mean nothing)")
    args = ap.parse_args()
    extra = [] if args.model is None else [f"model.path={args.model}"]
    sizes = {"prompts": 8, "n": 8, "max_new_tokens": 64}
    if args.smoke:
        args.steps, args.generate_repeats = 2, 2
        sizes = {"prompts": 2, "n": 2, "max_new_tokens": 8}
        extra += smoke_overrides(n=2)
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    results = json.loads(args.out.read_text()) if args.out.exists() else {}
    if not args.report_only:
        results["generation_only"] = generation_only(args.setups.split(","), args.generate_repeats,
                                                     args.model or "smollm2-135m", **sizes)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1))
    for name in [] if args.report_only else args.setups.split(","):
        results.setdefault("setups", {})[name] = run_setup(name, SETUPS[name], args.steps, args.runs, extra)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1))  # each finished set-up is kept
    gen = results.get("generation_only", {})
    if "in-process" in gen:
        print(f"{'generation only':<16}{'tok/s':>9}{'× in-proc':>11}  same tokens")
        for name, r in gen.items():
            print(f"{name:<16}{r['tokens_per_s']:>9.1f}{r['tokens_per_s'] / gen['in-process']['tokens_per_s']:>11.2f}"
                  f"  {r['same_tokens_as_first']}")
    setups = results["setups"]
    base = setups["in-process"]
    print(f"{'set-up':<16}{'tok/s':>9}{'× in-proc':>11}{'step s':>9}{'× in-proc':>11}{'sync s':>9}{'start s':>9}")
    for name, r in setups.items():
        print(f"{name:<16}{r['tokens_per_s']:>9.1f}{r['tokens_per_s'] / base['tokens_per_s']:>11.2f}"
              f"{r['step_s']:>9.1f}{r['step_s'] / base['step_s']:>11.2f}{r['weight_sync_s']:>9.2f}{r['start_s']:>9.1f}")
    one = setups.get("ray-1-worker", base)
    weight_bytes = one.get("broadcast_mb", 0.0) * 2**20 or 538e6
    sync_s = one["weight_sync_s"]  # measured on one node: put, load and health generation
    cases = (("cpu (measured)", one["tokens_per_s"], one["step_tokens"], one["train_s"]),
             ("gpu (assumed)", args.gpu_tokens_per_s, args.gpu_step_tokens, args.gpu_update_s))
    for label, rate, step_tokens, update_s in cases:
        table = scaling_model(rate, step_tokens, update_s, sync_s, weight_bytes, args.bandwidth_gb_s * 1e9,
                              args.gpus_per_node)
        results.setdefault("model", {})[label] = table
        print(f"\nscaling model, {label}: {rate:.0f} tok/s per worker, {step_tokens:.0f} tokens a step, "
              f"update {update_s:.1f} s, sync {sync_s:.2f} s on one node, {weight_bytes / 2**20:.0f} MiB "
              f"to each further node at {args.bandwidth_gb_s} GB/s, {args.gpus_per_node} workers a node")
        print(f"{'workers':>8}{'nodes':>6}{'gen s':>9}{'bcast s':>9}{'step s':>9}{'tok/s':>10}  bound")
        for row in table:
            print(f"{row['workers']:>8}{row['nodes']:>6}{row['generate_s']:>9.2f}{row['broadcast_s']:>9.2f}"
                  f"{row['step_s']:>9.2f}{row['tokens_per_s']:>10.0f}  "
                  f"{'broadcast' if row['broadcast_bound'] else 'generation'}")
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
