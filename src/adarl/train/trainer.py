"""The trainer: one step reads like the data flow of design.md.

    select → allocate (plan) → generate → verify → (allocate.more → generate → verify)* →
    allocate.finish → estimate → loss → optimizer → checkpoint

The trainer composes stages and knows nothing about which method each one is.
"""

from __future__ import annotations

import json
import math
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from adarl import registry
from adarl.allocate.base import plan_spares
from adarl.budget import Budget
from adarl.config import AdaptiveTemperature, Recipe, dump_recipe, resolve_backend
from adarl.metrics.progress import Progress
from adarl.metrics.sinks import MetricsWriter, read_jsonl
from adarl.metrics.step import StepMetrics
from adarl.metrics.trackers import check_trackers
from adarl.models import chat_ids, load_model, load_reference
from adarl.rewards import Rewards
from adarl.rollout import build_generator
from adarl.rollout.scheduler import RolloutScheduler
from adarl.select.store import DifficultyStore
from adarl.tasks.base import build_task
from adarl.tokens.base import batch_entropies
from adarl.tokens.entropy import EntropyStats
from adarl.train import checkpoint
from adarl.train.checkpoint import crash_point
from adarl.train.learner import Learner
from adarl.types import Batch, Group, Problem, Request, merge

TIMING_KEYS = ("generate_s", "verify_s", "train_s", "weight_sync_s", "eval_s", "step_s", "tokens_per_s", "wall_s")
MAX_BAD_UPDATES = 3  # updates in a row with a non-finite loss or gradient that stop the run


CALLBACK_EVENTS = ("on_step", "on_eval", "on_checkpoint")


def _notify(callbacks: Sequence[Any], event: str, step: int, payload: Any) -> bool:
    """Call `event` on every callback that has it (a plain function is an `on_step`); True if one asks to stop."""
    stop = False
    for cb in callbacks:
        fn = getattr(cb, event, None)
        if fn is None and event == "on_step" and callable(cb) and not any(hasattr(cb, e) for e in CALLBACK_EVENTS):
            fn = cb
        if fn is not None and fn(step, payload) is True:
            stop = True
    return stop


def _eval_part(row: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in row.items() if k.startswith("eval")}


class NonFiniteUpdates(RuntimeError):
    """Training stopped: MAX_BAD_UPDATES updates in a row had a NaN/inf loss or gradient."""


