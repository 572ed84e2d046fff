"""Would int8 sampling make the default `hf` backend fast enough (issue 20)? Speed and policy drift.

The hf generator's decode step spends about two thirds of its time in `nn.linear` (cProfile,
SmolLM2-135M, 32 rows, 1 thread), and int8 dynamically quantized linears run 4-8x faster than
float32 on this CPU. This measures what that buys end to end, and what it costs: the same keyed
rows are sampled from the float32 model and from int8 copies (per-tensor on every linear; per
channel with the tied lm_head left in float32), and the mean per-token KL(float32 || int8) is
taken at the positions of the float32 samples. A sampler that drifts far from the policy it
trains would make every update off-policy.

    .venv/bin/python bench/quantized_sampling.py [--threads 1] [--max-new-tokens 64]

`--smoke --model TINY` is the smallest run through every part (8 new tokens, one repeat):
tests/benchmarks/test_bench_smoke.py runs it on a tiny random model. Its times mean nothing.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from adarl.config import ModelConfig, RolloutConfig  # noqa: E402
from adarl.models import chat_ids, load_model  # noqa: E402
from adarl.rollout.hf import HfGenerator  # noqa: E402
from adarl.types import Request  # noqa: E402
from generate import PROMPTS  # noqa: E402


def quantized(model: torch.nn.Module, per_channel: bool) -> torch.nn.Module:
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    twin = copy.deepcopy(model)
    if not per_channel:
        return quantize_dynamic(twin, {torch.nn.Linear}, dtype=torch.qint8)
    spec = {name: per_channel_dynamic_qconfig for name, m in twin.named_modules()
            if isinstance(m, torch.nn.Linear) and "lm_head" not in name}
    return quantize_dynamic(twin, spec, dtype=torch.qint8)


def drift(model, other, requests, rollouts) -> float:
    """Mean per-token KL(model || other) over the sampled completions."""
    rows = [q for q in requests for _ in range(q.n)]
    kls = []
    with torch.no_grad():
        for req, r in zip(rows, rollouts, strict=True):
            ids = torch.tensor([req.prompt_ids + r.completion_ids])
            a = F.log_softmax(model(ids).logits[0, len(req.prompt_ids) - 1:-1].float(), -1)
            b = F.log_softmax(other(ids).logits[0, len(req.prompt_ids) - 1:-1].float(), -1)
            kls.append((a.exp() * (a - b)).sum(-1).mean().item())
    return sum(kls) / len(kls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default="bench/results/quantized_sampling.json")
    parser.add_argument("--model", default="smollm2-135m", help="a path or alias")
    parser.add_argument("--smoke", action="store_true", help="the smallest run: 8 new tokens, 1 repeat "
                        "(with a tiny --model, for tests; times mean nothing)")
    args = parser.parse_args()
    if args.smoke:
        args.max_new_tokens, args.repeats = 8, 1
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    model, tok = load_model(ModelConfig(path=args.model, threads=args.threads), for_training=False)
    cfg = RolloutConfig(max_new_tokens=args.max_new_tokens, temperature=1.0)
    requests = [Request(str(i), chat_ids(tok, p), 8) for i, p in enumerate(PROMPTS)]
    models = {"float32": model, "int8 per-tensor": quantized(model, False),
              "int8 per-channel, lm_head float32": quantized(model, True)}
    result = {}
    reference = None
    for name, m in models.items():
        gen = HfGenerator(m, tok, cfg, seed=0)
        gen.generate(requests[:1])  # warm-up
        speeds = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            out = gen.generate(requests, keys=list(range(32)))
            speeds.append(sum(len(r) for r in out) / (time.perf_counter() - t0))
        reference = reference or out
        result[name] = {"tokens_per_s": sum(speeds) / len(speeds),
                        "kl_from_float32": 0.0 if m is model else drift(model, m, requests, reference)}
    for name, r in result.items():
        r["speed_vs_float32"] = r["tokens_per_s"] / result["float32"]["tokens_per_s"]
        print(f"{name}: {r['tokens_per_s']:.1f} tok/s ({r['speed_vs_float32']:.2f}x), "
              f"KL(float32 || it) {r['kl_from_float32']:.3f} nats/token")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"threads": args.threads, "max_new_tokens": args.max_new_tokens,
                                          "results": result}, indent=2))


if __name__ == "__main__":
    main()
