"""Why partial rollouts gain little on a CPU: what one decode step costs against the rows in it.

Partial rollouts (APRIL) gain by keeping the decoding batch full: in a synchronous step the batch
empties as rows finish, and the last, longest rows decode almost alone. That wastes time only if a
step of a few rows costs nearly what a full step costs (a memory-bound GPU). This benchmark measures
the cost curve and turns it into the gain a perfect partial mode could have:

1. the seconds of one decode step of B rows, B in `--batches`, for each backend: `hf` (the training
   model's forward with its KV cache, as adarl's decoder runs it) and `vllm` (its engine, every row
   forced to the same length with `ignore_eos`); the step cost is fitted as a + b·B;
2. the lengths of one long-tailed step, sampled by vLLM: `bench/longtail.py`'s task (the
   quickstart's additions with SmolLM2's own system prompt, 128-token cap), 8 prompts × 8 rows;
3. for those lengths, sync's time is the sum over decode steps t of cost(rows alive at t); a perfect
   partial mode decodes every token at full batch, cost(B)/B per token. Their ratio is the largest
   rollout-throughput gain partial rollouts can bring on this backend and machine; with
   `bench/longtail.py`'s over-provisioning (2x the rows in flight) the full batch is 2B rows.

    .venv/bin/python bench/decode_cost.py [--batches 1,4,16,64,128] [--out bench/results/longtail/decode_cost.json]

Run it with nothing else busy on the machine. On a GPU machine without adarl's dependencies or the model
file, `--random-init --device cuda` times the hf step of a randomly initialised model of SmolLM2-135M's
shape (a step's cost does not depend on the weights) and reads the long-tailed lengths from a JSON this
script wrote on another machine (`--lengths-from`): it needs only torch, transformers and numpy.

    python3 bench/decode_cost.py --random-init --device cuda --backends hf --batches 1,4,16,64,128,256,512 \
        --lengths-from bench/results/longtail/decode_cost.json --out bench/results/longtail/decode_cost_gpu.json

`--smoke --model TINY` is the smallest run (the hf step at 1 and 2 rows, no vLLM; with `--lengths-from`,
the bound too): tests/benchmarks/test_bench_smoke.py runs it on a tiny random model. Its times mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
import torch

STEPS = 32  # decode steps timed per batch size
# SmolLM2-135M-Instruct's shape (../shared/docs/platform.md), for --random-init
SMOLLM2_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                     tie_word_embeddings=True)


def random_smollm2(device: str, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**SMOLLM2_SHAPE)).to(device=device, dtype=dtype).eval()


SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # SmolLM2's ids 0-2; <|im_end|> is eos and pad


def synthetic_tokenizer(vocab_size: int):
    """For random-init models: word-level, `t<i>` is token i, split on whitespace; ids 0-2 are the special
    tokens, 2 (<|im_end|>) eos and pad. Any sampled id decodes, so rewards (and TRL) read completions as text."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + [f"t{i}" for i in range(len(SPECIALS), vocab_size)])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens(SPECIALS)
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|im_end|>",
                                  unk_token="<|endoftext|>")
    tok.padding_side = "left"
    return tok


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def hf_step_seconds(model, prompt: list[int], rows: int) -> float:
    """Seconds per decode step of `rows` rows: the model's forward on one new token per row, KV cache kept."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    ids = torch.tensor([prompt] * rows, device=device)
    with torch.inference_mode():
        for timed in (False, True):  # the first pass warms up kernels and allocator at this batch size
            cache = DynamicCache()
            out = model(input_ids=ids, past_key_values=cache, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
            sync(device)
            t0 = time.perf_counter()
            for _ in range(STEPS if timed else 2):
                out = model(input_ids=token, past_key_values=cache, use_cache=True)
                token = torch.multinomial(out.logits[:, -1].float().softmax(-1), 1)
            sync(device)
        return (time.perf_counter() - t0) / STEPS


def vllm_step_seconds(llm, prompt: list[int], rows: int) -> float:
    """Seconds per decode step of `rows` rows: (time for 1 + STEPS tokens − time for 1 token) / STEPS."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    def run(tokens: int) -> float:
        params = [SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=1.0, seed=i) for i in range(rows)]
        t0 = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=prompt)] * rows, params, use_tqdm=False)
        return time.perf_counter() - t0

    run(2)  # warm-up at this batch size
    return (run(1 + STEPS) - run(1)) / STEPS