class ResumeError(ValueError):
    """The run directory's checkpoint cannot be loaded into this recipe's model (nothing was written)."""


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

        check_trackers(recipe.log.trackers, recipe.model_dump(mode="json"))  # a missing package fails here
        self.task = build_task(recipe.task, recipe.seed)
        self._check_feasible()
        self.rewards = Rewards(recipe.rewards, workers=recipe.reward_workers, timeout_s=recipe.reward_timeout_s)
        self.model, self.tokenizer = load_model(recipe.model, for_training=True)
        self.shapings = [registry.build("shaping", spec) for spec in recipe.shaping]
        loss = registry.build("loss", recipe.loss)
        self.reference = None
        if loss.kl_coef > 0 and recipe.model.lora is None:
            self.reference = load_reference(recipe.model)
        self.selector = registry.build("select", recipe.select)
        self.allocator = registry.build("allocate", recipe.allocate)
        self.estimator = registry.build("advantage", recipe.advantage)
        self.token_weightings = [registry.build("tokens", spec) for spec in recipe.tokens]
        recipe.rollout.backend = resolve_backend(recipe)  # auto -> the one used, as config.yaml records
        self.generator = build_generator(self.model, self.tokenizer, recipe.rollout, seed=recipe.seed)
        self.rollouts = RolloutScheduler(self.generator, recipe.rollout.scheduler)
        self.problems_by_id = {p.id: p for p in self.task.train}
        self.budget = Budget(recipe.budget.max_tokens, recipe.budget.tokens_per_step,
                             recipe.budget.rollouts_per_step, expected_length=recipe.rollout.max_new_tokens)
        self.np_rng = np.random.default_rng(recipe.seed)
        gamma_short, gamma_long = self.selector.store_decay()  # the selector owns its decay (VADE)
        self.store = DifficultyStore([p.id for p in self.task.train], gamma_short, gamma_long)
        if recipe.train.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        self.pad_id = self.generator.pad_id
        self.learner = Learner(self.model, loss, recipe.train, temperature=recipe.rollout.temperature,
                               pad_id=self.pad_id, rng=self.np_rng, reference=self.reference,
                               max_len=recipe.loss.get("max_len") or recipe.rollout.max_new_tokens)
        self._prompt_cache: dict[str, list[int]] = {}
        self.wall_offset = 0.0
        self.entropy_stats: EntropyStats | None = None  # of the last batch (HAPO ĥ)

    @property
    def loss_fn(self) -> Any:
        """The recipe's policy loss (the learner's)."""
        return self.learner.loss

    @loss_fn.setter
    def loss_fn(self, loss: Any) -> None:
        self.learner.loss = loss

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.learner.optimizer

    @property
    def scheduler(self) -> Any:
        return self.learner.scheduler

    @property
    def skipped_updates(self) -> int:
        return self.learner.skipped_updates

    @property
    def bad_updates_in_a_row(self) -> int:
        return self.learner.bad_updates_in_a_row

    # ---------------------------------------------------------------- setup

    def _check_feasible(self) -> None:
        """Budgets the task cannot meet are errors before any model loads (ValueError)."""
        b, n_train = self.recipe.budget, len(self.task.train)
        if b.prompts_per_step > n_train:
            raise ValueError(
                f"budget.prompts_per_step is {b.prompts_per_step} but the task has only {n_train} training "
                f"problems (after holding out task.eval_size={self.recipe.task.eval_size}); "
                "lower budget.prompts_per_step or add problems"
            )
        for key, limit in (("tokens_per_step", b.tokens_per_step), ("max_tokens", b.max_tokens)):
            if limit is not None and limit < b.prompts_per_step:
                raise ValueError(
                    f"budget.{key} is {limit}, less than one step needs: at least one generated token for "
                    f"each of the budget.prompts_per_step={b.prompts_per_step} prompts"
                )
        size = self.recipe.eval.size
        if size is not None and size > len(self.task.eval):
            raise ValueError(
                f"eval.size is {size} but only {len(self.task.eval)} problems are held out "
                f"(task.eval_size={self.recipe.task.eval_size}); lower eval.size or raise task.eval_size"
            )

    @staticmethod
    def _seed_everything(seed: int) -> None:
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)

    def prompt_ids(self, problem: Problem) -> list[int]:
        ids = self._prompt_cache.get(problem.id)
        if ids is None:
            ids = self._prompt_cache[problem.id] = chat_ids(self.tokenizer, problem.messages)
        return ids

    @property
    def max_steps(self) -> int | None:
        return self.recipe.budget.max_steps

    def done(self) -> bool:
        return (self.max_steps is not None and self.step >= self.max_steps) or self.budget.exhausted()

    # ---------------------------------------------------------------- one step

    def _spare_requests(self, requests: list[Request]) -> list[Request]:
        """APRIL over-provisioning: extra prompts the scheduler may start beside the needed ones,
        each with the count the allocator would give it, within the budget (`plan_spares`)."""
        extra = math.ceil(self.recipe.rollout.scheduler.over_provision * len(requests)) - len(requests)
        if extra <= 0 or not requests:
            return []
        chosen = [self.task.train[i] for i in self.selector.select(self.store, extra, self.np_rng)]
        counts = plan_spares(self.allocator, chosen, requests, self.store, self.budget)
        return [Request(p.id, self.prompt_ids(p), counts[p.id]) for p in chosen if counts.get(p.id, 0) > 0]

    def rollout_and_verify(self, counts: dict[str, int], problems: dict[str, Problem],
                           groups: dict[str, Group], metrics: StepMetrics, first_stage: bool = True) -> None:
        requests = [Request(pid, self.prompt_ids(problems[pid]), n) for pid, n in counts.items() if n > 0]
        crash_point("generate", self.step + 1)
        t0 = time.perf_counter()
        tokens_left = self.budget.step_tokens_left()  # a hard cap: generation stops before passing it
        if first_stage and self.rollouts.cfg.mode != "sync":  # partial or async: groups from the scheduler
            result = self.rollouts.run(requests, self._spare_requests(requests), max_tokens=tokens_left)
        else:  # later allocator stages top up groups trained this step: generated to the end
            result = self.rollouts.complete(requests, max_tokens=tokens_left)
        metrics.add("generate_s", time.perf_counter() - t0)
        self.budget.spend(result.rollouts_started, tokens=result.tokens_spent)
        for key, value in result.metrics.items():
            if key.startswith(("tokens", "rollouts")):
                metrics.add(f"rollout/{key}", value)
            else:
                metrics[f"rollout/{key}"] = value
        fresh = []
        for g in result.groups:  # partial mode may return groups of prompts admitted in earlier steps
            problem = problems.setdefault(g.request.prompt_id, self.problems_by_id[g.request.prompt_id])
            fresh.append(Group(problem, g.request.prompt_ids, g.rollouts, group_id=g.group_id))
        crash_point("verify", self.step + 1)
        t0 = time.perf_counter()
        scored = sum(g.size for g in fresh)
        for key, value in self.rewards.score(fresh).items():
            if key.startswith("reward/"):  # a mean over this stage's rollouts: the step's is over every stage's
                metrics.mean(key, value, scored)
            elif key != "verify_s":  # error counts; the time is taken here, around scoring and shaping
                metrics.add(key, value)
        self.shape(fresh, metrics)
        metrics.add("verify_s", time.perf_counter() - t0)
        self.store.update(fresh, self.step + 1)
        merge(groups, fresh)

    def train_step(self) -> dict[str, float]:
        t_step = time.perf_counter()
        metrics = StepMetrics()
        self.budget.start_step()
        k = self.recipe.budget.prompts_per_step
        chosen = self.selector.select(self.store, self.allocator.candidates(k), self.np_rng)
        problems = {p.id: p for p in (self.task.train[i] for i in chosen)}
        metrics.update(self._selection_metrics(chosen))
        groups: dict[str, Group] = {}
        counts = self.allocator.plan(list(problems.values()), self.store, self.budget)
        first_stage = True
        while counts:
            self.rollout_and_verify(counts, problems, groups, metrics, first_stage)
            first_stage = False
            counts = self.allocator.more(list(groups.values()), self.store, self.budget)
        generated = list(groups.values())
        self.selector.observe(self.store, np.array([self.store.index[g.problem.id] for g in generated], dtype=np.int64))
        batch = Batch(self.allocator.finish(generated))
        metrics.update(self._batch_metrics(generated, batch))
        metrics.update({f"allocate/{key}": value for key, value in self.allocator.metrics().items()})
        self.last_groups = generated
        t0 = time.perf_counter()
        self.last_advantages: dict[int, float] = {}
        if batch.groups:
            self.learn(batch, metrics)
            self.last_advantages = {id(r): float(a) for r, a in zip(batch.rollouts, batch.advantages, strict=True)}
        else:  # every group was filtered out: nothing to learn from this step
            metrics["effective_token_fraction"] = 0.0
        metrics["train_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        self.generator.update_weights()
        metrics["weight_sync_s"] = time.perf_counter() - t0
        if self.recipe.rollout.adaptive_temperature is not None:  # HAPO: sampling uses this step's ĥ statistics
            self.generator.set_entropy_stats(self.entropy_stats)
        self.step += 1
        metrics["step_s"] = time.perf_counter() - t_step
        metrics["tokens_per_s"] = self.budget.step_tokens / max(metrics.get("generate_s", 0.0), 1e-9)
        metrics.update(self.budget.metrics())
        metrics["lr"] = self.scheduler.get_last_lr()[0]
        return metrics

    def _selection_metrics(self, chosen: list[int]) -> dict[str, float]:
        """The difficulty (posterior-mean pass rate) of the selected prompts, before this step."""
        p = self.store.pass_estimate(np.asarray(chosen, dtype=np.int64))
        q25, q50, q75 = np.quantile(p, [0.25, 0.5, 0.75]) if len(p) else (np.nan,) * 3
        return {"selected/pass_estimate_mean": float(p.mean()) if len(p) else float("nan"),
                "selected/pass_estimate_q25": float(q25), "selected/pass_estimate_q50": float(q50),
                "selected/pass_estimate_q75": float(q75),
                "selected/unseen_fraction": float(np.mean(self.store.last_step[chosen] < 0)) if chosen else 0.0}

    def shape(self, groups: list[Group], metrics: StepMetrics) -> None:
        """The recipe's reward shapings, in order, on freshly verified groups."""
        for shaping in self.shapings:
            shaping(groups, self.recipe.rollout.max_new_tokens)
            column = np.concatenate([g.rewards[:, g.reward_names.index(shaping.column)] for g in groups])
            metrics.mean(f"reward/{shaping.column}", float(column.mean()), len(column))
            metrics.update({f"shaping/{k}": v for k, v in shaping.metrics().items()})

    def learn(self, batch: Batch, metrics: dict[str, Any]) -> None:
        """Advantages, token weights and the policy update of a verified batch."""
        batch.advantages = self.estimator(batch)
        self._fit_entropy_stats(batch)
        weights = self.token_weights(batch, metrics)
        # over the same tokens: those of this step's groups (partial mode reuses tokens of earlier steps)
        generated = sum(len(r) for g in self.last_groups for r in g.rollouts)
        metrics["effective_token_fraction"] = self._effective_tokens(batch, weights) / max(generated, 1)
        metrics.update(self.update(batch, weights))

    def progress(self) -> float:
        """The fraction of the run done, by whichever budget ends it first (for schedules)."""
        b = self.recipe.budget
        done = [self.step / b.max_steps if b.max_steps else 0.0,
                self.budget.tokens / b.max_tokens if b.max_tokens else 0.0]
        return min(1.0, max(done))

    def _fit_entropy_stats(self, batch: Batch) -> None:
        """HAPO's ĥ statistics over the batch's tokens, once per step, for losses and the sampler."""
        if self.loss_fn.needs_entropy or self.recipe.rollout.adaptive_temperature is not None:
            pivot = (self.recipe.rollout.adaptive_temperature or AdaptiveTemperature()).pivot
            self.entropy_stats = EntropyStats.fit(np.concatenate(batch_entropies(batch)), pivot)

    def token_weights(self, batch: Batch, metrics: dict[str, Any]) -> list[np.ndarray] | None:
        """Per-token weights from the recipe's token weightings (None: every token weighs 1)."""
        if not self.token_weightings:
            return None
        weights = [np.ones(len(r)) for r in batch.rollouts]
        for weighting in self.token_weightings:
            weights = weighting(batch, weights, self.progress())
        kept = sum(int((w > 0).sum()) for w in weights)
        metrics["tokens/kept_fraction"] = kept / max(sum(len(w) for w in weights), 1)
        metrics["tokens/kept_rollout_fraction"] = float(np.mean([bool((w > 0).any()) for w in weights]))
        return weights

    @staticmethod
    def _effective_tokens(batch: Batch, weights: list[np.ndarray] | None = None) -> int:
        """Generated tokens that carry a non-zero advantage (after token weighting)."""
        if weights is None:
            return int(sum(len(r) for r, a in zip(batch.rollouts, batch.advantages, strict=True) if a != 0.0))
        return int(sum(int((w > 0).sum()) for w, a in zip(weights, batch.advantages, strict=True) if a != 0.0))

    @staticmethod
    def _batch_metrics(generated: list[Group], batch: Batch) -> dict[str, Any]:
        """Statistics of everything generated this step, and of what survived to the loss."""
        if not generated:  # the allocator had no budget left to spend
            return {"groups": 0, "trained_groups": 0}
        rollouts = [r for g in generated for r in g.rollouts]
        lengths = np.array([len(r) for r in rollouts])
        correct = np.concatenate([g.correct for g in generated])
        rewards = np.concatenate([g.reward for g in generated])
        sizes = np.array([g.size for g in generated])
        return {
            "reward": float(rewards.mean()),
            "pass_rate": float(correct.mean()),
            "zero_variance_fraction": float(np.mean([g.zero_variance for g in generated])),
            "groups": len(generated),
            "trained_groups": len(batch.groups),
            "response_length": float(lengths.mean()),
            "truncated_fraction": float(np.mean([r.finish_reason == "length" for r in rollouts])),
            "rollouts_per_prompt_mean": float(sizes.mean()),
            "rollouts_per_prompt_min": int(sizes.min()),
            "rollouts_per_prompt_max": int(sizes.max()),
            "rollouts_per_prompt_hist": {str(n): int(c) for n, c in zip(*np.unique(sizes, return_counts=True),
                                                                         strict=True)},
        }

    # ---------------------------------------------------------------- update

    def update(self, batch: Batch, weights: list[np.ndarray] | None = None) -> dict[str, float]:
        crash_point("backward", self.step + 1)
        self.learner.entropy_stats = self.entropy_stats
        return self.learner.update(batch, weights)

    # ---------------------------------------------------------------- evaluation

    def evaluate(self) -> dict[str, float]:
        crash_point("eval", self.step)
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

    def components(self) -> dict[str, Any]:
        """Every stage object of the recipe, by a stable name: what keeps state is checkpointed."""
        out = {"selector": self.selector, "allocator": self.allocator, "estimator": self.estimator,
               "loss": self.loss_fn}
        out.update({f"shaping.{i}": c for i, c in enumerate(self.shapings)})
        out.update({f"tokens.{i}": c for i, c in enumerate(self.token_weightings)})
        return out

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "budget": self.budget.state_dict(),
            "components": {name: c.state_dict() for name, c in self.components().items()},
            "generator": self.generator.state_dict(),
            "rollout_scheduler": self.rollouts.state_dict(),
            "scheduler": self.learner.scheduler.state_dict(),
            "np_rng": self.np_rng.bit_generator.state,
            "torch_rng": torch.get_rng_state(),
            "python_rng": random.getstate(),
            "skipped_updates": self.learner.skipped_updates,
            "bad_updates_in_a_row": self.learner.bad_updates_in_a_row,
            "wall_s": self.wall_offset,
            "store": self.store.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = state["step"]
        self.budget.load_state_dict(state["budget"])
        # checkpoints written before "components" held the selector's and the allocator's state only
        saved = state.get("components") or {"selector": state["selector"], "allocator": state["allocator"]}
        for name, component in self.components().items():
            if name in saved:
                component.load_state_dict(saved[name])
        self.generator.load_state_dict(state["generator"])
        if "rollout_scheduler" in state:
            self.rollouts.load_state_dict(state["rollout_scheduler"])
        self.learner.load_state_dict(state)
        self.np_rng.bit_generator.state = state["np_rng"]
        torch.set_rng_state(state["torch_rng"])
        random.setstate(state["python_rng"])
        self.wall_offset = state["wall_s"]
        self.store.load_state_dict(state["store"])

    def save_checkpoint(self) -> Path:
        crash_point("checkpoint", self.step)
        path = checkpoint.save(
            self.run_dir / "checkpoints", self.step, self.model, self.optimizer.state_dict(),
            self.state_dict(), keep=self.recipe.checkpoint.keep,
        )
        self.store.to_parquet(self.run_dir / "store.parquet")  # the difficulty store, for users to query
        return path

    def resume(self) -> bool:
        """Load the latest complete checkpoint, if any (`run` then drops the metrics rows after it)."""
        path = checkpoint.latest(self.run_dir / "checkpoints")
        if path is None:
            print(f"resume: no complete checkpoint in {self.run_dir}; starting from step 0",
                  file=sys.stderr, flush=True)
            return False
        try:
            optimizer_state, state = checkpoint.load(path, self.model)
            self.optimizer.load_state_dict(optimizer_state)
            self.load_state_dict(state)
        except (RuntimeError, ValueError, KeyError, OSError, EOFError) as err:
            raise ResumeError(f"cannot resume {self.run_dir} from {path.name}: {err}") from err
        print(f"resume: continuing {self.run_dir} from step {self.step} ({path.name})", file=sys.stderr, flush=True)
        return True

    # ---------------------------------------------------------------- the loop

    def _due(self, every: int) -> bool:
        return (every > 0 and self.step % every == 0) or self.done()

    def run(self, resume: bool = False, callbacks: Sequence[Any] = ()) -> dict[str, float]:
        """Train to the end of the budget (or until a callback asks to stop); the last metrics row.

        `callbacks` are objects with any of `on_step(step, row)`, `on_eval(step, eval_metrics)`,
        `on_checkpoint(step, path)`, or plain functions (called as `on_step`). `on_step` or
        `on_eval` returning True stops the run after that step: a checkpoint and `final/` are
        written as at the end, so `--resume` can continue it.
        """
        self.run_dir.mkdir(parents=True, exist_ok=True)
        resumed = resume and self.resume()
        for log in (self.PROMPT_LOG, self.ROLLOUT_LOG):
            if resumed:
                self._truncate_log(log)
            else:
                (self.run_dir / log).unlink(missing_ok=True)
        # written after a successful resume, whole or not at all (temp file + rename)
        checkpoint.atomic_write_text(self.run_dir / "config.yaml", dump_recipe(self.recipe))
        checkpoint.clean_stale(self.run_dir)  # a final.tmp/final.del of a killed attempt
        # a run that starts at step 0 drops every row and event of an earlier (killed) attempt
        writer = MetricsWriter(self.run_dir, tensorboard=self.recipe.log.tensorboard,
                               resume_step=self.step if resumed else -1,
                               trackers=self.recipe.log.trackers, config=self.recipe.model_dump(mode="json"))
        last: dict[str, float] = {}
        for old in MetricsWriter.read(self.run_dir) if resumed else ():
            last.update(old)
        first: dict[str, Any] = {}
        if not resumed and self.task.skipped:
            first = {"skipped_lines": self.task.skipped}
        t_start = time.perf_counter() - self.wall_offset
        try:
            if not resumed and self.recipe.eval.at_start:
                row = {"step": 0, **first, **self.budget.metrics(), **self.evaluate()}
                first = {}
                crash_point("metrics", 0)
                writer.write(row)
                last.update(row)
                _notify(callbacks, "on_eval", 0, _eval_part(row))
            with Progress(self.max_steps, enabled=self.recipe.log.progress, start_step=self.step,
                          total_tokens=self.recipe.budget.max_tokens) as progress:
                while not self.done():
                    row = {"step": self.step + 1, **first, **self.train_step()}
                    first = {}
                    if self._due(self.recipe.eval.every):
                        row.update(self.evaluate())
                    self.wall_offset = time.perf_counter() - t_start
                    row["wall_s"] = self.wall_offset
                    crash_point("metrics", self.step)
                    writer.write(row)
                    self._log_prompts()
                    if self.recipe.log.rollouts_every and self.step % self.recipe.log.rollouts_every == 0:
                        self._log_rollouts()
                    last.update(row)
                    progress.update(
                        self.step, reward=row.get("reward"), pass_rate=row.get("pass_rate"),
                        tokens_per_s=row["tokens_per_s"], tokens=row["tokens"],
                    )
                    stop = _notify(callbacks, "on_step", self.step, row)
                    if "eval/pass@1" in row:
                        stop = _notify(callbacks, "on_eval", self.step, _eval_part(row)) or stop
                    saved = self._due(self.recipe.checkpoint.every) or stop
                    if saved:
                        path = self.save_checkpoint()
                        _notify(callbacks, "on_checkpoint", self.step, path)
                    if self.bad_updates_in_a_row >= MAX_BAD_UPDATES:
                        self._stop_non_finite(saved)
                    if stop:
                        break
            self.save_final()
        finally:
            writer.close()
            self.rewards.close()
            self.rollouts.close()  # async mode: stop the generation thread
            self.generator.close()  # vllm: shut the engine down
        try:
            from adarl.metrics.report import write_report

            writer.log_artifact(write_report(self.run_dir))  # to the trackers too (never raises)
        except Exception as err:  # a report problem must never fail a finished run
            print(f"report: not written: {err!r}", file=sys.stderr)
        return last

    PROMPT_LOG = "prompts.jsonl"

    def _log_prompts(self) -> None:
        """One line per prompt of the step: how many rollouts it got, how many were correct."""
        with open(self.run_dir / self.PROMPT_LOG, "a", encoding="utf-8") as f:
            for g in self.last_groups:
                f.write(json.dumps({"step": self.step, "prompt_id": g.problem.id, "n": g.size,
                                    "correct": int(g.correct.sum()), "lengths": [len(r) for r in g.rollouts]}) + "\n")

    ROLLOUT_LOG = "rollouts.jsonl"

    def _log_rollouts(self) -> None:
        """Every rollout of the step, as a user reads it: prompt, completion, rewards, advantage.

        The advantage is null for rollouts the allocator did not keep for the update."""
        with open(self.run_dir / self.ROLLOUT_LOG, "a", encoding="utf-8") as f:
            for g in self.last_groups:
                prompt = g.problem.messages[-1]["content"]
                for i, r in enumerate(g.rollouts):
                    f.write(json.dumps({
                        "step": self.step, "prompt_id": g.problem.id, "prompt": prompt, "completion": r.text,
                        "rewards": dict(zip(g.reward_names, map(float, g.rewards[i]), strict=True)),
                        "reward": float(g.reward[i]), "correct": bool(g.correct[i]),
                        "advantage": self.last_advantages.get(id(r)), "length": len(r),
                        "finish_reason": r.finish_reason}) + "\n")

    def _truncate_log(self, name: str) -> None:
        """Drop log lines of steps after the checkpoint being resumed (atomically)."""
        path = self.run_dir / name
        if not path.exists():
            return
        kept = [row for row in read_jsonl(path) if isinstance(row.get("step"), int) and row["step"] <= self.step]
        checkpoint.atomic_write_text(path, "".join(json.dumps(row) + "\n" for row in kept))

    def _stop_non_finite(self, saved: bool) -> None:
        """Save the last good state (skipped updates never touched the weights) and stop."""
        path = checkpoint.latest(self.run_dir / "checkpoints") if saved else self.save_checkpoint()
        raise NonFiniteUpdates(
            f"training stopped at step {self.step}: the last {self.bad_updates_in_a_row} updates had a "
            f"non-finite (NaN/inf) loss or gradient and were skipped ({self.skipped_updates} skipped in all). "
            f"The weights are those of the last good update, saved in {path}. Lower train.lr, set "
            f"train.max_grad_norm or check the rewards, then continue with: adarl train --resume {self.run_dir}"
        )

    def save_final(self) -> None:
        """`final/`: a Hugging Face folder, written under `final.tmp/` and renamed when complete."""
        crash_point("final", self.step)
        checkpoint.save_model(self.run_dir / "final", self.model, self.tokenizer, phase="final", step=self.step)
        # a 135M model's checkpoint is ~1.6 GB with its optimizer state: keep only what a resume needs
        checkpoint.prune(self.run_dir / "checkpoints", self.recipe.checkpoint.keep_final, self.step)
