"""Delta weight sync (rollout/weights.py: `weight_delta`, what the Ray pool sends a worker after each update):
its bytes a step against the whole weights, for a bf16 model trained by AdamW (issue 51's target: <= 0.2x after
the first push).

    .venv/bin/python bench/delta_sync.py --out bench/results/delta_sync/delta_sync.json

The model is a random Llama (2 layers, hidden 128, vocab 512, tied head: 853 kB in bf16) built in the script;
each step is one AdamW update on a random batch (causal LM loss), at each learning rate. A bf16 word changes
only when the update moves it by half a unit in its last place, so most words stay put at RL's small rates.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from adarl.rollout.weights import delta_bytes, hf_weights, weight_delta  # noqa: E402


def measure(lr: float, steps: int, seed: int = 0) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    held = {n: t.clone() for n, t in hf_weights(model)}
    full = sum(t.numel() * t.element_size() for t in held.values())
    fractions, forms = [], []
    for _ in range(steps):
        ids = torch.randint(0, config.vocab_size, (8, 32))
        optimizer.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        new = {n: t.clone() for n, t in hf_weights(model)}
        delta = weight_delta(held, new)
        fractions.append(delta_bytes(delta) / full)
        forms.append({form: sum(part[0] == form for part in delta.values()) for form in ("at", "mask", "whole")})
        held = new
    return {"lr": lr, "full_bytes": full, "delta_over_full": fractions, "tensors_by_form": forms}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lrs", default="1e-6,1e-5")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(1)
    runs = [measure(float(lr), args.steps) for lr in args.lrs.split(",")]
    for r in runs:
        print(f"lr {r['lr']:g}: whole weights {r['full_bytes']} B; a step's delta / whole: "
              + ", ".join(f"{f:.3f}" for f in r["delta_over_full"]))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"command": " ".join(sys.argv), "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
