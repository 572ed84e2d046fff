"""The GPU check (issue 33): one prepared script for a lent GPU machine, under 8 minutes, one JSON file.

    python3 bench/gpu_check.py --out $OUT/gpu_check.json                       # the GPU machine
    .venv/bin/python bench/gpu_check.py --device cpu --quick --out /tmp/g.json   # here (tests/models/test_device.py)

The GPU machine has torch with CUDA, transformers, peft and accelerate, no network and no model files;
pydantic, TRL and datasets travel as wheels (`.whl/`, see the README's GPU section). Every model is built
from a config with random weights and a synthetic word-level tokenizer (`t0 … tV`), so nothing is
downloaded. Each section is written to the JSON file as soon as it ends; a failing section records its
error and the next one runs.

1. `equality`: the same GRPO update of a tiny model (a batch sampled once by adarl's hf decoder on the
   CPU, PPO-clip, token-mean, AdamW) from the same weights on the CPU and on `--device`: the loss, the
   gradient norm and the updated weights agree within 1e-4 relative in float32; bf16 mixed precision
   (`train.mixed_precision: bf16`) is compared against the float32 CPU update and must stay within 2e-2
   relative in loss and gradient norm. The same with LoRA adapters (r 4 on q and v, `device_*_lora`): the
   adapters' update on the device against the CPU's.
2. `trainer`: two `Trainer.train_step()`s of the tiny model with `model.device` set to `--device`
   (generation, verification, update, weight sync: the whole step on the device), with its metrics row
   (peak device memory, train/sampler mismatch).
3. `shapes`: random Qwen2.5-0.5B and -1.5B shapes in bf16: adarl's hf decoder against `model.generate`,
   sampled tokens/s at 64 and 256 rows; one policy update in bf16 mixed precision (float32 master
   weights), its trained tokens/s, model FLOPs utilisation and peak memory.
4. `vs_trl`: TRL's `GRPOTrainer` and adarl's `Trainer` on the same card, the same random 0.5B model
   (bf16 weights), the same prompts, group size, lengths and reward, neither with vLLM: the median step
   time of each after a warm-up step, and their ratio.
5. `fsdp2`: the same policy updates through the one-process `Learner` and through `ShardedLearner`
   (`train.parallel: fsdp2`) at world size 1 (a one-rank group, no torchrun), from the same weights on the
   same batch: the weights after one float32 update (they must agree within 1e-5), then the median update
   time of 3 after a warm-up and the peak device memory of each; then both again in bf16 mixed precision.
   What FSDP2 costs before it shards anything.
6. `vllm` (wherever vLLM is importable; skipped otherwise): three `Trainer.train_step()`s of the tiny model
   with `rollout.backend: vllm` colocated on `--device`, full weights and then LoRA adapters (r 8 on q and v):
   per step the engine's sleeps and wakes (one each on a GPU, none on the CPU build), weight pushes, push
   seconds and MB, whether the adapters alone were sent, generation seconds, the sampler/learner mismatch
   and peak device memory.
7. `packing` (issue 50): the policy update of the 0.5B and 1.5B shapes (bf16 mixed precision) on one batch of
   8 rollouts a prompt, its forwards laid out as one right-padded row per rollout (`padded`, before issue 50),
   end to end (`packed`), and end to end with each group's prompt forwarded once (`shared`, at rows of
   `ROW_TOKENS` 1024 and 4096): the update's seconds, real tokens/s (the rollouts' prompt and completion
   tokens over the update's time, as `shapes` counts them) and an MFU counting only the FLOPs the update
   needs (each prompt once, causal attention only), at a prompt-heavy shape (512 + 64) and `shapes`' (128 + 384).
"""

from __future__ import annotations

import argparse
import copy
import gc
import inspect
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from adarl.models import peak_memory_gib  # noqa: E402
from decode_cost import SPECIALS, sync, synthetic_tokenizer  # noqa: E402

#: the published shapes (config.json of Qwen/Qwen2.5-0.5B-Instruct and -1.5B-Instruct), built as Llama (random_model)
QWEN = {
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
}
#: small stand-ins for --quick (a CPU): same architecture, head_dim 64
QUICK = {"qwen-tiny-a": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                             num_key_value_heads=1, vocab_size=1024, tie_word_embeddings=True)}
TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            vocab_size=512, tie_word_embeddings=True)
#: dense bf16 peak of the card, FLOP/s (NVIDIA's data sheets), for MFU
PEAK_BF16 = {"H100 PCIe": 756e12, "H100": 989.4e12, "H200": 989.4e12, "A100": 312e12}


def random_model(shape: dict, dtype: torch.dtype, device: torch.device, seed: int = 0):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)
    # Llama with Qwen2.5's dimensions: Qwen2 adds biases to q, k, v (under 0.1% of the FLOPs), and transformers
    # 5 loads a Qwen2 folder's tokenizer as Qwen's BPE whatever its tokenizer_config says
    config = LlamaConfig(**shape, bos_token_id=1, eos_token_id=2, pad_token_id=2, attn_implementation="sdpa")
    with device:  # initialised where it runs: a 1.5B model's init on the host takes long
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = 2, 2
    return model


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
    peak_memory_gib(device, reset=True)


