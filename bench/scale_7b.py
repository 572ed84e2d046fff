"""A 7B policy on 1×8 and 4×8 H100s: memory per learner rank and a step's time, on paper (docs/scale.md).

Nothing of 7B has run. The figures measured by this project are read from bench/results (the file is named
beside each); the rest are assumptions or published figures, named as such in ASSUMED. The set-up is
adarl's: FSDP2 learner ranks (`train.parallel: fsdp2`) on some GPUs, Ray rollout workers on the others,
synchronous steps (generate, then update, then publish the weights to the workers):

    t_step = t_gen + t_update + t_publish
    t_gen     = max(G / (W · r), L_max · t_min)       G sampled tokens, W workers at r tok/s each; the longest
                                                      rollout's L_max decode steps at t_min each, whatever W
    t_update  = FLOPs(T trained tokens) / (K · m · peak)      K ranks at useful MFU m
    t_publish = S / B_d2h + S_remote / B_ib + S / b_bcast + (nodes with workers − 1) · S / B_ib

    .venv/bin/python bench/scale_7b.py            # prints the tables docs/scale.md shows
"""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
GB = 1e9

# Qwen2.5-7B's config.json (hidden 3584, intermediate 18944, 28 layers, 28/4 heads, vocab 152064, untied head)
H, FFN, LAYERS, KV, VOCAB = 3584, 18944, 28, 4 * 128, 152064
LAYER_PARAMS = 2 * H * H + 2 * H * KV + 3 * H * FFN + 2 * H + H + 2 * KV  # attention, MLP, norms, q/k/v biases
EMBED = HEAD = VOCAB * H
PARAMS = LAYERS * LAYER_PARAMS + EMBED + HEAD + H  # 7.62e9 (published: 7.61B)

ASSUMED = {
    "peak_bf16_flops": (989.4e12, "H100 SXM dense bf16, NVIDIA's data sheet"),
    "bytes_per_param": (16, "float32 weights, gradients, Adam m and v (adarl's bf16 scheme; FSDP2 shards all four)"),
    "nvlink_bytes_s": (450e9, "NVLink 4, about 450 GB/s per direction per GPU (assumed)"),
    "ib_bytes_s": (50e9, "400 Gb/s InfiniBand per GPU (assumed); Ray moves objects over TCP, so an upper bound"),
    "d2h_bytes_s": (25e9, "device to host copy of the gathered weights, pageable memory over PCIe 5 (assumed)"),
    "worker_tokens_s": (
        10e3,
        "sampled tok/s of one H100 worker on a 7B (vLLM-class engine, 256 rows; assumed: "
        "a step at 256 rows reads 15 GB of weights and does 3.9 TFLOP, 10-13 ms at best)",
    ),
    "decode_step_min_s": (0.010, "one decode step of the 7B with few rows left (assumed; 1.5B measured 9.6 ms)"),
    "recompute": (6 / 8, "activation checkpointing recomputes the forward: 8 FLOPs a parameter-token, 6 useful"),
    "prime_rl_mfu": (0.11, "published: prime-rl, Qwen3-0.6B full fine-tuning on one H100, FSDP2, 16k tokens"),
    "micro_batch_tokens": (8192, "per rank per forward/backward (train.micro_batch_tokens)"),
}
STEP = {"rollouts": 512, "prompt": 256, "completion_mean": 768, "completion_max": 2048}  # 64 prompts × 8


