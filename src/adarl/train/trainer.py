"""The trainer: one step reads like the data flow of design.md.

    select → allocate (plan) → generate → verify → (allocate.more → generate → verify)* →
    allocate.finish → estimate → weigh tokens → learner update → push weights → checkpoint

The trainer composes stages and knows nothing about which method each one is: each stage is
built from its recipe section, talks through `adarl.types`, and is checkpointed by contract
(`metrics`, `state_dict`, `load_state_dict`).
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from adarl import registry
from adarl.allocate.base import plan_spares
from adarl.budget import Budget, check_feasible
from adarl.config import Recipe
from adarl.hints.base import hint_rung, hinted
from adarl.metrics.sinks import RunLogs
from adarl.metrics.step import RunTotals, StepMetrics, batch_metrics
from adarl.metrics.trackers import check_trackers
from adarl.models import chat_ids, load_model, peak_memory_gib
from adarl.rollout import build_scheduler
from adarl.rollout.base import capable
from adarl.rollout.scheduler import COUNTS
from adarl.select.store import DifficultyStore
from adarl.shaping.base import apply_shapings
from adarl.tasks import build_task
from adarl.tokens.base import effective_tokens, weigh_tokens
from adarl.train.build import build_learner, build_peers, build_rewards, build_rollout
from adarl.train.checkpoint import crash_point
from adarl.train.loop import MAX_BAD_UPDATES, NonFiniteUpdates, ResumeError, run  # noqa: F401 (for users)
from adarl.types import Batch, Group, Problem, Request, merge


class Trainer:
    def __init__(self, recipe: Recipe, run_dir: Path):
        self.recipe, self.run_dir, self.step, self.wall_offset = recipe, Path(run_dir), 0, 0.0
        random.seed(recipe.seed), np.random.seed(recipe.seed % 2**32), torch.manual_seed(recipe.seed)
        if recipe.model.threads:
            torch.set_num_threads(recipe.model.threads)
        if recipe.deterministic:
            torch.use_deterministic_algorithms(True, warn_only=True)
        check_trackers(recipe.log.trackers, recipe.model_dump(mode="json"))  # a missing package fails here
        self.task = build_task(recipe.task, recipe.seed)
        check_feasible(recipe.budget, len(self.task.train), recipe.task.eval_size, recipe.eval.size,
                       len(self.task.eval))
        self.rewards = build_rewards(recipe)  # in this process, or on remote verifiers
        model, self.tokenizer = load_model(recipe.model, for_training=True)  # the learner's (it owns it)
        if recipe.train.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        seed = recipe.seed  # a component's `seed` the recipe leaves out (registry.build)
        self.selector = registry.build("select", recipe.select, seed)
        self.allocator = registry.build("allocate", recipe.allocate, seed)
        self.shapings = [registry.build("shaping", spec, seed) for spec in recipe.shaping]
        self.estimator = registry.build("advantage", recipe.advantage, seed)
        self.hints = registry.build("hints", recipe.hints, seed) if recipe.hints is not None else None
        self.token_weightings = [registry.build("tokens", spec, seed) for spec in recipe.tokens]
        loss = registry.build("loss", recipe.loss, seed)
        self.generator = build_rollout(recipe, model, self.tokenizer,
                                       problems=self.task.train + self.task.eval)  # an agent's environments
        self.agent = self.generator if recipe.rollout.agent else None
        self.rollouts = build_scheduler(self.generator, recipe.rollout.scheduler)
        self.peers = build_peers(recipe, self.tokenizer)  # other trainers' verified groups, or None
        self.budget = Budget(recipe.budget.max_tokens, recipe.budget.tokens_per_step,
                             recipe.budget.rollouts_per_step, expected_length=recipe.rollout.max_new_tokens)
        self.store = DifficultyStore([p.id for p in self.task.train], *self.selector.store_decay(),
                                     problems=self.task.train)
        self.totals = RunTotals()  # token counts over the run, for the cumulative fractions
        self.problems_by_id = {p.id: p for p in self.task.train}
        self.np_rng = np.random.default_rng(recipe.seed)
        self.learner = build_learner(recipe, model, loss, self.generator.pad_id, self.np_rng, self.tokenizer)
        # normalised entropy statistics (or None): fitted by the learner on each batch, read by the loss and the sampler
        self.entropy, self.reference = self.learner.entropy, self.learner.reference
        self.logs = RunLogs(self.run_dir, recipe.log.rollouts_every, decode=self.tokenizer.decode)
        self._prompt_cache: dict[str, list[int]] = {}
        self.last_groups: list[Group] = []
        self.last_advantages: dict[int, float] = {}
        self.last_rungs: dict[str, int] = {}  # prompt id -> the ladder rung its group reached this step
        self.stalled = False  # the last step generated and trained nothing, within a run's token budget

    @property
    def model(self) -> torch.nn.Module:
        """The policy being trained: the learner's, which owns it, its optimizer and their checkpoints."""
        return self.learner.whole_model

    def messages(self, problem: Problem) -> list[dict[str, str]]:
        """The problem's chat as the policy sees it (an agent's describes its tools)."""
        return self.agent.messages(problem) if self.agent else problem.messages

    def prompt_ids(self, problem: Problem) -> list[int]:
        if problem.id not in self._prompt_cache:
            self._prompt_cache[problem.id] = chat_ids(self.tokenizer, self.messages(problem))
        return self._prompt_cache[problem.id]

    def done(self) -> bool:
        return (self.recipe.budget.max_steps is not None and self.step >= self.recipe.budget.max_steps) \
            or self.budget.exhausted() or self.stalled

    def progress(self) -> float:
        """The fraction of the run done, by whichever budget ends it first (for schedules)."""
        b = self.recipe.budget
        return min(1.0, max(self.step / b.max_steps if b.max_steps else 0.0,
                            self.budget.total_tokens / b.max_tokens if b.max_tokens else 0.0))

    # ---------------------------------------------------------------- one step

    def train_step(self) -> dict[str, float]:
        t_step, metrics = time.perf_counter(), StepMetrics()
        peak_memory_gib(self.learner.device, reset=True)
        self.budget.start_step()
        chosen = self.selector.select(self.store, self.allocator.candidates(self.recipe.budget.prompts_per_step),
                                      self.np_rng)
        problems = {p.id: p for p in (self.task.train[i] for i in chosen)}
        metrics.update(self.store.selection_metrics(chosen))
        metrics.update({f"select/{key}": value for key, value in self.selector.metrics().items()})
        groups: dict[str, Group] = {}
        counts, first_stage = self.allocator.plan(list(problems.values()), self.store, self.budget), True
        topped_up: set[str] = set()  # prompts a later allocator stage gave more rollouts
        while counts:
            if not first_stage:
                topped_up |= {pid for pid, n in counts.items() if n > 0}
            self.rollout_and_verify(counts, problems, groups, metrics, first_stage)
            counts, first_stage = self.allocator.more(list(groups.values()), self.store, self.budget), False
        # what is left of max_tokens paid for no rollout: the next step would do the same, forever
        self.stalled = self.budget.max_tokens is not None and not groups and not self.budget.step_tokens
        plain = [replace(g, rollouts=list(g.rollouts)) for g in groups.values()]  # what the selector judges by
        if self.hints is not None:
            hint_rung(self.hints, groups, self.store, self.tokenizer, self.messages, self.prompt_ids,
                      lambda requests: self.generate(requests, metrics),
                      lambda fresh: self.verify(fresh, metrics, mean_rewards=False), metrics)
        self.last_groups = list(groups.values())
        self.climb_ladder(topped_up, metrics)
        self.selector.observe(self.store, plain)
        foreign: list[Group] = []  # other trainers' groups, re-scored here; not in the budget or store
        if self.peers is not None:
            foreign, shared = self.peers.exchange(self.last_groups, self.rewards)
            metrics.update(shared)
        batch = Batch(self.allocator.finish(self.last_groups) + foreign)
        metrics.update(batch_metrics(self.last_groups, batch))
        metrics.update({f"allocate/{key}": value for key, value in self.allocator.metrics().items()})
        if capable(self.generator, "sleep"):  # the update starts: a colocated engine frees the GPU, once a step
            self.generator.sleep()
        t0 = time.perf_counter()
        self.learn(batch, metrics, foreign)
        metrics["train_s"] = time.perf_counter() - t0
        metrics.update(self.totals.update(metrics))
        t0 = time.perf_counter()
        self.generator.load_weights(self.learner.weights())  # the next policy version (rollout/base.py)
        if self.entropy is not None:  # the sampler's ĥ: this step's statistics
            self.generator.set_entropy_stats(self.entropy.stats)
        metrics["weight_sync_s"] = time.perf_counter() - t0
        if capable(self.generator, "sleep"):  # its sleep, wake and weight push of this step
            metrics.update(self.generator.sync_metrics())
        if capable(self.generator, "remote"):  # remote rollout workers: lost, replaced, re-issued
            metrics.update(self.generator.pool_metrics())
        self.step += 1
        metrics["step_s"] = time.perf_counter() - t_step
        metrics["tokens_per_s"] = self.budget.step_tokens / max(metrics.get("generate_s", 0.0), 1e-9)
        metrics.update(self.budget.metrics())
        metrics["lr"] = self.learner.scheduler.get_last_lr()[0]
        if (peak := peak_memory_gib(self.learner.device)) is not None:  # generation and update, this step
            metrics["peak_device_memory_gib"] = peak
        return metrics

    def climb_ladder(self, topped_up: set[str], metrics: StepMetrics) -> None:
        """The rung (select/store.py: RUNGS) each group of the step reached: plain, more rollouts (a later
        allocator stage), hinted (hints/), distilled (every rollout failed: the teacher's tokens train it)."""
        distills = self.recipe.distill is not None
        self.last_rungs = {g.problem.id: 3 if distills and g.correct is not None and not g.correct.any()
                           else 2 if hinted(g) else int(g.problem.id in topped_up) for g in self.last_groups}
        metrics.update(self.store.climb(self.last_rungs))

    def rollout_and_verify(self, counts: dict[str, int], problems: dict[str, Problem], groups: dict[str, Group],
                           metrics: StepMetrics, first_stage: bool = True) -> None:
        """Generate one allocator stage's requests within the step's budget, verify and shape them."""
        requests = [Request(pid, self.prompt_ids(problems.setdefault(pid, self.problems_by_id[pid])), n)
                    for pid, n in counts.items() if n > 0]  # a prompt may be of an earlier step (a buffer)
        result = self.generate(requests, metrics, first_stage)
        fresh = [Group(problems.setdefault(g.request.prompt_id, self.problems_by_id[g.request.prompt_id]),
                       g.request.prompt_ids, g.rollouts, group_id=g.group_id) for g in result.groups]
        fresh = self.verify(fresh, metrics)
        self.store.update(fresh, self.step + 1)
        merge(groups, fresh)

    def generate(self, requests: list[Request], metrics: StepMetrics, first_stage: bool = False) -> Any:
        """One round of generation within the step's budget, timed and counted: the scheduler's result.
        The first allocator stage's, in partial or async mode, may return groups admitted in earlier
        steps; later stages and hint rounds top up this step's groups, generated to the end."""
        crash_point("generate", self.step + 1)
        t0 = time.perf_counter()
        tokens_left = self.budget.step_tokens_left()  # a hard cap: generation stops before passing it
        if first_stage:
            result = self.rollouts.run(requests, lambda k: self._spares(k, requests), max_tokens=tokens_left,
                                       run_tokens_left=self.budget.run_tokens_left())
        else:
            result = self.rollouts.complete(requests, max_tokens=tokens_left)
        metrics.add("generate_s", time.perf_counter() - t0)
        self.budget.spend(result.rollouts_started, tokens=result.tokens_spent)
        metrics.merge("rollout/", result.metrics, summed=COUNTS)
        return result

    def verify(self, fresh: list[Group], metrics: StepMetrics, mean_rewards: bool = True) -> list[Group]:
        """Score and shape `fresh` groups, timed: those left with a rollout (the reward censors what it
        could not score). Their rewards join the step's `reward/` means unless `mean_rewards` is False
        (hinted rollouts: only their error counts)."""
        crash_point("verify", self.step + 1)
        t0 = time.perf_counter()
        for key, value in self.rewards.score(fresh).items():
            if key.startswith("reward/"):  # a mean over this stage's rollouts: the step's is over every stage's
                if mean_rewards:
                    metrics.mean(key, value, sum(g.size for g in fresh))
            elif key != "verify_s":  # error counts; the time is taken here, around scoring and shaping
                metrics.add(key, value)
        fresh = [g for g in fresh if g.rollouts]  # (every rollout of a group censored by its reward)
        apply_shapings(self.shapings, fresh, self.recipe.rollout.max_new_tokens, metrics)
        metrics.add("verify_s", time.perf_counter() - t0)
        return fresh

    def _spares(self, k: int, needed: list[Request]) -> list[Request]:
        """Over-provisioning: `k` more prompts, each with the count the allocator would give it,
        within the budget left once `needed` is reserved (`plan_spares`)."""
        chosen = [self.task.train[i] for i in self.selector.select(self.store, k, self.np_rng)]
        counts = plan_spares(self.allocator, chosen, needed, self.store, self.budget)
        return [Request(p.id, self.prompt_ids(p), counts[p.id]) for p in chosen if counts.get(p.id, 0) > 0]

    def learn(self, batch: Batch, metrics: dict[str, Any], foreign: Sequence[Group] = ()) -> None:
        """Advantages, token weights and the policy update of a verified batch (`foreign`: the groups
        in it that other trainers sampled)."""
        self.last_advantages = {}
        # the tokens of this step's groups (partial mode reuses tokens of earlier steps) and of the
        # foreign groups it trains on; useful: those that train with a non-zero advantage
        metrics["tokens/sampled"] = sampled = sum(len(r) for g in [*self.last_groups, *foreign] for r in g.rollouts)
        if not batch.groups:  # every group was filtered out: nothing to learn from this step
            metrics["tokens/useful"], metrics["effective_token_fraction"] = 0, 0.0
            return
        batch.advantages = self.estimator(batch)
        weights, token_metrics = weigh_tokens(self.token_weightings, batch, self.progress())
        metrics.update(token_metrics)
        metrics["tokens/useful"] = useful = effective_tokens(batch, weights)
        metrics["effective_token_fraction"] = useful / max(sampled, 1)
        crash_point("backward", self.step + 1)
        metrics.update(self.learner.update(batch, weights))
        self.last_advantages = {id(r): float(a) for r, a in zip(batch.rollouts, batch.advantages, strict=True)}

    # ---------------------------------------------------------------- the loop

    def run(self, resume: bool = False, callbacks: Sequence[Any] = ()) -> dict[str, float]:
        """Train to the end of the budget (or until a callback asks to stop); the last metrics row
        (`adarl.train.loop.run`: logs, evaluations, checkpoints and callbacks around `train_step`)."""
        return run(self, resume, callbacks)