def card(device: torch.device) -> dict[str, Any]:
    if device.type != "cuda":
        return {"device": "cpu", "threads": torch.get_num_threads()}
    name = torch.cuda.get_device_name(device)
    peak = next((v for k, v in PEAK_BF16.items() if k in name), None)
    return {"device": name, "memory_gib": torch.cuda.get_device_properties(device).total_memory / 2**30,
            "peak_bf16_flops": peak, "torch": torch.__version__, "cuda": torch.version.cuda}


def prompt_texts(count: int, length: int, vocab: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(f"t{i}" for i in rng.integers(len(SPECIALS), vocab, length)) for _ in range(count)]


def even_share(prompts, completions, **columns):
    """The reward of sections 2 and 4 (adarl's callable and TRL's signature): 1 when most of the completion's
    tokens have an even id. A random model earns it about half the time, so groups carry signal."""
    out = []
    for c in completions:
        ids = [int(w[1:]) for w in c.split() if w[:1] == "t" and w[1:].isdigit()]
        out.append(float(bool(ids) and sum(i % 2 == 0 for i in ids) > len(ids) / 2))
    return out


# ---------------------------------------------------------------- 1. cpu vs device, one update


def sampled_batch(model, tok, prompts: int, n: int, new_tokens: int, seed: int):
    """A verified batch sampled by adarl's hf decoder: groups with rewards and GRPO advantages."""
    from adarl import registry
    from adarl.config import RolloutConfig
    from adarl.rollout.hf import HfGenerator
    from adarl.types import Batch, Group, Problem, Request

    gen = HfGenerator(model, tok, RolloutConfig(temperature=1.0, max_new_tokens=new_tokens), seed=seed)
    texts = prompt_texts(prompts, 12, tok.vocab_size, seed)
    requests = [Request(str(i), tok.encode(t), n) for i, t in enumerate(texts)]
    rollouts, groups = gen.generate(requests), []
    for i, req in enumerate(requests):
        mine = rollouts[i * n: (i + 1) * n]
        rewards = np.array(even_share(None, [tok.decode(r.completion_ids) for r in mine]))
        groups.append(Group(Problem(req.prompt_id, texts[i]), req.prompt_ids, mine,
                            rewards=rewards[:, None], reward_names=("even_share",)))
    batch = Batch(groups)
    batch.advantages = registry.build("advantage", {"name": "grpo"})(batch)
    return batch, gen.pad_id