def measured() -> dict:
    """The measured figures this model uses, each with its file."""
    gpu = json.loads((RESULTS / "gpu" / "gpu_check_h100.json").read_text())
    graphs = json.loads((RESULTS / "gpu" / "gpu_check_h100_graphs.json").read_text())
    ray = json.loads((RESULTS / "scale" / "scale.json").read_text())["setups"]["ray-1-worker"]
    fp32_head, bf16_head = gpu["shapes"]["qwen2.5-1.5b"]["update"]
    decode = {d["rows"]: d for d in graphs["shapes"]["qwen2.5-1.5b"]["decode"]}
    # the 1.5B update's peak less its 16 B/param and autocast's bf16 copies of the linear weights: activations
    # of micro_batch_tokens tokens through 28 layers, per token, layer and hidden unit
    params = bf16_head["parameters"]
    act = bf16_head["peak_memory_gib"] * 2**30 - 16 * params - 2 * params
    return {
        "mfu_bf16_head": (bf16_head["mfu"], "bench/results/gpu/gpu_check_h100.json, Qwen2.5-1.5B shape, one process"),
        "mfu_fp32_head": (fp32_head["mfu"], "bench/results/gpu/gpu_check_h100.json, the same with a float32 head"),
        "activation_bytes_per_token_layer_hidden": (
            act / (bf16_head["micro_batch_tokens"] * 28 * 1536),
            "bench/results/gpu/gpu_check_h100.json: peak 52.8 GiB at 1.5B",
        ),
        "hf_decode_1.5b_256_rows": (
            decode[256]["adarl_hf_tokens_per_s"],
            "bench/results/gpu/gpu_check_h100_graphs.json, hf decoder, CUDA graphs",
        ),
        "params_1.5b": (params, "bench/results/gpu/gpu_check_h100.json"),
        "broadcast_bytes_s": (
            ray["broadcast_mb"] * 2**20 / ray["weight_sync_s"],
            "bench/results/scale/scale.json: 621 MiB put, loaded and health-checked by one "
            "Ray worker in 0.30 s, on this 2-core CPU machine",
        ),
    }


def memory_per_rank(ranks: int, m: dict) -> dict[str, float]:
    """GB on one learner rank: shards, the root held whole, the gathered layers, activations."""
    tokens = ASSUMED["micro_batch_tokens"][0]
    per_layer = m["activation_bytes_per_token_layer_hidden"][0] * H  # one layer's activations, one token
    return {
        "shards (16 B/param ÷ K)": ASSUMED["bytes_per_param"][0] * PARAMS / ranks / GB,
        # adarl's root (embedding, final norm, head) stays float32 (fp32_lm_head) and FSDP2 keeps the root
        # gathered from forward to backward: its weights and gradients whole on every rank
        "root whole, float32 + grads": 2 * 4 * (EMBED + HEAD) / GB,
        # the layer computed and the one prefetched in bf16, and one layer's bf16 + float32 gradients
        "gathered layers": LAYER_PARAMS * (2 + 2 + 2 + 4) / GB,
        # checkpointing: every layer's bf16 input kept, one layer's activations while it is recomputed
        "activations (8k tokens, checkpointed)": tokens * (LAYERS * 2 * H + per_layer) / GB,
    }


def update_flops(rollouts: int) -> float:
    """As gpu_check counts MFU: 6 FLOPs a parameter-token in the body, the head on completion tokens only,
    causal attention 6·L·h·seq a token."""
    seq = STEP["prompt"] + STEP["completion_mean"]
    tokens, completion = rollouts * seq, rollouts * STEP["completion_mean"]
    body = PARAMS - EMBED - HEAD
    return 6 * body * tokens + 6 * HEAD * completion + 6 * LAYERS * H * seq * tokens


