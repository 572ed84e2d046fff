"""The trainer: one step reads like the data flow of design.md.

    select → allocate (plan) → generate → verify → (allocate.more → generate → verify)* →
    allocate.finish → estimate → weigh tokens → learner update → push weights → checkpoint

The trainer composes stages and knows nothing about which method each one is: each stage is
built from its recipe section, talks through `adarl.types`, and is checkpointed by contract
(`metrics`, `state_dict`, `load_state_dict`).
"""

from __future__ import annotations

import copy
import random
import sys
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
from adarl.config import AdaptiveTemperature, Recipe, resolve_backend
from adarl.evaluate import score_problems
from adarl.hints.base import hint_rung, hinted
from adarl.metrics.sinks import RunLogs
from adarl.metrics.step import RunTotals, StepMetrics, batch_metrics
from adarl.metrics.trackers import check_trackers
from adarl.models import chat_ids, load_model, load_reference, peak_memory_gib
from adarl.rewards import Rewards
from adarl.rollout import build_generator
from adarl.rollout.scheduler import COUNTS, RolloutScheduler
from adarl.select.store import RUNGS, DifficultyStore
from adarl.shaping.base import apply_shapings
from adarl.tasks.base import build_task
from adarl.tasks.mixture import pass1_by_share
from adarl.tokens.base import effective_tokens, weigh_tokens
from adarl.tokens.entropy import EntropyObserver
from adarl.train.checkpoint import crash_point
from adarl.train.learner import Learner
from adarl.train.loop import MAX_BAD_UPDATES, NonFiniteUpdates, ResumeError, run  # noqa: F401 (for users)
from adarl.train.teacher import Teacher
from adarl.types import Batch, Group, Problem, Request, merge


