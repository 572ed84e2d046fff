"""Learner updates of the tiny model on fixed synthetic batches, in one process or as FSDP2 ranks.

    python tests/sharded_update.py MODEL_DIR OUT.pt [options]                          # one process
    python -m torch.distributed.run --nproc-per-node 2 tests/sharded_update.py ... --parallel fsdp2

Step s trains on batch s (seeded by s), so a run resumed from a checkpoint sees the same batches.
Rank 0 writes the full weights after the last step to OUT.pt (tests/train/test_sharded.py compares them).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch


def synthetic_batch(step: int, vocab: int, groups: int = 4, n: int = 4):
    """Groups of n rollouts of uneven lengths (3-17 completion tokens), advantages ±1 and 0."""
    from adarl.types import Batch, Group, Problem, Rollout

    rng = np.random.default_rng(1000 + step)
    out = []
    for g in range(groups):
        prompt = rng.integers(3, vocab, int(rng.integers(4, 9))).tolist()
        rollouts = []
        for _ in range(n):
            length = int(rng.integers(3, 18))
            rollouts.append(Rollout(str(g), rng.integers(3, vocab, length).tolist(),
                                    (-rng.random(length)).tolist()))
        out.append(Group(Problem(str(g), ""), prompt, rollouts, rewards=np.zeros((n, 1)), reward_names=("r",)))
    batch = Batch(out)
    batch.advantages = rng.choice([-1.0, 0.0, 1.0, 0.5], len(batch))
    return batch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("out")
    ap.add_argument("--parallel", default="none", choices=["none", "fsdp2"])
    ap.add_argument("--agg", default="token-mean",
                    help="comma-separated aggregation modes, one run each (OUT.pt: {mode: weights}); a mode "
                         "with +per-rank-normaliser weighs each rank's share as if it were the mini-batch (a bug "
                         "the comparison must catch)")
    ap.add_argument("--micro-batch-tokens", type=int, default=100_000)
    ap.add_argument("--mini-batches", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--mixed-precision", default="no", choices=["no", "bf16"])
    ap.add_argument("--cpu-offload", action="store_true", help="fsdp2: shards and optimizer state on the host")
    ap.add_argument("--save-after", type=int, default=0, help="write a sharded checkpoint after this step")
    ap.add_argument("--checkpoint", type=Path, help="the checkpoint folder to write or --resume from")
    ap.add_argument("--resume", action="store_true", help="load --checkpoint, then run the steps after it")
    args = ap.parse_args()
    out = {}
    for agg in args.agg.split(","):
        result = run(args, *agg.split("+"))
        if result is not None:  # rank 0
            out[agg] = result
    if out:
        torch.save(out, args.out)


def run(args: argparse.Namespace, agg: str, bug: str = "") -> dict | None:
    """Rank 0: {"weights": the full weights after the last step, "grad_norm": one per update, "saved_weights":
    those in the checkpoint written}; the other ranks: None."""
    from transformers import AutoModelForCausalLM

    from adarl import registry
    from adarl.config import TrainConfig
    from adarl.train.learner import Learner

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    cfg = TrainConfig(lr=args.lr, micro_batch_tokens=args.micro_batch_tokens, mini_batches=args.mini_batches,
                      max_grad_norm=None, parallel=args.parallel, mixed_precision=args.mixed_precision,
                      cpu_offload=args.cpu_offload)
    loss = registry.build("loss", {"name": "ppo_clip", "agg": agg})
    kw = dict(temperature=1.0, pad_id=2, max_len=17, rng=np.random.default_rng(0))
    if args.parallel == "fsdp2":
        from adarl.train.sharded import ShardedLearner

        learner: Learner = ShardedLearner(model, loss, cfg, **kw)
        if bug == "per-rank-normaliser":
            from adarl.loss.aggregate import sequence_weights

            def per_rank(data, todo, seq_weight, self=learner):
                share = self._my_micro_batches(todo, data)
                mine = sorted(i for micro in share for i in micro)
                kept = np.array([int((data.token_weights[i] > 0).sum()) for i in mine])
                local = dict(zip(mine, sequence_weights(kept, self.loss.agg, self.max_len), strict=True))
                return ShardedLearner.forward_backward(self, data, todo, {i: local.get(i, 0.0) for i in todo})

            learner.forward_backward = per_rank
    else:
        learner = Learner(model, loss, cfg, **kw)
    if getattr(learner, "rank", 0) != 0:  # the other ranks run rank 0's calls until it closes
        learner.serve()
        return None
    # the dtype a layer's weights have while it computes (FSDP2 gathers them in its mixed-precision dtype)
    dtypes: set[str] = set()
    q_proj = next(m for name, m in model.named_modules() if name.endswith("q_proj"))
    q_proj.register_forward_pre_hook(lambda module, _: dtypes.add(str(module.weight.dtype)))
    first = 0
    if args.resume:
        state = torch.load(args.checkpoint / "state.pt", weights_only=False)
        learner.load(args.checkpoint)  # sharded, read at this world size (one process: whole)
        learner.load_state_dict(state)
        learner.rng.bit_generator.state = state["rng"]
        first = state["step"]
    vocab = model.config.vocab_size
    grad_norms, saved = [], None
    for step in range(first, args.steps):
        grad_norms.append(learner.update(synthetic_batch(step, vocab))["grad_norm"])
        if args.save_after and step + 1 == args.save_after:
            args.checkpoint.mkdir(parents=True, exist_ok=True)
            learner.save(args.checkpoint)  # every rank its shards, in args.checkpoint / "sharded"
            saved = learner._full_state_dict()  # the weights in the checkpoint
            torch.save({**learner.state_dict(), "rng": learner.rng.bit_generator.state, "step": step + 1},
                       args.checkpoint / "state.pt")
    if args.parallel == "fsdp2":
        weights = learner._full_state_dict()
        learner.close()
    else:
        weights = {n: p.detach().clone() for n, p in model.state_dict().items()}
    return {"weights": weights, "grad_norm": grad_norms, "saved_weights": saved, "compute_dtypes": sorted(dtypes)}


if __name__ == "__main__":
    main()