def step(
    ranks: int, workers: int, rollouts: int, mfu: float, m: dict, worker_tokens_s: float | None = None
) -> dict[str, float]:
    """One synchronous step; learner ranks fill the first GPUs (rank 0's node first), workers the rest."""
    rate = worker_tokens_s or ASSUMED["worker_tokens_s"][0]
    sampled = rollouts * STEP["completion_mean"]
    generate = max(sampled / (workers * rate), STEP["completion_max"] * ASSUMED["decode_step_min_s"][0])
    update = update_flops(rollouts) / (ranks * mfu * ASSUMED["peak_bf16_flops"][0])
    weights = 4 * PARAMS  # the float32 master weights: what the Ray pool ships (the model's dtype)
    remote_shards = max(0, ranks - 8) / ranks * weights
    worker_nodes = len({g // 8 for g in range(ranks, ranks + workers)} - {0})
    publish = (
        weights / ASSUMED["d2h_bytes_s"][0]
        + remote_shards / ASSUMED["ib_bytes_s"][0]
        + weights / m["broadcast_bytes_s"][0]
        + worker_nodes * weights / ASSUMED["ib_bytes_s"][0]
    )
    total = generate + update + publish
    return {
        "generate_s": generate,
        "update_s": update,
        "publish_s": publish,
        "step_s": total,
        "sampled_tok_s": sampled / total,
    }


def main() -> None:
    m = measured()
    useful = {
        "central": m["mfu_bf16_head"][0] * ASSUMED["recompute"][0],
        "low": m["mfu_fp32_head"][0] * ASSUMED["recompute"][0],
    }
    print(
        f"7B: {PARAMS / 1e9:.2f}B parameters, {LAYER_PARAMS / 1e6:.0f}M a layer; useful MFU "
        f"{useful['central']:.3f} (measured {m['mfu_bf16_head'][0]:.3f} × 6/8), low {useful['low']:.3f} "
        f"(float32 head; prime-rl published 0.11)"
    )
    for name, (value, source) in {**m, **ASSUMED}.items():
        print(f"  {name}: {value:.4g}  [{source}]")
    print("\n| learner ranks K | " + " | ".join(memory_per_rank(1, m)) + " | total | rank 0 (+ its whole model) |")
    print("|---:" * 7 + "|")
    for k in (4, 6, 8, 16, 30):
        parts = memory_per_rank(k, m)
        total = sum(parts.values())
        print(
            f"| {k} | " + " | ".join(f"{v:.1f}" for v in parts.values()) + f" | {total:.1f} | "
            f"{total + 4 * PARAMS / GB:.1f} |"
        )
    flops = update_flops(STEP["rollouts"])
    print(
        f"\nupdate of {STEP['rollouts']} rollouts: {flops:.3g} FLOPs = {flops / (useful['central'] * 989.4e12):.0f}"
        f" GPU-seconds at the central MFU, {flops / (useful['low'] * 989.4e12):.0f} at the low"
    )
    print(
        "\n| GPUs | K learner ranks | W workers | rollouts/step | generate s | update s | publish s | step s | "
        "sampled tok/s | update s at low MFU |"
    )
    print("|---" * 10 + "|")
    for gpus, k, w, rollouts in (
        (8, 4, 4, 512),
        (8, 6, 2, 512),
        (32, 30, 2, 512),
        (32, 16, 16, 2048),
        (32, 24, 8, 2048),
    ):
        s, low = step(k, w, rollouts, useful["central"], m), step(k, w, rollouts, useful["low"], m)
        print(
            f"| {gpus} | {k} | {w} | {rollouts} | {s['generate_s']:.1f} | {s['update_s']:.1f} | "
            f"{s['publish_s']:.1f} | {s['step_s']:.1f} | {s['sampled_tok_s']:.0f} | {low['update_s']:.1f} |"
        )
    hf = m["hf_decode_1.5b_256_rows"][0] * m["params_1.5b"][0] / PARAMS
    s = step(6, 2, 512, useful["central"], m, worker_tokens_s=hf)
    print(
        f"\nwith the hf decoder instead (1.5B's {m['hf_decode_1.5b_256_rows'][0]:.0f} tok/s scaled by parameters: "
        f"{hf:.0f} tok/s a GPU), 8 GPUs, K 6, W 2: generate {s['generate_s']:.1f} s, step {s['step_s']:.1f} s"
    )
    # the per-layer collectives against the layer's compute, per micro-batch (forward gather, backward gather,
    # float32 reduce-scatter) at the raw (not useful) throughput the 1.5B update measured
    traffic = LAYER_PARAMS * (2 + 2 + 4)
    per_token = 8 * LAYER_PARAMS / (m["mfu_bf16_head"][0] * ASSUMED["peak_bf16_flops"][0])
    for label, bw in (("NVLink", ASSUMED["nvlink_bytes_s"][0]), ("InfiniBand", ASSUMED["ib_bytes_s"][0])):
        print(
            f"per layer per micro-batch: {traffic / GB:.2f} GB over {label} = {traffic / bw * 1e3:.1f} ms; compute "
            f"hides it from {traffic / bw / per_token:.0f} tokens per rank per micro-batch"
        )


if __name__ == "__main__":
    main()
