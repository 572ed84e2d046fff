"""Supervised fine-tuning on a task's (prompt, answer) pairs, with plain NLL or OTR (loss/otr.py).

Each step takes `budget.prompts_per_step` training problems (a seeded shuffle, epoch after epoch), trains on
`prompt → answer + eos` with the loss on the answer tokens only (`target="solution"`, or any other column name:
that column's text instead of the answer, e.g. reasoning-gym chain sums' worked solution "12 + 5 = 17; 17 - 3 =
14. The answer is 14.", a cold start that writes its steps), and writes one row to `metrics.jsonl`: `loss`,
`target_logprob` (mean log π(answer token) before the update), for OTR `hit_fraction` / `fallback_fraction`, and
`wall_s` (since the first step). The micro-batches are laid out as the RL learner's (train/logprobs.py `pack`:
rows end to end without padding, a token prefix common to several examples, such as the chat template's system
turn, forwarded once; right-padded rows where the attention takes no 4D mask). Only the hidden states that predict
answer tokens go through the lm head (answers are short, so their full-vocabulary logits are cheap; OTR samples
from them).
The trained model is written to `run_dir/final`.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from adarl.config import Recipe, dump_recipe
from adarl.loss.otr import nll_token_loss, otr_token_loss
from adarl.metrics.sinks import MetricsWriter
from adarl.models import chat_ids, load_model
from adarl.tasks import build_task
from adarl.train import checkpoint
from adarl.train.learner import build_optimizer
from adarl.train.logprobs import completion_hidden, layout_for, micro_batches, pack
from adarl.types import Problem

Example = tuple[list[int], list[int], list[float]]  # prompt ids, completion ids, 1 where trained


def sft_pairs(problems: list[Problem], tokenizer: Any, agent: Any = None, target: str = "answer") -> list[Example]:
    """(prompt ids, target ids + eos, all trained) per problem; prompts built as `Trainer.prompt_ids`
    builds them. The target is the answer, or the text of the column named `target`. With an `agent`
    (rollout/agent/), each example is the environment's demonstration trajectory instead: its tool
    calls and the answer are trained, the inserted tool turns are not."""
    if agent is not None and target != "answer":
        raise ValueError(f"sft: target {target!r} needs a single-turn recipe; an agent recipe imitates its "
                         "environment's demonstrations")
    pairs = []
    for p in problems:
        if target == "answer":
            text = p.answer
            if text is None:
                raise ValueError(f"sft: problem {p.id!r} has no answer; every training problem needs one to imitate")
        else:
            text = p.columns.get(target)
            if not isinstance(text, str) or not text.strip():
                raise ValueError(f"sft: problem {p.id!r} has no text column {target!r} to imitate (columns: "
                                 f"{sorted(p.columns)}); reasoning-gym chain sums have 'solution', a JSONL task "
                                 "gets one from a field of that name")
        if agent is not None:
            demo = agent.demonstration(p)
            if demo is None:
                raise ValueError(f"sft: the environment has no demonstration for problem {p.id!r}")
            pairs.append((chat_ids(tokenizer, agent.messages(p)), demo.completion_ids, demo.sampled_mask.tolist()))
            continue
        ids = list(tokenizer(str(text), add_special_tokens=False)["input_ids"])
        pairs.append((chat_ids(tokenizer, p.messages), [*ids, tokenizer.eos_token_id], [1.0] * (len(ids) + 1)))
    return pairs


def run_sft(recipe: Recipe, run_dir: Path, objective: Literal["otr", "nll"] = "otr", *, steps: int | None = None,
            k: int = 8, temperature: float = 1.0, negative_reward: float = 0.0, baseline: bool = True,
            target_fallback: bool = True, target: str = "answer") -> dict[str, float]:
    """Train `recipe.model` for `steps` (default `budget.max_steps`) SFT steps on each problem's answer
    (or its `target` column); returns the last metrics row."""
    if objective not in ("otr", "nll"):
        raise ValueError(f"sft: objective must be 'otr' or 'nll', got {objective!r}")
    steps = steps if steps is not None else recipe.budget.max_steps
    if steps is None:
        raise ValueError("sft: give steps, or set budget.max_steps in the recipe")
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    # a run directory like training's: `adarl eval RUN`, `adarl report RUN` read the recipe from here
    checkpoint.atomic_write_text(run_dir / "config.yaml", dump_recipe(recipe))
    torch.manual_seed(recipe.seed)
    if recipe.model.threads:
        torch.set_num_threads(recipe.model.threads)
    task = build_task(recipe.task, recipe.seed)
    per_step = recipe.budget.prompts_per_step
    if per_step > len(task.train):
        raise ValueError(f"budget.prompts_per_step is {per_step} but the task has only {len(task.train)} "
                         "training problems; lower budget.prompts_per_step or add problems")
    model, tokenizer = load_model(recipe.model, for_training=True)
    agent = None
    if recipe.rollout.agent is not None:  # multi-turn demonstrations (tool calls trained, tool output masked)
        from adarl.rollout import build_generator

        agent = build_generator(model, tokenizer, recipe.rollout.model_copy(update={"backend": "hf"}),
                                problems=task.train)
    pairs = sft_pairs(task.train, tokenizer, agent, target)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    t = recipe.train
    optimizer, scheduler = build_optimizer(model, t)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(recipe.seed)
    rng = np.random.default_rng(recipe.seed)
    order: list[int] = []
    lm_head = model.get_output_embeddings()
    layout = layout_for(model)  # the learner's: rows end to end, a common prefix (the chat template's) forwarded once
    model.train()
    last: dict[str, float] = {}
    start = time.perf_counter()
    with MetricsWriter(run_dir, tensorboard=recipe.log.tensorboard) as writer:
        for step in range(1, steps + 1):
            if len(order) < per_step:  # a fresh shuffle once the epoch cannot fill a step
                order = rng.permutation(len(pairs)).tolist()
            rows, order = [pairs[i] for i in order[:per_step]], order[per_step:]
            n_tokens = int(sum(sum(m) for _, _, m in rows))
            sums = {"loss": 0.0, "target_logprob": 0.0, "hit_fraction": 0.0, "fallback_fraction": 0.0}
            lengths = [len(p) + len(c) for p, c, _ in rows]
            seqs = [p + c for p, c, _ in rows] if layout == "shared" else None  # a common prefix counted once
            for index in micro_batches(list(range(len(rows))), lengths, t.micro_batch_tokens, seqs):
                micro = [rows[i] for i in index]
                packed = pack([p for p, _, _ in micro], [c for _, c, _ in micro], pad_id, layout).to(device)
                keep = torch.tensor([x > 0 for _, _, m in micro for x in m], device=device)  # trained tokens
                logits = lm_head(completion_hidden(model, packed)[keep])
                targets = packed.targets[packed.completion_mask][keep]
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
            last = writer.write({"step": step, **row, "grad_norm": norm, "tokens": n_tokens,
                                 "wall_s": time.perf_counter() - start})
    checkpoint.save_model(run_dir / "final", model, tokenizer)
    return last
