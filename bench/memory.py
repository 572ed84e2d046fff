"""Peak memory of one training step: adarl's chunked log-probs against plain full logits.

One forward + backward + AdamW step of SmolLM2-135M (float32) on a batch of B sequences of
T tokens (prompt + completion), each in a fresh process so peak RSS is its own:

- `plain`: `model(ids).logits` → log_softmax → gather, the whole batch at once, as most RL
  code does; the (B, T, 49k) float32 logits and their softmax dominate memory.
- `adarl`: the trainer's path: completion positions only, projected `logit_chunk` tokens at
  a time under activation checkpointing, in length-sorted micro-batches of at most
  `micro_batch_tokens` padded tokens.

    .venv/bin/python bench/memory.py [--batch 16] [--tokens 192] [--prompt 64]

`--smoke --model TINY` is the smallest run of both modes (2 sequences of 16 tokens, micro-batches of one):
tests/benchmarks/test_bench_smoke.py runs it on a tiny random model. Its figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def step(mode: str, batch: int, tokens: int, prompt: int, micro_batch_tokens: int, chunk: int,
         model_path: str = "smollm2-135m") -> dict:
    import torch

    from adarl.config import ModelConfig
    from adarl.models import load_model
    from adarl.train.logprobs import completion_logprobs, pack

    model, _ = load_model(ModelConfig(path=model_path))
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (batch, tokens), generator=gen)
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    if mode == "plain":
        logits = model(ids).logits[:, prompt - 1 : -1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, ids[:, prompt:, None])[..., 0]
        (-logp.mean()).backward()
    else:
        rows = max(1, micro_batch_tokens // tokens)
        for start in range(0, batch, rows):
            part = ids[start : start + rows].tolist()
            packed = pack([r[:prompt] for r in part], [r[prompt:] for r in part], pad_id=0)
            logp, _ = completion_logprobs(model, packed, chunk=chunk)
            (-(logp * packed.completion_mask).sum() / (batch * (tokens - prompt))).backward()
    opt.step()
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"mode": mode, "peak_rss_gb": round(peak / 2**20, 2), "model_loaded_rss_gb": round(base_rss / 2**20, 2),
            "step_s": round(seconds, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=192)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--micro-batch-tokens", type=int, default=2048)
    parser.add_argument("--logit-chunk", type=int, default=512)
    parser.add_argument("--mode", choices=["plain", "adarl"], help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None)
    parser.add_argument("--model", default="smollm2-135m", help="a path or alias")
    parser.add_argument("--smoke", action="store_true", help="the smallest run: 2 sequences of 16 tokens (8 of "
                        "prompt), micro-batches of one (with a tiny --model, for tests; figures mean nothing)")
    args = parser.parse_args()
    if args.smoke:
        args.batch, args.tokens, args.prompt, args.micro_batch_tokens, args.logit_chunk = 2, 16, 8, 16, 4
    if args.mode:
        result = step(args.mode, args.batch, args.tokens, args.prompt, args.micro_batch_tokens, args.logit_chunk,
                      args.model)
        print(json.dumps(result))
        return
    results = []
    for mode in ("plain", "adarl"):
        cmd = [sys.executable, __file__, "--mode", mode, "--batch", str(args.batch), "--tokens", str(args.tokens),
               "--prompt", str(args.prompt), "--micro-batch-tokens", str(args.micro_batch_tokens),
               "--logit-chunk", str(args.logit_chunk), "--model", args.model]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        results.append(json.loads(out.strip().splitlines()[-1]))
    print(f"one step, {args.batch} x {args.tokens} tokens (prompt {args.prompt}), {args.model} float32")
    print(f"{'mode':<8}{'peak RSS GB':>13}{'after load GB':>15}{'step s':>9}")
    for r in results:
        print(f"{r['mode']:<8}{r['peak_rss_gb']:>13}{r['model_loaded_rss_gb']:>15}{r['step_s']:>9}")
    ratio = results[1]["peak_rss_gb"] / results[0]["peak_rss_gb"]
    print(f"adarl / plain peak memory: {ratio:.2f} (target: adarl <= 6 GB)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"results": results, "ratio": round(ratio, 3), "args": vars(args)}, f, indent=2)


if __name__ == "__main__":
    main()
