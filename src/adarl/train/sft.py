"""Supervised fine-tuning on a task's (prompt, answer) pairs, with plain NLL or OTR (loss/otr.py).

Each step takes `budget.prompts_per_step` training problems (a seeded shuffle, epoch after epoch),
trains on `prompt → answer + eos` with the loss on the answer tokens only, and writes one row to
`metrics.jsonl`: `loss`, `target_logprob` (mean log π(answer token) before the update), and for OTR
`hit_fraction` / `fallback_fraction`. Only the hidden states that predict answer tokens go through
the lm head (answers are short, so their full-vocabulary logits are cheap; OTR samples from them).
The trained model is written to `run_dir/final`.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from adarl.config import Recipe
from adarl.loss.otr import nll_token_loss, otr_token_loss
from adarl.metrics.sinks import MetricsWriter
from adarl.models import chat_ids, load_model
from adarl.tasks.base import build_task
from adarl.train import checkpoint
from adarl.train.logprobs import pack
from adarl.types import Problem


def sft_pairs(problems: list[Problem], tokenizer: Any) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, answer ids + eos) per problem; prompts built as `Trainer.prompt_ids` builds them."""
    pairs = []
    for p in problems:
        if p.answer is None:
            raise ValueError(f"sft: problem {p.id!r} has no answer; every training problem needs one to imitate")
        messages = p.prompt if isinstance(p.prompt, list) else [{"role": "user", "content": p.prompt}]
        answer = list(tokenizer(str(p.answer), add_special_tokens=False)["input_ids"])
        pairs.append((chat_ids(tokenizer, messages), [*answer, tokenizer.eos_token_id]))
    return pairs


def _micro_batches(rows: list[tuple[list[int], list[int]]], max_tokens: int) -> list[list[tuple[list[int], list[int]]]]:
    out: list[list[tuple[list[int], list[int]]]] = [[]]
    for row in rows:
        width = max([len(p) + len(c) for p, c in out[-1]] + [len(row[0]) + len(row[1])])
        if out[-1] and width * (len(out[-1]) + 1) > max_tokens:
            out.append([])
        out[-1].append(row)
    return out


def run_sft(recipe: Recipe, run_dir: Path, objective: Literal["otr", "nll"] = "otr", *, steps: int | None = None,
            k: int = 8, temperature: float = 1.0, negative_reward: float = 0.0, baseline: bool = True,
            target_fallback: bool = True) -> dict[str, float]:
    """Train `recipe.model` for `steps` (default `budget.max_steps`) SFT steps; returns the last metrics row."""
    if objective not in ("otr", "nll"):
        raise ValueError(f"sft: objective must be 'otr' or 'nll', got {objective!r}")
    steps = steps if steps is not None else recipe.budget.max_steps
    if steps is None:
        raise ValueError("sft: give steps, or set budget.max_steps in the recipe")
    run_dir = Path(run_dir)
    torch.manual_seed(recipe.seed)
    if recipe.model.threads:
        torch.set_num_threads(recipe.model.threads)
    task = build_task(recipe.task, recipe.seed)
    per_step = recipe.budget.prompts_per_step
    if per_step > len(task.train):
        raise ValueError(f"budget.prompts_per_step is {per_step} but the task has only {len(task.train)} "
                         "training problems; lower budget.prompts_per_step or add problems")
    model, tokenizer = load_model(recipe.model, for_training=True)
    pairs = sft_pairs(task.train, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    t = recipe.train
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=t.lr, betas=t.betas, weight_decay=t.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / (t.warmup_steps + 1)))
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(recipe.seed)
    rng = np.random.default_rng(recipe.seed)
    order: list[int] = []
    decoder, lm_head = model.get_decoder(), model.get_output_embeddings()
    model.train()
    last: dict[str, float] = {}
    with MetricsWriter(run_dir, tensorboard=recipe.log.tensorboard) as writer:
        for step in range(1, steps + 1):
            if len(order) < per_step:  # a fresh shuffle once the epoch cannot fill a step
                order = rng.permutation(len(pairs)).tolist()
            rows, order = [pairs[i] for i in order[:per_step]], order[per_step:]
            n_tokens = sum(len(c) for _, c in rows)
            sums = {"loss": 0.0, "target_logprob": 0.0, "hit_fraction": 0.0, "fallback_fraction": 0.0}
            for micro in _micro_batches(rows, t.micro_batch_tokens):
                packed = pack([p for p, _ in micro], [c for _, c in micro], pad_id)
                hidden = decoder(input_ids=packed.input_ids.to(device), use_cache=False).last_hidden_state
                logits = lm_head(hidden.reshape(-1, hidden.shape[-1]).index_select(0, packed.source.to(device)))
                targets = packed.targets[packed.completion_mask].to(device)
                if objective == "otr":
                    loss, stats = otr_token_loss(logits, targets, k, generator, temperature, negative_reward,
                                                 baseline, target_fallback)
                    sums["hit_fraction"] += float(stats["hit_fraction"].sum())
                    sums["fallback_fraction"] += float(stats["fallback"].sum())
                else:
                    loss, stats = nll_token_loss(logits, targets, temperature)
                (loss.sum() / n_tokens).backward()  # the mean over the step's answer tokens
                sums["loss"] += float(loss.detach().sum())
                sums["target_logprob"] += float(stats["target_logprob"].sum())
            norm = float(torch.nn.utils.clip_grad_norm_(params, t.max_grad_norm or float("inf")))
            if math.isfinite(norm):  # a non-finite gradient would poison the weights: skip the update
                optimizer.step()
                scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            row = {key: value / n_tokens for key, value in sums.items()}
            if objective == "nll":
                del row["hit_fraction"], row["fallback_fraction"]
            last = writer.write({"step": step, **row, "grad_norm": norm, "tokens": n_tokens})
    final = copy.deepcopy(model).merge_and_unload() if hasattr(model, "merge_and_unload") else model

    def write(out: Path) -> None:
        final.save_pretrained(out)
        tokenizer.save_pretrained(out)

    checkpoint.save_dir(run_dir / "final", write)
    return last