def one_update(model, batch, pad_id: int, mixed_precision: str, new_tokens: int) -> dict[str, Any]:
    from adarl import registry
    from adarl.config import TrainConfig
    from adarl.train.learner import Learner

    before = {n: p.detach().float().cpu().clone() for n, p in model.named_parameters()}
    cfg = TrainConfig(lr=1e-3, micro_batch_tokens=64, mixed_precision=mixed_precision)
    learner = Learner(model, registry.build("loss", {"name": "ppo_clip"}), cfg, temperature=1.0, pad_id=pad_id,
                      max_len=new_tokens, rng=np.random.default_rng(0))
    metrics = learner.update(batch)
    after = {n: p.detach().float().cpu() for n, p in model.named_parameters()}
    return {"metrics": metrics, "before": before, "after": after}


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def equality(device: torch.device) -> dict[str, Any]:
    cpu = torch.device("cpu")
    tok = synthetic_tokenizer(TINY["vocab_size"])
    base = random_model(TINY, torch.float32, cpu, seed=0)
    batch, pad_id = sampled_batch(base, tok, prompts=4, n=8, new_tokens=24, seed=0)
    start = copy.deepcopy(base.state_dict())

    def run(dev: torch.device, mp: str, lora: bool = False) -> dict[str, Any]:
        model = random_model(TINY, torch.float32, dev, seed=0)
        model.load_state_dict(start)
        if lora:  # adapters initialised on the CPU (its RNG), then moved: both sides start alike
            from adarl.config import LoraConfig
            from adarl.models import apply_lora

            torch.manual_seed(1)
            model = apply_lora(model.cpu(), LoraConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj"])).to(dev)
        return one_update(model, batch, pad_id, mp, 24)

    refs = {False: run(cpu, "no"), True: run(cpu, "no", lora=True)}
    ref = refs[False]
    out: dict[str, Any] = {"rollouts": len(batch), "tokens": sum(len(r) for r in batch.rollouts),
                           "nonzero_advantages": int(np.count_nonzero(batch.advantages)),
                           "cpu_float32": {k: ref["metrics"][k] for k in ("loss", "grad_norm")}}
    # LoRA (issue 33 item 3): the adapters' update on the device against the same LoRA update on the CPU
    for label, dev, mp, tol, lora in (("device_float32", device, "no", 1e-4, False),
                                      ("device_bf16_mixed", device, "bf16", 2e-2, False),
                                      ("cpu_bf16_mixed", cpu, "bf16", 2e-2, False),
                                      ("device_float32_lora", device, "no", 1e-4, True),
                                      ("device_bf16_mixed_lora", device, "bf16", 2e-2, True)):
        got, ref = run(dev, mp, lora), refs[lora]
        # per tensor ‖w_device − w_cpu‖ / ‖w_cpu‖, the largest over the model's tensors
        weight_rel = max(float((got["after"][n] - ref["after"][n]).norm() / ref["after"][n].norm())
                         for n in ref["after"])
        delta = torch.cat([(got["after"][n] - got["before"][n]).flatten() for n in ref["after"]])
        delta_ref = torch.cat([(ref["after"][n] - ref["before"][n]).flatten() for n in ref["after"]])
        row = {"loss": got["metrics"]["loss"], "grad_norm": got["metrics"]["grad_norm"],
               "loss_rel": rel(got["metrics"]["loss"], ref["metrics"]["loss"]),
               "grad_norm_rel": rel(got["metrics"]["grad_norm"], ref["metrics"]["grad_norm"]),
               "weights_max_rel": weight_rel,
               "update_rel": float((delta - delta_ref).norm() / delta_ref.norm()),
               "sampler_kl_k3": got["metrics"].get("sampler_kl_k3"), "tolerance": tol}
        # Adam's first step moves each weight by about lr·sign(g): the weights agree to ~lr whatever the
        # precision, so the loss and the gradient norm are what the tolerance is judged on
        row["ok"] = row["loss_rel"] <= tol and row["grad_norm_rel"] <= tol and (mp == "bf16" or weight_rel <= tol)
        out[label] = row
    out["group_torn_down"] = not torch.distributed.is_initialized()
    return out


# ---------------------------------------------------------------- 2. the whole trainer step on the device


def write_run_files(folder: Path, shape: dict, dtype: torch.dtype, prompts: list[str],
                    device: torch.device) -> tuple[Path, Path]:
    """A model folder (random weights, synthetic tokenizer), a jsonl task and the reward module."""
    model_dir = folder / "model"
    random_model(shape, dtype, device).save_pretrained(model_dir)
    synthetic_tokenizer(shape["vocab_size"]).save_pretrained(model_dir)
    task = folder / "prompts.jsonl"
    task.write_text("".join(json.dumps({"prompt": p, "answer": "0"}) + "\n" for p in prompts))
    (folder / "gpu_check_rewards.py").write_text(inspect.getsource(even_share))
    sys.path.insert(0, str(folder))  # the reward workers import it too
    os.environ["PYTHONPATH"] = os.pathsep.join([str(folder), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])
    return model_dir, task


def trainer_recipe(model_dir: Path, task: Path, device: torch.device, dtype: str, prompts: int, n: int,
                   new_tokens: int, steps: int, **train):
    from adarl.config import load_recipe

    return load_recipe(data={
        "name": "gpu-check", "seed": 0,
        "model": {"path": str(model_dir), "device": str(device), "dtype": dtype},
        "task": {"source": "jsonl", "path": str(task), "eval_size": 4},
        "rewards": [{"type": "callable", "function": "gpu_check_rewards:even_share"}], "reward_workers": 2,
        "rollout": {"temperature": 1.0, "max_new_tokens": new_tokens, "backend": "hf", "max_batch": 1024},
        "budget": {"max_steps": steps, "prompts_per_step": prompts},
        "allocate": {"name": "fixed", "n": n}, "loss": {"name": "ppo_clip", "agg": "token-mean"},
        "train": {"lr": 1e-6, "micro_batch_tokens": 16384, **train},
        "eval": {"every": 0, "at_start": False}, "checkpoint": {"every": 0},
        "log": {"tensorboard": False, "progress": False}})


def trainer_steps(device: torch.device, work: Path) -> dict[str, Any]:
    from adarl.train.trainer import Trainer

    model_dir, task = write_run_files(work / "tiny", TINY, torch.float32, prompt_texts(40, 12, TINY["vocab_size"], 1),
                                      device)
    out: dict[str, Any] = {}
    for label, mp in (("float32", "no"), ("bf16_mixed", "bf16")):
        recipe = trainer_recipe(model_dir, task, device, "float32", 4, 8, 24, 2, mixed_precision=mp)
        trainer = Trainer(recipe, work / f"run-{label}")
        rows = [trainer.train_step() for _ in range(2)]
        keys = ("reward", "loss", "grad_norm", "behaviour_logp_gap", "sampler_kl_k3", "peak_device_memory_gib",
                "tokens", "step_s", "generate_s", "train_s")
        out[label] = {"model_device": str(next(trainer.model.parameters()).device),
                      "decode_path": getattr(trainer.generator, "last_decode_path", None),
                      "rows": [{k: float(r[k]) for k in keys if k in r} for r in rows]}
        trainer.rewards.close() if hasattr(trainer.rewards, "close") else None
        del trainer
    return out


# ---------------------------------------------------------------- 3. Qwen2.5 shapes: decoding and the update


def decode_speed(model, tok, device: torch.device, rows: int, new_tokens: int, prompt_len: int) -> dict[str, Any]:
    from adarl.config import RolloutConfig
    from adarl.rollout.hf import HfGenerator
    from adarl.types import Request, sampled_tokens

    n = 8
    texts = prompt_texts(rows // n, prompt_len, tok.vocab_size, 2)
    requests = [Request(str(i), tok.encode(t), n) for i, t in enumerate(texts)]
    gen = HfGenerator(model, tok, RolloutConfig(temperature=1.0, max_new_tokens=new_tokens, max_batch=rows), seed=0)
    ids = [tok.encode(t) for t in texts for _ in range(n)]
    batch = tok.pad({"input_ids": ids}, return_tensors="pt").to(device)
    kw = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new_tokens, pad_token_id=2)

    def timed(call):
        sync(device)
        t0 = time.perf_counter()
        with torch.no_grad():
            result = call()
        sync(device)
        return time.perf_counter() - t0, result

    # Each side's warm-up is the timed call itself: a new (rows, length) shape builds its attention and
    # matmul plans once per process (cuDNN SDPA), which would otherwise bill whichever side runs first
    eager = HfGenerator(model, tok, gen.cfg, seed=0)
    eager.static_decode = None  # the growing cache, launched kernel by kernel
    warm = {"adarl": timed(lambda: gen.generate(requests))[0],
            "adarl_eager": timed(lambda: eager.generate(requests))[0],
            "generate": timed(lambda: model.generate(**batch, **kw))[0]}
    ours, rollouts = timed(lambda: gen.generate(requests))
    tokens = sampled_tokens(rollouts)
    eager_s, eager_rollouts = timed(lambda: eager.generate(requests))
    theirs, out = timed(lambda: model.generate(**batch, **kw))
    new = out[:, batch["input_ids"].shape[1]:]
    # a row ends at its first eos; everything after it is padding
    ended = (new == 2).int().cumsum(-1) > 0
    their_tokens = int((~ended).sum() + (ended.any(-1)).sum())
    return {"rows": rows, "new_tokens": new_tokens, "first_call_s": warm, "adarl_decode_path": gen.last_decode_path,
            "adarl_eager_tokens_per_s": sampled_tokens(eager_rollouts) / eager_s,
            "adarl_hf_tokens_per_s": tokens / ours,
            "generate_tokens_per_s": their_tokens / theirs, "ratio": (tokens / ours) / (their_tokens / theirs),
            "adarl_tokens": tokens, "generate_tokens": their_tokens}


def synthetic_batch(rows: int, prompt_len: int, completion_len: int, vocab: int):
    """Groups of 8 rollouts of random tokens at full length, advantages ±1: an update's shape, not a sample."""
    from adarl.types import Batch, Group, Problem, Rollout

    rng = np.random.default_rng(3)
    groups = []
    for g in range(rows // 8):
        rollouts = [Rollout(str(g), rng.integers(3, vocab, completion_len).tolist(), [0.0] * completion_len)
                    for _ in range(8)]
        groups.append(Group(Problem(str(g), ""), rng.integers(3, vocab, prompt_len).tolist(), rollouts,
                            rewards=np.tile([0.0, 1.0], 4)[:, None], reward_names=("r",)))
    batch = Batch(groups)
    batch.advantages = rng.choice([-1.0, 1.0], len(batch))
    return batch


def timed_update(learner: Any, batch: Any, device: torch.device) -> float:
    """The faster of two timed updates of `batch`, after a warm-up (kernels, the optimizer's moments) and with the
    peak memory counted from after it."""
    learner.update(batch)
    reset_peak(device)
    times = []
    for _ in range(2):
        sync(device)
        t0 = time.perf_counter()
        learner.update(batch)
        sync(device)
        times.append(time.perf_counter() - t0)
    return min(times)


def update_speed(model, device: torch.device, rows: int, prompt_len: int, completion_len: int,
                 shape: dict, peak_flops: float | None, fp32_lm_head: bool = True,
                 fused_head: bool = True) -> dict[str, Any]:
    batch = synthetic_batch(rows, prompt_len, completion_len, shape["vocab_size"])
    vocab = shape["vocab_size"]
    from adarl import registry
    from adarl.config import TrainConfig
    from adarl.train import logprobs
    from adarl.train.learner import Learner

    cfg = TrainConfig(lr=1e-6, micro_batch_tokens=16 * (prompt_len + completion_len), mixed_precision="bf16",
                      fp32_lm_head=fp32_lm_head)
    learner = Learner(model, registry.build("loss", {"name": "ppo_clip"}), cfg, temperature=1.0, pad_id=2,
                      max_len=completion_len, rng=np.random.default_rng(0))
    learner.layout = "padded"  # the rows these figures have always counted; `packing` measures the others
    logprobs.FUSED_HEAD = fused_head
    try:  # the switch is process-wide: restored even when an update fails (the next shape runs on)
        seconds = timed_update(learner, batch, device)
    finally:
        logprobs.FUSED_HEAD = True
    tokens = rows * (prompt_len + completion_len)
    h, layers, seq = shape["hidden_size"], shape["num_hidden_layers"], prompt_len + completion_len
    params = sum(p.numel() for p in model.parameters())
    head = vocab * h
    # forward + backward = 3 × forward: 6 FLOPs a parameter a token in the body, the head on completion tokens
    # only (adarl projects only them), causal attention 6·L·h·seq a token; the chunked head's recomputation
    # under checkpointing is not counted (it is not useful work)
    flops = 6 * (params - head) * tokens + 6 * head * rows * completion_len + 6 * layers * h * seq * tokens
    return {"rows": rows, "prompt_len": prompt_len, "completion_len": completion_len, "parameters": params,
            "seconds": seconds, "trained_tokens_per_s": tokens / seconds, "model_flops": flops,
            "mfu": flops / seconds / peak_flops if peak_flops else None, "peak_memory_gib": peak_memory_gib(device),
            "scheme": "bf16 autocast, float32 weights, grads and Adam moments (16 B/param)",
            "lm_head": "float32" if fp32_lm_head else "bf16", "micro_batch_tokens": cfg.micro_batch_tokens,
            "head_backward": "fused (hand-written)" if fused_head else "autograd under checkpoint"}


def each_shape(device: torch.device, quick: bool, measure: Callable[[str, dict, dict], None]) -> dict[str, Any]:
    """`measure(name, shape, res)` for each model shape (the quick ones on a CPU), filling `res`; one shape's
    failure is recorded in its `res` and the others run on; each shape's line is printed as it finishes."""
    out: dict[str, Any] = {}
    for name, shape in (QUICK if quick else QWEN).items():
        res: dict[str, Any] = {}
        try:
            measure(name, shape, res)
        except Exception as err:  # noqa: BLE001 - one shape's failure must not lose the others
            res["error"] = f"{type(err).__name__}: {err}"
            res["traceback"] = traceback.format_exc()[-3000:]
        reset_peak(device)
        out[name] = res
        print(name, json.dumps({k: v for k, v in res.items() if k != "traceback"}, default=str)[:2000], flush=True)
    return out


def shapes(device: torch.device, quick: bool, info: dict) -> dict[str, Any]:
    def measure(name: str, shape: dict, res: dict) -> None:
        tok = synthetic_tokenizer(shape["vocab_size"])
        model = random_model(shape, torch.bfloat16 if device.type == "cuda" else torch.float32, device)
        res["decode"] = [decode_speed(model, tok, device, rows, 32 if quick else 128, 16 if quick else 64)
                         for rows in (64, 256)]
        del model
        reset_peak(device)
        model = random_model(shape, torch.float32, device)
        sizes = (16, 16, 16) if quick else (64, 128, 384)  # rows, prompt and completion lengths
        # the fused head against the autograd one it replaces, in the same run (bf16 head: the fastest)
        variants = ((True, True), (False, True), (False, False))  # (float32 head, fused head)
        res["update"] = [update_speed(model, device, *sizes, shape, info.get("peak_bf16_flops"), fp32_lm_head=fp32,
                                      fused_head=fused) for fp32, fused in variants]

    return each_shape(device, quick, measure)


# ---------------------------------------------------------------- 4. TRL's GRPOTrainer against adarl's step


def vs_trl(device: torch.device, quick: bool, work: Path) -> dict[str, Any]:
    shape = QUICK["qwen-tiny-a"] if quick else QWEN["qwen2.5-0.5b"]
    prompts, n, new_tokens, steps = (2, 4, 16, 3) if quick else (8, 8, 256, 4)
    texts = prompt_texts(prompts * steps, 16 if quick else 64, shape["vocab_size"], 4)
    model_dir, task = write_run_files(work / "vs_trl", shape, torch.bfloat16, texts, device)
    out: dict[str, Any] = {"prompts": prompts, "n": n, "max_new_tokens": new_tokens, "steps": steps,
                           "weights": "bfloat16 (both)", "vllm": False}

    from adarl.train.trainer import Trainer

    recipe = trainer_recipe(model_dir, task, device, "bfloat16", prompts, n, new_tokens, steps)
    trainer = Trainer(recipe, work / "vs_trl-adarl")
    rows = [trainer.train_step() for _ in range(steps)]
    out["adarl"] = {"step_s": [float(r["step_s"]) for r in rows], "tokens": [float(r["tokens"]) for r in rows],
                    "median_step_s": statistics.median(float(r["step_s"]) for r in rows[1:])}
    del trainer
    reset_peak(device)

    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.t0, self.step_s = 0.0, []

        def on_step_begin(self, *a, **k):
            sync(device)
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            sync(device)
            self.step_s.append(time.perf_counter() - self.t0)

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device)
    tok = synthetic_tokenizer(shape["vocab_size"])
    config = GRPOConfig(
        output_dir=str(work / "vs_trl-trl"), max_steps=steps, per_device_train_batch_size=prompts * n,
        gradient_accumulation_steps=1, steps_per_generation=1, num_iterations=1, num_generations=n,
        max_completion_length=new_tokens, temperature=1.0, top_p=1.0, top_k=0, learning_rate=1e-6,
        lr_scheduler_type="constant", optim="adamw_torch", max_grad_norm=1.0, beta=0.0, loss_type="dapo",
        epsilon=0.2, epsilon_high=0.28, scale_rewards="group", shuffle_dataset=False, gradient_checkpointing=False,
        bf16=device.type == "cuda", use_cpu=device.type == "cpu", seed=0, logging_steps=1, save_strategy="no",
        report_to="none", disable_tqdm=True, dataloader_num_workers=0, log_completions=False)

    timer = StepTimer()
    trl = GRPOTrainer(model=model, reward_funcs=[even_share], args=config,
                      train_dataset=Dataset.from_list([{"prompt": t} for t in texts]),
                      processing_class=tok, callbacks=[timer])
    trl.train()
    out["trl"] = {"step_s": timer.step_s, "median_step_s": statistics.median(timer.step_s[1:])}
    out["adarl_over_trl"] = out["adarl"]["median_step_s"] / out["trl"]["median_step_s"]
    return out


# ---------------------------------------------------------------- 5. FSDP2 at world size 1 against one process


def timed_learner(kind: str, shape: dict, device: torch.device, batch, completion_len: int, mixed_precision: str,
                  micro_batch_tokens: int, repeats: int) -> dict[str, Any]:
    """One learner (`single`: `Learner`; `fsdp2`: `ShardedLearner` in a one-rank group) from the seed-0 weights:
    the weights after its first update, then the median of `repeats` more and the peak device memory."""
    from adarl import registry
    from adarl.config import TrainConfig
    from adarl.train.learner import Learner
    from adarl.train.sharded import ShardedLearner, end_distributed

    gc.collect()  # the previous learner's cycles (hooks, optimizer) hold device memory until collected
    reset_peak(device)  # the window holds the weights, then gradients, Adam's moments and activations
    start = torch.cuda.memory_allocated(device) / 2**30 if device.type == "cuda" else None
    model = random_model(shape, torch.float32, device, seed=0)
    cfg = TrainConfig(lr=1e-3, micro_batch_tokens=micro_batch_tokens, mixed_precision=mixed_precision,
                      parallel="fsdp2" if kind == "fsdp2" else "none")
    kw = dict(temperature=1.0, pad_id=2, max_len=completion_len, rng=np.random.default_rng(0))
    before = {n: t.detach().float().cpu().clone() for n, t in model.state_dict().items()}
    try:
        cls = ShardedLearner if kind == "fsdp2" else Learner
        learner = cls(model, registry.build("loss", {"name": "ppo_clip"}), cfg, **kw)
        first = learner.update(batch)  # also the warm-up: kernels, Adam's moments, FSDP's buffers
        weights = learner._full_state_dict() if kind == "fsdp2" else model.state_dict()
        weights = {n: t.detach().float().cpu().clone() for n, t in weights.items()}
        times = []
        for _ in range(repeats):
            sync(device)
            t0 = time.perf_counter()
            learner.update(batch)
            sync(device)
            times.append(time.perf_counter() - t0)
        if kind == "fsdp2":
            learner.close()
    finally:
        if kind == "fsdp2":
            end_distributed()  # the process-wide group: later sections (and the next learner) start without it
    return {"loss": first["loss"], "grad_norm": first["grad_norm"], "before": before, "weights": weights,
            "median_update_s": statistics.median(times), "update_s": times,
            "start_memory_gib": start, "peak_memory_gib": peak_memory_gib(device)}


def fsdp2(device: torch.device, quick: bool) -> dict[str, Any]:
    """`Learner` against `ShardedLearner` at world size 1: the same weights after one float32 update, and
    what the sharding machinery costs in time and memory when there is nothing to shard over."""
    shape = QUICK["qwen-tiny-a"] if quick else QWEN["qwen2.5-0.5b"]
    rows, prompt_len, completion_len = (16, 16, 16) if quick else (32, 128, 384)
    batch = synthetic_batch(rows, prompt_len, completion_len, shape["vocab_size"])
    out: dict[str, Any] = {
        "shape": "qwen-tiny-a" if quick else "qwen2.5-0.5b", "rows": rows, "prompt_len": prompt_len,
        "completion_len": completion_len, "world_size": 1, "timed_updates": 3,
        "memory": "torch.cuda.max_memory_allocated from the model's build to the last update (start_memory_gib: "
                  "what was allocated before it); None on a CPU (the process's RSS does not fall when the first "
                  "learner is freed, so the second's would not compare)"}
    for mp in ("no", "bf16"):
        label = "float32" if mp == "no" else "bf16_mixed"
        runs = {kind: timed_learner(kind, shape, device, batch, completion_len, mp, 16 * (prompt_len + completion_len),
                                    repeats=3)
                for kind in ("single", "fsdp2")}
        one, sharded = runs["single"]["weights"], runs["fsdp2"]["weights"]
        if set(one) != set(sharded):
            raise AssertionError(f"fsdp2's state dict names differ: {sorted(set(one) ^ set(sharded))[:5]}")
        before = runs["single"]["before"]  # both built from seed 0 on the device (its own generator)
        if any(not torch.equal(before[n], runs["fsdp2"]["before"][n]) for n in before):
            raise AssertionError("the two learners did not start from the same weights")
        delta = torch.cat([(one[n] - before[n]).flatten() for n in one])
        delta_sharded = torch.cat([(sharded[n] - before[n]).flatten() for n in one])
        row: dict[str, Any] = {
            # |w_fsdp2 − w_single| over every weight after one update (lr 1e-3: Adam moves each by ~1e-3)
            "weights_max_abs_diff": max(float((sharded[n] - one[n]).abs().max()) for n in one),
            "update_rel": float((delta_sharded - delta).norm() / delta.norm()),
            "loss_rel": rel(runs["fsdp2"]["loss"], runs["single"]["loss"]),
            "grad_norm_rel": rel(runs["fsdp2"]["grad_norm"], runs["single"]["grad_norm"]),
            "tolerance": 1e-5 if mp == "no" else None}
        for kind, r in runs.items():
            row[kind] = {k: v for k, v in r.items() if k not in ("before", "weights")}
        row["fsdp2_over_single_time"] = row["fsdp2"]["median_update_s"] / row["single"]["median_update_s"]
        if device.type == "cuda":
            row["fsdp2_over_single_memory"] = row["fsdp2"]["peak_memory_gib"] / row["single"]["peak_memory_gib"]
        # bf16: FSDP2 casts the gathered layers to bf16 where the one-process learner autocasts float32
        # weights, so the two differ by bf16 rounding; only the float32 row is judged
        row["ok"] = row["weights_max_abs_diff"] <= 1e-5 if mp == "no" else None
        out[label] = row
    out["group_torn_down"] = not torch.distributed.is_initialized()
    return out


# ---------------------------------------------------------------- 7. the update's layouts, padded to shared


def needed_flops(shape: dict, params: int, groups: int, n: int, prompt_len: int, completion_len: int) -> float:
    """The FLOPs of one update that are needed: forward + backward (6 a parameter a token) of each prompt once and
    every completion, the head on completion tokens only, attention over the keys each token sees causally
    (12·h a query-key pair per layer, forward and backward)."""
    h, layers = shape["hidden_size"], shape["num_hidden_layers"]
    head = shape["vocab_size"] * h
    tokens = groups * (prompt_len + n * completion_len)
    pairs = groups * (prompt_len * (prompt_len + 1) // 2
                      + n * (completion_len * prompt_len + completion_len * (completion_len + 1) // 2))
    return 6 * (params - head) * tokens + 6 * head * groups * n * completion_len + 12 * layers * h * pairs


def layout_speeds(model, device: torch.device, rows: int, prompt_len: int, completion_len: int, shape: dict,
                  peak_flops: float | None) -> dict[str, Any]:
    from adarl import registry
    from adarl.config import TrainConfig
    from adarl.train import logprobs
    from adarl.train.learner import Learner

    batch = synthetic_batch(rows, prompt_len, completion_len, shape["vocab_size"])  # groups of 8
    cfg = TrainConfig(lr=1e-6, micro_batch_tokens=16 * (prompt_len + completion_len), mixed_precision="bf16")
    params = sum(p.numel() for p in model.parameters())
    needed = needed_flops(shape, params, rows // 8, 8, prompt_len, completion_len)
    out: dict[str, Any] = {"rows": rows, "prompt_len": prompt_len, "completion_len": completion_len,
                           "micro_batch_tokens": cfg.micro_batch_tokens, "needed_flops": needed}
    default_row = logprobs.ROW_TOKENS
    try:
        for label, layout, row_tokens in (("padded", "padded", default_row), ("packed", "packed", default_row),
                                          ("shared", "shared", 1024), ("shared_rows_4096", "shared", 4096)):
            logprobs.ROW_TOKENS = row_tokens
            learner = Learner(model, registry.build("loss", {"name": "ppo_clip"}), cfg, temperature=1.0, pad_id=2,
                              max_len=completion_len, rng=np.random.default_rng(0))
            learner.layout = layout
            seconds = timed_update(learner, batch, device)
            out[label] = {"seconds": seconds, "real_tokens_per_s": rows * (prompt_len + completion_len) / seconds,
                          "mfu_needed": needed / seconds / peak_flops if peak_flops else None,
                          "row_tokens": row_tokens, "peak_memory_gib": peak_memory_gib(device)}
            del learner
            gc.collect()
    finally:
        logprobs.ROW_TOKENS = default_row
    for label in ("packed", "shared", "shared_rows_4096"):
        out[label]["tokens_per_s_vs_padded"] = out[label]["real_tokens_per_s"] / out["padded"]["real_tokens_per_s"]
    return out


def packing(device: torch.device, quick: bool, info: dict) -> dict[str, Any]:
    def measure(name: str, shape: dict, res: dict) -> None:
        model = random_model(shape, torch.float32, device)
        for sizes in ((16, 16, 8),) if quick else ((64, 512, 64), (64, 128, 384)):  # rows, prompt, completion
            res["x".join(map(str, sizes))] = layout_speeds(model, device, *sizes, shape, info.get("peak_bf16_flops"))

    return each_shape(device, quick, measure)


# ---------------------------------------------------------------- profile: where a decode step's time goes


def profile(device: torch.device, quick: bool) -> dict[str, Any]:
    """torch.profiler over a short decode of adarl's hf decoder and of `model.generate` (0.5B shape, 64 rows)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from adarl.config import RolloutConfig
    from adarl.rollout.hf import HfGenerator
    from adarl.types import Request

    shape = QUICK["qwen-tiny-a"] if quick else QWEN["qwen2.5-0.5b"]
    tok = synthetic_tokenizer(shape["vocab_size"])
    model = random_model(shape, torch.bfloat16 if device.type == "cuda" else torch.float32, device)
    texts = prompt_texts(8, 64, shape["vocab_size"], 2)
    requests = [Request(str(i), tok.encode(t), 8) for i, t in enumerate(texts)]
    gen = HfGenerator(model, tok, RolloutConfig(temperature=1.0, max_new_tokens=32, max_batch=64), seed=0)
    ids = [tok.encode(t) for t in texts for _ in range(8)]
    batch = tok.pad({"input_ids": ids}, return_tensors="pt").to(device)
    kw = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=32, pad_token_id=2)
    runs = {"adarl_hf": lambda: gen.generate(requests), "generate": lambda: model.generate(**batch, **kw)}
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    out: dict[str, Any] = {}
    for name, call in runs.items():
        with torch.no_grad():
            call()  # warm-up
            sync(device)
            t0 = time.perf_counter()
            call()
            sync(device)
            plain = time.perf_counter() - t0
            with torch_profile(activities=activities) as prof:
                call()
                sync(device)
        sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        out[name] = {"seconds_32_tokens": plain,
                     "by_device_time": prof.key_averages().table(sort_by=sort, row_limit=18, max_name_column_width=60),
                     "by_cpu_time": prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18,
                                                              max_name_column_width=60)}
        print(f"-- {name}: {plain:.3f} s\n{out[name]['by_device_time']}\n{out[name]['by_cpu_time']}", flush=True)
    return out


# ---------------------------------------------------------------- 6. vLLM colocated with the learner


def vllm_colocated(device: torch.device, work: Path) -> dict[str, Any]:
    """Three trainer steps on vLLM (the engine beside the learner on `device`), full weights and LoRA."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return {"skipped": "vLLM is not importable here"}
    from adarl.config import LoraConfig
    from adarl.rollout.base import innermost
    from adarl.train.trainer import Trainer

    model_dir, task = write_run_files(work / "tiny-vllm", TINY, torch.float32,
                                      prompt_texts(40, 12, TINY["vocab_size"], 2), device)
    out: dict[str, Any] = {}
    for label, lora in (("full", None), ("lora", LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))):
        recipe = trainer_recipe(model_dir, task, device, "float32", 4, 8, 24, 3)
        recipe.rollout.backend = "vllm"
        recipe.rollout.vllm.kv_cache_gib = 1.0  # the CPU build's KV cache
        recipe.model.lora = lora
        trainer = Trainer(recipe, work / f"run-vllm-{label}")
        try:
            rows = [trainer.train_step() for _ in range(3)]
        finally:
            innermost(trainer.generator).close()
            trainer.rewards.close()
        keys = ("vllm/sleeps", "vllm/wakes", "vllm/weight_pushes", "vllm/push_s", "vllm/push_mb",
                "vllm/adapters_only", "generate_s", "train_s", "weight_sync_s", "behaviour_logp_gap",
                "sampler_kl_k3", "peak_device_memory_gib")
        out[label] = {"rows": [{k: float(r[k]) for k in keys if k in r} for r in rows]}
        del trainer
        gc.collect()
    return out


# ---------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="small shapes and batches (a CPU, a test)")
    parser.add_argument("--sections", default="equality,trainer,shapes,vs_trl,fsdp2,vllm,packing")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    device = torch.device(args.device)
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"card": card(device), "command": " ".join(sys.argv), "quick": args.quick}
    print(json.dumps(result["card"]), flush=True)
    t_all = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as tmp:
        work = Path(tmp)
        sections = {"equality": lambda: equality(device), "trainer": lambda: trainer_steps(device, work),
                    "shapes": lambda: shapes(device, args.quick, result["card"]),
                    "vs_trl": lambda: vs_trl(device, args.quick, work), "fsdp2": lambda: fsdp2(device, args.quick),
                    "profile": lambda: profile(device, args.quick), "vllm": lambda: vllm_colocated(device, work),
                    "packing": lambda: packing(device, args.quick, result["card"])}
        for name in args.sections.split(","):
            t0 = time.perf_counter()
            try:
                result[name] = sections[name]()
            except Exception as err:  # noqa: BLE001 - record it, run the next section
                result[name] = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-3000:]}
            result[name]["seconds"] = time.perf_counter() - t0
            result["seconds"] = time.perf_counter() - t_all
            out_path.write_text(json.dumps(result, indent=1, default=str))
            shown = {k: v for k, v in result[name].items() if k != "traceback"}
            print(f"== {name} ({result[name]['seconds']:.0f} s): {json.dumps(shown, default=str)[:3000]}", flush=True)


if __name__ == "__main__":
    main()
