"""The trainer: one step reads like the data flow of design.md.

    select → allocate (plan) → generate → verify → (allocate.more → generate → verify)* →
    allocate.finish → estimate → loss → optimizer → checkpoint

The trainer composes stages and knows nothing about which method each one is.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from adarl import registry
from adarl.budget import Budget
from adarl.config import Recipe, dump_recipe
from adarl.loss.aggregate import sequence_weights
from adarl.metrics.progress import Progress
from adarl.metrics.sinks import MetricsWriter
from adarl.models import chat_ids, load_model, load_reference
from adarl.rewards import Rewards
from adarl.rollout.hf import HfGenerator
from adarl.tasks.base import build_task
from adarl.train import checkpoint
from adarl.train.logprobs import completion_logprobs, pack
from adarl.types import Batch, Group, Problem, Request, Rollout

TIMING_KEYS = ("generate_s", "verify_s", "train_s", "eval_s", "step_s", "tokens_per_s", "wall_s")


class Trainer:
    def __init__(self, recipe: Recipe, run_dir: Path):
        self.recipe = recipe
        self.run_dir = Path(run_dir)
        self.step = 0
        self._seed_everything(recipe.seed)
        if recipe.model.threads:
            torch.set_num_threads(recipe.model.threads)
        if recipe.deterministic:
            torch.use_deterministic_algorithms(True, warn_only=True)

        self.task = build_task(recipe.task, recipe.seed)
        self.rewards = Rewards(recipe.rewards, workers=recipe.reward_workers, timeout_s=recipe.reward_timeout_s)
        self.model, self.tokenizer = load_model(recipe.model, for_training=True)
        self.loss_fn = registry.build("loss", recipe.loss)
        self.reference = None
        if self.loss_fn.kl_coef > 0 and recipe.model.lora is None:
            self.reference = load_reference(recipe.model)
        self.selector = registry.build("select", recipe.select)
        self.allocator = registry.build("allocate", recipe.allocate)
        self.estimator = registry.build("advantage", recipe.advantage)
        self.generator = HfGenerator(self.model, self.tokenizer, recipe.rollout, seed=recipe.seed)
        self.budget = Budget(recipe.budget.max_tokens, recipe.budget.tokens_per_step)
        self.np_rng = np.random.default_rng(recipe.seed)
        self.store: Any = None  # the difficulty store (select/) plugs in here
        params = [p for p in self.model.parameters() if p.requires_grad]
        t = recipe.train
        self.optimizer = torch.optim.AdamW(params, lr=t.lr, betas=t.betas, weight_decay=t.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / (t.warmup_steps + 1))
        )
        if t.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        self.pad_id = self.generator.pad_id
        self._prompt_cache: dict[str, list[int]] = {}
        self.skipped_updates = 0
        self.wall_offset = 0.0

    # ---------------------------------------------------------------- setup

    @staticmethod
    def _seed_everything(seed: int) -> None:
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)

    def prompt_ids(self, problem: Problem) -> list[int]:
        ids = self._prompt_cache.get(problem.id)
        if ids is None:
            messages = problem.prompt if isinstance(problem.prompt, list) else [
                {"role": "user", "content": problem.prompt}
            ]
            ids = self._prompt_cache[problem.id] = chat_ids(self.tokenizer, messages)
        return ids

    @property
    def max_steps(self) -> int | None:
        return self.recipe.budget.max_steps

    def done(self) -> bool:
        return (self.max_steps is not None and self.step >= self.max_steps) or self.budget.exhausted()

    # ---------------------------------------------------------------- one step

    def rollout_and_verify(self, counts: dict[str, int], problems: dict[str, Problem],
                           groups: dict[str, Group], metrics: dict[str, float]) -> None:
        requests = [Request(pid, self.prompt_ids(problems[pid]), n) for pid, n in counts.items() if n > 0]
        t0 = time.perf_counter()
        rollouts = self.generator.generate(requests)
        metrics["generate_s"] = metrics.get("generate_s", 0.0) + time.perf_counter() - t0
        self.budget.spend(rollouts)
        by_prompt: dict[str, list[Rollout]] = {}
        for r in rollouts:
            by_prompt.setdefault(r.prompt_id, []).append(r)
        fresh = [Group(problems[pid], self.prompt_ids(problems[pid]), rs) for pid, rs in by_prompt.items()]
        t0 = time.perf_counter()
        for key, value in self.rewards.score(fresh).items():
            metrics[key] = metrics.get(key, 0.0) + value if key.startswith(("reward_", "verify")) else value
        metrics["verify_s"] = metrics.get("verify_s", 0.0) + time.perf_counter() - t0
        for g in fresh:
            old = groups.get(g.problem.id)
            if old is None:
                groups[g.problem.id] = g
                continue
            old.rollouts += g.rollouts
            old.rewards = np.concatenate([old.rewards, g.rewards])
            old.correct = np.concatenate([old.correct, g.correct])

    def train_step(self) -> dict[str, float]:
        t_step = time.perf_counter()
        metrics: dict[str, float] = {}
        self.budget.start_step()
        chosen = self.selector.select(len(self.task.train), self.recipe.budget.prompts_per_step, self.np_rng)
        problems = {p.id: p for p in (self.task.train[i] for i in chosen)}
        groups: dict[str, Group] = {}
        counts = self.allocator.plan(list(problems.values()), self.store, self.budget)
        while counts:
            self.rollout_and_verify(counts, problems, groups, metrics)
            counts = self.allocator.more(list(groups.values()), self.store, self.budget)
        batch = Batch(self.allocator.finish(list(groups.values())))
        metrics.update(self._batch_metrics(batch))
        batch.advantages = self.estimator(batch)
        t0 = time.perf_counter()
        metrics.update(self.update(batch))
        metrics["train_s"] = time.perf_counter() - t0
        self.generator.update_weights()
        self.step += 1
        metrics["step_s"] = time.perf_counter() - t_step
        metrics["tokens_per_s"] = self.budget.step_tokens / max(metrics.get("generate_s", 0.0), 1e-9)
        metrics.update(self.budget.metrics())
        metrics["lr"] = self.scheduler.get_last_lr()[0]
        return metrics

    @staticmethod
    def _batch_metrics(batch: Batch) -> dict[str, float]:
        rollouts = batch.rollouts
        lengths = np.array([len(r) for r in rollouts])
        correct = np.concatenate([g.correct for g in batch.groups])
        return {
            "reward": float(batch.rewards.mean()),
            "pass_rate": float(correct.mean()),
            "zero_variance_fraction": float(np.mean([g.zero_variance for g in batch.groups])),
            "groups": len(batch.groups),
            "response_length": float(lengths.mean()),
            "truncated_fraction": float(np.mean([r.finish_reason == "length" for r in rollouts])),
        }

    # ---------------------------------------------------------------- update

    def _micro_batches(self, order: list[int], lengths: list[int]) -> list[list[int]]:
        """Length-sorted micro-batches whose padded size stays within micro_batch_tokens."""
        budget = self.recipe.train.micro_batch_tokens
        out: list[list[int]] = []
        current: list[int] = []
        for i in sorted(order, key=lambda i: lengths[i]):
            if current and (len(current) + 1) * lengths[i] > budget:
                out.append(current)
                current = []
            current.append(i)
        if current:
            out.append(current)
        return out

    def _forward(self, batch_rows: list[tuple[list[int], list[int]]], grad: bool, model=None):
        packed = pack([p for p, _ in batch_rows], [c for _, c in batch_rows], self.pad_id)
        with torch.set_grad_enabled(grad):
            logp, ent = completion_logprobs(
                model or self.model, packed, self.recipe.rollout.temperature, self.recipe.train.logit_chunk
            )
        return packed, logp, ent

    def _reference_logprobs(self, rows) -> torch.Tensor:
        with torch.no_grad():
            if self.reference is not None:
                return self._forward(rows, grad=False, model=self.reference)[1]
            with self.model.disable_adapter():  # LoRA: the base model is the reference
                return self._forward(rows, grad=False)[1]

    def update(self, batch: Batch) -> dict[str, float]:
        rollouts = batch.rollouts
        prompts = [g.prompt_ids for g in batch.groups for _ in g.rollouts]
        rows = [(p, r.completion_ids) for p, r in zip(prompts, rollouts, strict=True)]
        lengths = [len(p) + len(c) for p, c in rows]
        adv = batch.advantages
        kl_on = self.loss_fn.kl_coef > 0
        loss_cfg = self.recipe.loss
        max_len = loss_cfg.get("max_len") or self.recipe.rollout.max_new_tokens
        t = self.recipe.train
        on_policy = t.mini_batches == 1 and t.epochs == 1
        # rollouts whose advantage is 0 carry no policy gradient: no forward/backward for them
        active = [i for i in range(len(rollouts)) if kl_on or adv[i] != 0.0]
        sums: dict[str, float] = {"tokens_trained": 0.0}
        if not active:
            return {"trained_fraction": 0.0, "skipped_updates": float(self.skipped_updates)}

        self.model.train()
        old_logp: dict[int, torch.Tensor] = {}
        if not on_policy:  # the proximal policy ℓ_old, before any update of this step
            for mb in self._micro_batches(active, lengths):
                _, logp, _ = self._forward([rows[i] for i in mb], grad=False)
                for j, i in enumerate(mb):
                    old_logp[i] = logp[j, : len(rows[i][1])]

        minibatches = np.array_split(self.np_rng.permutation(len(rollouts)), t.mini_batches)
        grad_norms = []
        active_set = set(active)
        for _ in range(t.epochs):
            for mb_all in minibatches:
                mb_all = sorted(mb_all.tolist())
                w_all = sequence_weights(np.array([len(rows[i][1]) for i in mb_all]), self.loss_fn.agg, max_len)
                weight = dict(zip(mb_all, w_all, strict=True))
                todo = [i for i in mb_all if i in active_set]
                for micro in self._micro_batches(todo, lengths):
                    self._micro_step(micro, rows, adv, weight, old_logp, on_policy, kl_on, sums)
                grad_norms.append(self._optimizer_step())
        n_tok = max(sums.pop("tokens_trained"), 1.0)
        out = {k: v / n_tok for k, v in sums.items()}
        out["grad_norm"] = float(np.mean(grad_norms))
        out["trained_fraction"] = len(active) / len(rollouts)
        out["skipped_updates"] = float(self.skipped_updates)
        return out

    def _micro_step(self, micro, rows, adv, weight, old_logp, on_policy, kl_on, sums) -> None:
        packed, logp, ent = self._forward([rows[i] for i in micro], grad=True)
        mask = packed.completion_mask.float()
        if on_policy:
            old = logp.detach()
        else:
            old = torch.zeros_like(logp)
            for j, i in enumerate(micro):
                old[j, : len(rows[i][1])] = old_logp[i]
        ref = self._reference_logprobs([rows[i] for i in micro]) if kl_on else None
        a = torch.tensor([adv[i] for i in micro], dtype=torch.float32)[:, None].expand_as(logp)
        w = torch.tensor([weight[i] for i in micro], dtype=torch.float32)[:, None]
        per_token, stats = self.loss_fn(logp, old, a, mask, ref_logp=ref)
        loss = (per_token * mask * w).sum()
        loss.backward()
        # token-summed statistics; divided by the trained token count at the end of the step
        sums["tokens_trained"] += float(mask.sum())
        sums["loss"] = sums.get("loss", 0.0) + float((per_token.detach() * mask).sum())
        sums["entropy"] = sums.get("entropy", 0.0) + float((ent * mask).sum())
        for key, value in stats.items():
            sums[key] = sums.get(key, 0.0) + float((value * mask).sum())

    def _optimizer_step(self) -> float:
        params = [p for p in self.model.parameters() if p.requires_grad]
        clip = self.recipe.train.max_grad_norm
        norm = torch.nn.utils.clip_grad_norm_(params, clip if clip is not None else float("inf"))
        if torch.isfinite(norm):
            self.optimizer.step()
            self.scheduler.step()
        else:  # a non-finite gradient would poison the weights: skip the update and count it
            self.skipped_updates += 1
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    # ---------------------------------------------------------------- evaluation

    def evaluate(self) -> dict[str, float]:
        cfg = self.recipe.eval
        problems = self.task.eval[: cfg.size] if cfg.size else self.task.eval
        if not problems:
            return {}
        t0 = time.perf_counter()
        max_new = cfg.max_new_tokens or self.recipe.rollout.max_new_tokens
        requests = [Request(p.id, self.prompt_ids(p), 1) for p in problems]
        greedy = self.generator.generate(requests, greedy=True, max_new_tokens=max_new)
        groups = [Group(p, self.prompt_ids(p), [r]) for p, r in zip(problems, greedy, strict=True)]
        self.rewards.score(groups)
        out = {
            "eval/pass@1": float(np.mean([g.correct[0] for g in groups])),
            "eval/length": float(np.mean([len(r) for r in greedy])),
        }
        if cfg.samples:
            # sampling draws from its own generator so evaluation never shifts the training stream
            rng_state = self.generator.rng.get_state()
            sampled = self.generator.generate(
                [Request(p.id, self.prompt_ids(p), cfg.samples) for p in problems], max_new_tokens=max_new
            )
            self.generator.rng.set_state(rng_state)
            groups = [
                Group(p, self.prompt_ids(p), sampled[i * cfg.samples : (i + 1) * cfg.samples])
                for i, p in enumerate(problems)
            ]
            self.rewards.score(groups)
            out[f"eval/mean@{cfg.samples}"] = float(np.mean([g.correct.mean() for g in groups]))
            out[f"eval/pass@{cfg.samples}"] = float(np.mean([g.correct.max() for g in groups]))
        out["eval_s"] = time.perf_counter() - t0
        return out

    # ---------------------------------------------------------------- state

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "budget": self.budget.state_dict(),
            "selector": self.selector.state_dict(),
            "generator": self.generator.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "np_rng": self.np_rng.bit_generator.state,
            "torch_rng": torch.get_rng_state(),
            "python_rng": random.getstate(),
            "skipped_updates": self.skipped_updates,
            "wall_s": self.wall_offset,
            "store": self.store.state_dict() if self.store is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = state["step"]
        self.budget.load_state_dict(state["budget"])
        self.selector.load_state_dict(state["selector"])
        self.generator.load_state_dict(state["generator"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.np_rng.bit_generator.state = state["np_rng"]
        torch.set_rng_state(state["torch_rng"])
        random.setstate(state["python_rng"])
        self.skipped_updates = state["skipped_updates"]
        self.wall_offset = state["wall_s"]
        if self.store is not None and state.get("store") is not None:
            self.store.load_state_dict(state["store"])

    def save_checkpoint(self) -> Path:
        return checkpoint.save(
            self.run_dir / "checkpoints", self.step, self.model, self.optimizer.state_dict(),
            self.state_dict(), keep=self.recipe.checkpoint.keep,
        )

    def resume(self) -> bool:
        """Load the latest complete checkpoint, if any; drop metrics rows written after it."""
        path = checkpoint.latest(self.run_dir / "checkpoints")
        if path is None:
            return False
        optimizer_state, state = checkpoint.load(path, self.model)
        self.optimizer.load_state_dict(optimizer_state)
        self.load_state_dict(state)
        return True

    # ---------------------------------------------------------------- the loop

    def _due(self, every: int) -> bool:
        return (every > 0 and self.step % every == 0) or self.done()

    def run(self, resume: bool = False) -> dict[str, float]:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(dump_recipe(self.recipe))
        resumed = resume and self.resume()
        writer = MetricsWriter(self.run_dir, tensorboard=self.recipe.log.tensorboard,
                               resume_step=self.step if resumed else None)
        last: dict[str, float] = {}
        t_start = time.perf_counter() - self.wall_offset
        try:
            if not resumed and self.recipe.eval.at_start:
                row = {"step": 0, **self.budget.metrics(), **self.evaluate()}
                writer.write(row)
                last.update(row)
            with Progress(self.max_steps, enabled=self.recipe.log.progress, start_step=self.step,
                          total_tokens=self.recipe.budget.max_tokens) as progress:
                while not self.done():
                    row = {"step": self.step + 1, **self.train_step()}
                    if self._due(self.recipe.eval.every):
                        row.update(self.evaluate())
                    self.wall_offset = time.perf_counter() - t_start
                    row["wall_s"] = self.wall_offset
                    writer.write(row)
                    last.update(row)
                    progress.update(
                        self.step, reward=row["reward"], pass_rate=row["pass_rate"],
                        tokens_per_s=row["tokens_per_s"], tokens=row["tokens"],
                    )
                    if self._due(self.recipe.checkpoint.every):
                        self.save_checkpoint()
            self.save_final()
        finally:
            writer.close()
            self.rewards.close()
        return last

    def save_final(self) -> None:
        out = self.run_dir / "final"
        model = self.model
        if hasattr(model, "merge_and_unload"):
            import copy

            model = copy.deepcopy(model).merge_and_unload()
        model.save_pretrained(out)
        self.tokenizer.save_pretrained(out)