def partial_bound(lengths: list[int], a: float, b: float, full: int | None = None) -> float:
    """Sync seconds per token (the batch shrinks as rows end) over the seconds per token of a batch kept
    at `full` rows (default: the step's rows; partial mode's over-provisioning keeps more in flight)."""
    lengths = np.array(lengths)
    full = full or len(lengths)
    alive = np.array([(lengths > t).sum() for t in range(lengths.max())])
    sync = (a + b * alive).sum() / alive.sum()
    return float(sync / ((a + b * full) / full))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,4,16,64,128")
    parser.add_argument("--backends", default="hf,vllm")
    parser.add_argument("--out", default=None)
    parser.add_argument("--device", default="cpu", help="where the hf step runs (cuda: a GPU)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--random-init", action="store_true",
                        help="time a random model of SmolLM2-135M's shape (no model file, no adarl imports)")
    parser.add_argument("--lengths-from", default=None, help="a JSON this script wrote: its long-tailed lengths")
    parser.add_argument("--model", default="smollm2-135m", help="a path or alias (not with --random-init)")
    parser.add_argument("--smoke", action="store_true", help="the smallest run: the hf step at 1 and 2 rows "
                        "(with a tiny --model, for tests; times mean nothing)")
    args = parser.parse_args()
    if args.smoke:
        args.batches, args.backends = "1,2", "hf"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    batches = [int(b) for b in args.batches.split(",")]
    backends = args.backends.split(",")
    threads = torch.get_num_threads()
    cost: dict[str, dict[int, float]] = {}
    lengths: list[int] = json.loads(Path(args.lengths_from).read_text())["lengths"] if args.lengths_from else []
    if args.random_init:
        if backends != ["hf"]:
            parser.error("--random-init times the hf step only (--backends hf)")
        model = random_smollm2(args.device, getattr(torch, args.dtype))
        ids = torch.randint(2, SMOLLM2_SHAPE["vocab_size"], (40,), generator=torch.Generator().manual_seed(0))
        prompt = [1] + ids.tolist()
        cost["hf"] = {b: hf_step_seconds(model, prompt, b) for b in batches}
        report(args, batches, cost, lengths, threads)
        return
    from adarl.config import ModelConfig, load_recipe
    from adarl.models import chat_ids, load_model
    from adarl.tasks import build_task

    recipe = load_recipe(Path(__file__).resolve().parents[1] / "recipes" / "quickstart.yaml",
                         ["task.system_prompt=null", "rollout.max_new_tokens=128"]
                         + (["task.size=16", "task.eval_size=4"] if args.smoke else []))
    task = build_task(recipe.task)
    model, tok = load_model(ModelConfig(path=args.model), for_training=False)
    model.eval().to(args.device)
    prompts = [chat_ids(tok, p.messages) for p in task.train[:8]]
    if "hf" in backends:
        cost["hf"] = {b: hf_step_seconds(model, prompts[0], b) for b in batches}
    if "vllm" in backends:
        from adarl.config import RolloutConfig
        from adarl.rollout.vllm import VllmGenerator
        from adarl.types import Request

        gen = VllmGenerator(model, tok, RolloutConfig(backend="vllm", temperature=recipe.rollout.temperature,
                                                      max_new_tokens=128, vllm={"kv_cache_gib": 2}))
        torch.set_num_threads(threads)
        cost["vllm"] = {b: vllm_step_seconds(gen.llm, prompts[0], b) for b in batches}
        lengths = [len(r.completion_ids) for r in gen.generate([Request(str(i), p, 8) for i, p in enumerate(prompts)])]
        gen.close()
    report(args, batches, cost, lengths, threads)


def report(args: argparse.Namespace, batches: list[int], cost: dict[str, dict[int, float]], lengths: list[int],
           threads: int) -> None:
    summary: dict = {"threads": threads, "steps_timed": STEPS, "lengths": lengths, "device": args.device,
                     "dtype": args.dtype, "random_init": args.random_init}
    if args.device.startswith("cuda"):
        summary["gpu"] = torch.cuda.get_device_name()
    print(f"seconds per decode step ({threads} threads)")
    print(f"{'rows':>6}" + "".join(f"{name:>12}" for name in cost))
    for b in batches:
        print(f"{b:>6}" + "".join(f"{cost[name][b]:>12.4f}" for name in cost))
    if lengths:
        print(f"\none long-tailed step: {len(lengths)} rows, mean length {np.mean(lengths):.1f}, "
              f"max {max(lengths)}, {sum(n >= 128 for n in lengths)} at the cap")
    for name, curve in cost.items():
        b, a = np.polyfit(batches, [curve[x] for x in batches], 1)
        row = {"seconds_per_step": curve, "fixed_s": float(a), "per_row_s": float(b),
               "step_64_over_step_1": curve.get(64, float("nan")) / curve[batches[0]]}
        if lengths:
            row["partial_bound"] = partial_bound(lengths, a, b)
            row["partial_bound_2x_rows"] = partial_bound(lengths, a, b, 2 * len(lengths))
        summary[name] = row
        bound = (f"; partial rollouts can gain at most {row['partial_bound']:.2f}x, "
                 f"{row['partial_bound_2x_rows']:.2f}x with twice the rows in flight") if lengths else ""
        print(f"{name}: step ≈ {a * 1e3:.1f} ms + {b * 1e3:.2f} ms per row{bound}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
