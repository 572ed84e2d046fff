"""How far a bfloat16 vLLM engine trails float32 master weights: the sampler/learner gap before and after pushes.

    python bench/bf16_lag.py            # SmolLM2-135M, vLLM's engine in bfloat16 (its CPU build here)

Prints the mean and max |ℓ_θ − ℓ_beh| over 8 sampled rollouts of one prompt (T = 0.7), ℓ_θ the float32
learner's, ℓ_beh the engine's: as built; after pushing the same weights again (the push alone); after one
coherent step of 1e-5 against the sign of the gradient of those rollouts' log-probs (as Adam's first step
at lr 1e-5), pushed. With it, the step's own move of the float32 ℓ_θ. docs/methods/mismatch.md quotes it.
"""

from __future__ import annotations

import argparse

import torch

from adarl.config import ModelConfig, RolloutConfig
from adarl.models import chat_ids, load_model
from adarl.rollout.base import Weights
from adarl.rollout.vllm import VllmGenerator
from adarl.train.logprobs import completion_logprobs, pack
from adarl.types import Request


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--lr", type=float, default=1e-5)
    args = parser.parse_args()
    torch.manual_seed(0)
    model, tok = load_model(ModelConfig(path=args.model, dtype="float32"))
    gen = VllmGenerator(model, tok, RolloutConfig(max_new_tokens=24, temperature=0.7,
                                                  vllm={"kv_cache_gib": 0.5, "dtype": "bfloat16"}))
    ids = chat_ids(tok, [{"role": "user", "content": "Calculate 85 + 48."}])

    def sample() -> tuple[torch.Tensor, list, torch.Tensor]:
        rollouts = gen.generate([Request("a", ids, 8)])
        packed = pack([ids] * 8, [r.completion_ids for r in rollouts], gen.pad_id)
        mask = torch.zeros(8, max(len(r) for r in rollouts))
        for j, r in enumerate(rollouts):
            mask[j, : len(r)] = 1
        return packed, rollouts, mask

    def gap(label: str) -> None:
        packed, rollouts, mask = sample()
        with torch.no_grad():
            logp = completion_logprobs(gen.model, packed, temperature=0.7)[0]
        d = torch.cat([(logp[j, : len(r)] - torch.tensor(r.logprobs)).abs() for j, r in enumerate(rollouts)])
        print(f"{label}: mean |ℓ_θ − ℓ_beh| {float(d.mean()):.4f}, max {float(d.max()):.4f} ({d.numel()} tokens)")

    try:
        gap("as built")
        gen.load_weights(Weights.of(gen.model))
        gap("the same weights pushed again")
        packed, _, mask = sample()
        before = completion_logprobs(gen.model, packed, temperature=0.7)[0]
        gen.model.zero_grad()
        (before * mask).sum().backward()
        with torch.no_grad():
            for p in gen.model.parameters():
                if p.grad is not None:
                    p.sub_(args.lr * torch.sign(p.grad))
            after = completion_logprobs(gen.model, packed, temperature=0.7)[0]
        moved = float(((after - before.detach()).abs() * mask).sum() / mask.sum())
        print(f"a coherent step of {args.lr:g} moves the float32 ℓ_θ by {moved:.4f} per token on average")
        gen.load_weights(Weights.of(gen.model))
        gap("that step pushed")
    finally:
        gen.close()


if __name__ == "__main__":
    main()