def build_learner(recipe: Recipe, model: torch.nn.Module, loss: Any, pad_id: int, rng: np.random.Generator,
                  teacher: Teacher | None = None) -> Learner:
    """The recipe's learner of `model` (`train.parallel: fsdp2`: sharded in place over the ranks), with the
    reference model and entropy statistics its loss needs. Every rank of a sharded run builds it alike."""
    entropy = None  # normalised entropy statistics: fitted by the learner on each batch
    if loss.needs_entropy or recipe.rollout.adaptive_temperature is not None:
        entropy = EntropyObserver((recipe.rollout.adaptive_temperature or AdaptiveTemperature()).pivot)
    reference = load_reference(recipe.model) if loss.kl_coef > 0 and recipe.model.lora is None else None
    learner_class = Learner
    if recipe.train.parallel == "fsdp2":
        from adarl.train.sharded import ShardedLearner

        learner_class = ShardedLearner
    return learner_class(model, loss, recipe.train, temperature=recipe.rollout.temperature, pad_id=pad_id, rng=rng,
                         reference=reference, max_len=recipe.loss.get("max_len") or recipe.rollout.max_new_tokens,
                         entropy=entropy, teacher=teacher)


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
        if recipe.cluster.verifiers:  # scored on Ray actors, each with the same isolated process pool
            from adarl.cluster.verifiers import RayRewards

            self.rewards: Any = RayRewards(recipe.rewards, recipe.cluster.verifiers, recipe.reward_workers,
                                           recipe.reward_timeout_s, recipe.cluster.verifier_cpus,
                                           recipe.cluster.address)
        else:
            self.rewards = Rewards(recipe.rewards, workers=recipe.reward_workers, timeout_s=recipe.reward_timeout_s)
        self.model, self.tokenizer = load_model(recipe.model, for_training=True)
        if recipe.train.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        self.selector = registry.build("select", recipe.select)
        self.allocator = registry.build("allocate", recipe.allocate)
        self.shapings = [registry.build("shaping", spec) for spec in recipe.shaping]
        self.estimator = registry.build("advantage", recipe.advantage)
        self.hints = registry.build("hints", recipe.hints) if recipe.hints is not None else None
        self.token_weightings = [registry.build("tokens", spec) for spec in recipe.tokens]
        loss = registry.build("loss", recipe.loss)
        recipe.rollout.backend = resolve_backend(recipe)  # auto -> the one used, as config.yaml records
        self.generator = build_generator(self.model, self.tokenizer, recipe.rollout, seed=recipe.seed,
                                         problems=self.task.train + self.task.eval,  # an agent's environments
                                         cluster=recipe.cluster)
        self.agent = self.generator if recipe.rollout.agent else None
        self.rollouts = RolloutScheduler(self.generator, recipe.rollout.scheduler)
        self.swarm = None  # SAPO: verified groups shared with the other trainers of a swarm
        if recipe.cluster.sapo is not None:
            from adarl.cluster.sapo import Swarm

            self.swarm = Swarm(recipe.cluster.sapo, self.tokenizer, recipe.rollout.max_new_tokens,
                               recipe.cluster.address)
        self.budget = Budget(recipe.budget.max_tokens, recipe.budget.tokens_per_step,
                             recipe.budget.rollouts_per_step, expected_length=recipe.rollout.max_new_tokens)
        self.store = DifficultyStore([p.id for p in self.task.train], *self.selector.store_decay(),
                                     problems=self.task.train)
        self.totals = RunTotals()  # token counts over the run, for the cumulative fractions
        self.problems_by_id = {p.id: p for p in self.task.train}
        self.np_rng = np.random.default_rng(recipe.seed)
        teacher = None if recipe.distill is None else Teacher(
            recipe.distill, self.model, self.tokenizer, recipe.rollout.temperature, recipe.train.logit_chunk)
        # sharded (fsdp2), the learner trains its own copy, and the generator samples from self.model, a full
        # copy on this rank (rank 0) that `learner.publish` refreshes after each update
        trained = copy.deepcopy(self.model) if recipe.train.parallel == "fsdp2" else self.model
        self.learner = build_learner(recipe, trained, loss, self.generator.pad_id, self.np_rng, teacher)
        # normalised entropy statistics: fitted by the learner on each batch, read by the loss and the sampler
        self.entropy: EntropyObserver | None = self.learner.entropy
        self.reference = self.learner.reference
        self.logs = RunLogs(self.run_dir, recipe.log.rollouts_every, decode=self.tokenizer.decode)
        self._prompt_cache: dict[str, list[int]] = {}
        self.last_groups: list[Group] = []
        self.last_advantages: dict[int, float] = {}
        self.last_rungs: dict[str, int] = {}  # prompt id -> the ladder rung its group reached this step
        self.stalled = False  # the last step generated and trained nothing, within a run's token budget

    def prompt_ids(self, problem: Problem) -> list[int]:
        if problem.id not in self._prompt_cache:
            messages = self.agent.messages(problem) if self.agent else problem.messages
            self._prompt_cache[problem.id] = chat_ids(self.tokenizer, messages)
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
            hint_rung(self, groups, metrics)
        self.last_groups = list(groups.values())
        self.climb_ladder(topped_up, metrics)
        self.selector.observe(self.store, plain)
        foreign: list[Group] = []  # SAPO: other trainers' groups, re-scored here; not in the budget or store
        if self.swarm is not None:
            foreign, shared = self.swarm.exchange(self.last_groups, self.rewards)
            metrics.update(shared)
        batch = Batch(self.allocator.finish(self.last_groups) + foreign)
        metrics.update(batch_metrics(self.last_groups, batch))
        metrics.update({f"allocate/{key}": value for key, value in self.allocator.metrics().items()})
        t0 = time.perf_counter()
        self.learn(batch, metrics, foreign)
        metrics["train_s"] = time.perf_counter() - t0
        metrics.update(self.totals.update(metrics))
        t0 = time.perf_counter()
        self.learner.publish(self.model)  # sharded: gathered into rank 0's full copy
        self.generator.update_weights()
        if self.entropy is not None:  # the sampler's ĥ: this step's statistics
            self.generator.set_entropy_stats(self.entropy.stats)
        metrics["weight_sync_s"] = time.perf_counter() - t0
        if hasattr(self.generator, "pool_metrics"):  # Ray rollout workers: lost, replaced, re-issued
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
        """The rung each group of the step reached (select/store.py: RUNGS): plain, more rollouts (a
        later allocator stage), hinted (hints/), distilled (every rollout failed, and the teacher's
        tokens are what it trains on); in the store, prompts.jsonl and `ladder/<rung>` counts."""
        self.last_rungs = {}
        for g in self.last_groups:
            rung = 0
            if g.problem.id in topped_up:
                rung = 1
            if hinted(g):
                rung = 2
            if self.learner.teacher is not None and g.correct is not None and not g.correct.any():
                rung = 3
            self.last_rungs[g.problem.id] = rung
            if g.problem.id in self.store.index:
                self.store.rung[self.store.index[g.problem.id]] = rung
        for i, name in enumerate(RUNGS):
            metrics[f"ladder/{name}"] = float(sum(r == i for r in self.last_rungs.values()))

    def rollout_and_verify(self, counts: dict[str, int], problems: dict[str, Problem], groups: dict[str, Group],
                           metrics: StepMetrics, first_stage: bool = True) -> None:
        """Generate one allocator stage's requests within the step's budget, verify and shape them."""
        requests = [Request(pid, self.prompt_ids(problems.setdefault(pid, self.problems_by_id[pid])), n)
                    for pid, n in counts.items() if n > 0]  # a prompt may be of an earlier step (a buffer)
        crash_point("generate", self.step + 1)
        t0 = time.perf_counter()
        tokens_left = self.budget.step_tokens_left()  # a hard cap: generation stops before passing it
        if first_stage:  # partial or async: may return groups of prompts admitted in earlier steps
            result = self.rollouts.run(requests, lambda k: self._spares(k, requests), max_tokens=tokens_left,
                                       run_tokens_left=self.budget.run_tokens_left())
        else:  # later allocator stages top up groups trained this step: generated to the end
            result = self.rollouts.complete(requests, max_tokens=tokens_left)
        metrics.add("generate_s", time.perf_counter() - t0)
        self.budget.spend(result.rollouts_started, tokens=result.tokens_spent)
        metrics.merge("rollout/", result.metrics, summed=COUNTS)
        fresh = [Group(problems.setdefault(g.request.prompt_id, self.problems_by_id[g.request.prompt_id]),
                       g.request.prompt_ids, g.rollouts, group_id=g.group_id) for g in result.groups]
        crash_point("verify", self.step + 1)
        t0 = time.perf_counter()
        for key, value in self.rewards.score(fresh).items():
            if key.startswith("reward/"):  # a mean over this stage's rollouts: the step's is over every stage's
                metrics.mean(key, value, sum(g.size for g in fresh))
            elif key != "verify_s":  # error counts; the time is taken here, around scoring and shaping
                metrics.add(key, value)
        fresh = [g for g in fresh if g.rollouts]  # (every rollout of a group censored by its reward)
        apply_shapings(self.shapings, fresh, self.recipe.rollout.max_new_tokens, metrics)
        metrics.add("verify_s", time.perf_counter() - t0)
        self.store.update(fresh, self.step + 1)
        merge(groups, fresh)

    def _spares(self, k: int, needed: list[Request]) -> list[Request]:
        """Over-provisioning: `k` more prompts, each with the count the allocator would give it,
        within the budget left once `needed` is reserved (`plan_spares`)."""
        chosen = [self.task.train[i] for i in self.selector.select(self.store, k, self.np_rng)]
        counts = plan_spares(self.allocator, chosen, needed, self.store, self.budget)
        return [Request(p.id, self.prompt_ids(p), counts[p.id]) for p in chosen if counts.get(p.id, 0) > 0]

    def learn(self, batch: Batch, metrics: dict[str, Any], foreign: Sequence[Group] = ()) -> None:
        """Advantages, token weights and the policy update of a verified batch (`foreign`: the groups
        in it that other trainers sampled, SAPO)."""
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

    def evaluate(self) -> dict[str, float]:
        """Held-out greedy pass@1 (overall, and per share of a mixed task) and length (and pass@k /
        mean@k over `eval.samples` samples)."""
        crash_point("eval", self.step)
        cfg = self.recipe.eval
        problems = self.task.eval[: cfg.size] if cfg.size else self.task.eval
        if not problems:
            return {}
        t0 = time.perf_counter()
        rng_state = self.generator.rng.get_state()  # evaluation never shifts the training stream
        results = score_problems(self.generator, self.rewards, problems, {p.id: self.prompt_ids(p) for p in problems},
                                 n=cfg.samples, max_new_tokens=cfg.max_new_tokens or self.recipe.rollout.max_new_tokens,
                                 label="eval", progress=self.recipe.log.progress and sys.stderr.isatty())
        self.generator.rng.set_state(rng_state)
        out = {"eval/pass@1": float(np.mean([r.greedy for r in results])),
               "eval/length": float(np.mean([r.greedy_length for r in results])),
               **pass1_by_share(problems, [r.greedy for r in results])}  # a mixed task's shares
        if cfg.samples:
            out[f"eval/mean@{cfg.samples}"] = float(np.mean([r.c / r.n for r in results]))
            out[f"eval/pass@{cfg.samples}"] = float(np.mean([r.c > 0 for r in results]))
        return {**out, "eval_s": time.perf_counter() - t0}

    # ---------------------------------------------------------------- state

    def components(self) -> dict[str, Any]:
        """Every stage object of the recipe, by a stable name: what keeps state is checkpointed."""
        return {"selector": self.selector, "allocator": self.allocator, "estimator": self.estimator,
                "loss": self.learner.loss, **({"hints": self.hints} if self.hints is not None else {}),
                **{f"shaping.{i}": c for i, c in enumerate(self.shapings)},
                **{f"tokens.{i}": c for i, c in enumerate(self.token_weightings)}}

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "budget": self.budget.state_dict(), "store": self.store.state_dict(),
                "totals": self.totals.state_dict(),
                "components": {name: c.state_dict() for name, c in self.components().items()},
                "generator": self.generator.state_dict(), "rollout_scheduler": self.rollouts.state_dict(),
                **self.learner.state_dict(), "np_rng": self.np_rng.bit_generator.state,
                "torch_rng": torch.get_rng_state(), "python_rng": random.getstate(), "wall_s": self.wall_offset}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.wall_offset = state["step"], state["wall_s"]
        self.budget.load_state_dict(state["budget"])
        self.store.load_state_dict(state["store"])
        self.totals.load_state_dict(state.get("totals", {}))  # checkpoints before issue 38 have none
        # checkpoints written before "components" held the selector's and the allocator's state only
        saved = state.get("components") or {"selector": state["selector"], "allocator": state["allocator"]}
        for name, component in self.components().items():
            if name in saved:
                component.load_state_dict(saved[name])
        self.generator.load_state_dict(state["generator"])
        self.rollouts.load_state_dict(state.get("rollout_scheduler", {"next_id": 0, "buffer": []}))
        self.learner.load_state_dict(state)
        self.np_rng.bit_generator.state = state["np_rng"]
        torch.set_rng_state(state["torch_rng"])
        random.setstate(state["python_rng"])

    # ---------------------------------------------------------------- the loop

    def run(self, resume: bool = False, callbacks: Sequence[Any] = ()) -> dict[str, float]:
        """Train to the end of the budget (or until a callback asks to stop); the last metrics row
        (`adarl.train.loop.run`: logs, evaluations, checkpoints and callbacks around `train_step`)."""
        return run(self, resume, callbacks)
