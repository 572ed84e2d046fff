"""One decode step of a grouped-query model: transformers' sdpa attention against rollout/decode_attention.py.

With a mask (left-padded rows), transformers' sdpa copies every key/value head once per query head it serves
before each decode step's attention; decode_attention.py attends on the cache as it is. This times the hf
decoder's own eager step (a growing cache, a 2D mask, one token a row) both ways on a randomly initialised
model of a real model's shape (a step's cost does not depend on the weights), in one process, the two
alternating step by step, and checks that their logits agree.

    .venv/bin/python bench/attention.py [--shape qwen2.5-0.5b] [--rows 16,64] [--context 256] [--steps 6] \
        [--threads 2] [--out bench/results/attention/attention.json]

Run it with nothing else busy on the machine. `--smoke` is the smallest run (a 2-layer model of the same
head layout, 2 rows, 2 steps): tests/benchmarks/test_bench.py runs it. Its times mean nothing.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from adarl.rollout.decode_attention import decoding

# the shapes of the configs on the Hub (no weights or network needed)
SHAPES = {
    "qwen2.5-0.5b": dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "smollm2-135m": dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True),
}


def build(shape: str, layers: int | None) -> torch.nn.Module:
    spec = dict(SHAPES[shape])
    if layers is not None:
        spec["num_hidden_layers"] = layers
    config = AutoConfig.for_model(**spec)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32).eval()


@torch.no_grad()
def measure(model: torch.nn.Module, rows: int, context: int, steps: int) -> dict:
    """Median seconds of a decode step, sdpa and grouped, over `steps` alternating steps from one pre-fill."""
    gen = torch.Generator().manual_seed(rows)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (rows, context), generator=gen)
    attn = torch.ones(rows, context, dtype=torch.long)
    for r in range(rows):  # left padding: rows of context/2 to context tokens
        attn[r, : r * context // (2 * rows)] = 0
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    cache = model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True).past_key_values
    caches = {"sdpa": cache, "grouped": copy.deepcopy(cache)}
    times: dict[str, list[float]] = {name: [] for name in caches}
    diff = 0.0
    for step in range(steps):
        token = torch.randint(0, vocab, (rows, 1), generator=gen)
        attn = torch.cat([attn, attn.new_ones((rows, 1))], dim=-1)
        position = pos[:, -1:] + step + 1
        logits = {}
        for name in (("sdpa", "grouped") if step % 2 == 0 else ("grouped", "sdpa")):
            start = time.perf_counter()
            with decoding(model) if name == "grouped" else nullcontext():
                out = model(input_ids=token, attention_mask=attn, position_ids=position, past_key_values=caches[name],
                            use_cache=True)
            times[name].append(time.perf_counter() - start)
            logits[name] = out.logits[:, -1]
        diff = max(diff, float((logits["sdpa"] - logits["grouped"]).abs().max()))
    median = {name: float(np.median(t[1:] if len(t) > 2 else t)) for name, t in times.items()}  # the first warms up
    return {"rows": rows, "context": context, "steps": steps, "sdpa_s": median["sdpa"], "grouped_s": median["grouped"],
            "ratio": median["grouped"] / median["sdpa"], "max_abs_logit_diff": diff}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, default=None, help="fewer layers than the shape's (default: all)")
    parser.add_argument("--rows", default="16,64")
    parser.add_argument("--context", type=int, default=256, help="tokens pre-filled per row (the longest row)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default=None)
    parser.add_argument("--smoke", action="store_true", help="2 layers, 2 rows, 8 tokens, 2 steps (seconds)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.layers, args.rows, args.context, args.steps = 2, "2", 8, 2
    if args.threads:
        torch.set_num_threads(args.threads)
    model = build(args.shape, args.layers)
    results = []
    for rows in (int(r) for r in args.rows.split(",")):
        r = measure(model, rows, args.context, args.steps)
        print(f"{args.shape} {rows} rows, {args.context} tokens: sdpa {r['sdpa_s'] * 1000:.1f} ms, grouped "
              f"{r['grouped_s'] * 1000:.1f} ms a step ({r['ratio']:.2f}x); "
              f"max |logit diff| {r['max_abs_logit_diff']:.2e}",
              flush=True)
        results.append(r)
    report = {"shape": args.shape, "layers": model.config.num_hidden_layers, "threads": torch.get_num_threads(),
              "torch": torch.__version__, "machine": platform.processor() or platform.machine(), "results": results}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()
