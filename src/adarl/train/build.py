"""The parts of a run the recipe chooses an engine or a method for, built here so that the trainer
(train/trainer.py) composes them without naming any:

- the generator: in this process (hf or vLLM), or a pool of Ray rollout workers (`cluster.backend`),
  with the packages each needs checked before any model loads (`missing_packages`);
- the rewards: scored in this process's worker pool, or on Ray verifier actors (`cluster.verifiers`);
- the peers: other trainers of a SAPO swarm that share verified groups (`cluster.sapo`), or none;
- the learner: one process, or sharded over torchrun's ranks with FSDP2 (`train.parallel: fsdp2`),
  with the reference model, entropy statistics and distillation teacher its loss needs.

`follow` is what ranks 1..N-1 of a sharded run do: build the same learner and serve rank 0's calls.
"""

from __future__ import annotations

import copy
import importlib.util
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from adarl.config import AdaptiveTemperature, ClusterConfig, Recipe, RolloutConfig, resolve_backend
from adarl.models import load_reference
from adarl.rollout import build_generator
from adarl.tokens.entropy import EntropyObserver
from adarl.train.learner import Learner
from adarl.train.teacher import Teacher


def missing_packages(rollout: RolloutConfig, cluster: ClusterConfig | None = None) -> list[str]:
    """What the recipe needs that is not installed, each with its install command: its engine's package
    (adarl/engines.py), Ray (cluster.backend ray), openenv-core (an OpenEnv agent environment). Checked
    before any model loads."""
    from adarl.cluster import RAY_MISSING
    from adarl.engines import missing_package
    from adarl.rollout.openenv import MISSING as OPENENV_MISSING

    needs = [(cluster is not None and cluster.backend == "ray", "ray", RAY_MISSING),
             (rollout.agent is not None and rollout.agent.openenv is not None, "openenv", OPENENV_MISSING)]
    engine = [message] if (message := missing_package(rollout.backend)) else []
    return engine + [message for needed, package, message in needs
                     if needed and importlib.util.find_spec(package) is None]


def build_rollout(recipe: Recipe, model: torch.nn.Module, tokenizer: Any, problems: Sequence[Any]) -> Any:
    """The recipe's generator (rollout/__init__.py: build_generator) in this process, or on a pool of
    Ray rollout workers (`cluster.backend: ray`) fed the trained weights after each update.

    The one place a run decides its backend: `auto` becomes the engine used (config.resolve_backend),
    written back to the recipe so that config.yaml, and a resume, name it. (A recipe file keeps `auto`:
    the same file runs on vLLM on a GPU machine and on the hf decoder where vLLM is missing.)"""
    recipe.rollout.backend = resolve_backend(recipe)
    engine = None
    if recipe.cluster.backend == "ray":
        from adarl.cluster.ray_pool import RayRolloutPool

        engine = RayRolloutPool(model, tokenizer, recipe.rollout, recipe.cluster, seed=recipe.seed)
    return build_generator(model, tokenizer, recipe.rollout, seed=recipe.seed, problems=problems, engine=engine)


def build_rewards(recipe: Recipe) -> Any:
    """The recipe's reward functions, scored by an isolated process pool (here, or on each Ray verifier)."""
    if recipe.cluster.verifiers:
        from adarl.cluster.verifiers import RayRewards

        return RayRewards(recipe.rewards, recipe.cluster.verifiers, recipe.reward_workers, recipe.reward_timeout_s,
                          recipe.cluster.verifier_cpus, recipe.cluster.address)
    from adarl.rewards import Rewards

    return Rewards(recipe.rewards, workers=recipe.reward_workers, timeout_s=recipe.reward_timeout_s)


def build_peers(recipe: Recipe, tokenizer: Any) -> Any:
    """Other trainers' verified groups (`exchange(groups, rewards) -> (foreign groups, metrics)`,
    `close()`), or None when the run trains alone."""
    if recipe.cluster.sapo is None:
        return None
    from adarl.cluster.sapo import Swarm

    agent = recipe.rollout.agent  # a trajectory's tokens: its turns, within the agent's context
    context = None if agent is None else agent.max_context_tokens or 4 * recipe.rollout.max_new_tokens
    return Swarm(recipe.cluster.sapo, tokenizer, recipe.rollout.max_new_tokens, recipe.cluster.address,
                 max_completion_tokens=context, seed=recipe.seed)


def corrects_mismatch(recipe: Recipe, loss: Any) -> bool:
    """The default of `train.mismatch.correct` (loss/mismatch.py), decided here alone: on unless the sampler
    is the learner's own forward (the hf decoder with the learner's module, in this process: the table of
    engines says which, adarl/engines.py) or the loss already weighs each token by π_old/π_beh
    (`weighs_behaviour`: decoupled_ppo). vLLM, Ray workers and an engine named by import path are corrected."""
    from adarl.engines import samples_with_learner_forward

    own_forward = samples_with_learner_forward(resolve_backend(recipe), recipe.cluster.backend)
    return not own_forward and not loss.weighs_behaviour


def build_learner(recipe: Recipe, model: torch.nn.Module, loss: Any, pad_id: int, rng: np.random.Generator,
                  tokenizer: Any = None) -> Learner:
    """The recipe's learner of `model`, with the reference model, entropy statistics and teacher its loss
    needs. Sharded (`train.parallel: fsdp2`), it trains a copy of `model` split over the ranks and
    `publish` gathers the trained weights back into `model` (what rank 0's generator samples from);
    every rank builds it alike. `tokenizer`: the teacher's (distillation), on rank 0."""
    entropy = None  # normalised entropy statistics: fitted by the learner on each batch
    if loss.needs_entropy or recipe.rollout.adaptive_temperature is not None:
        entropy = EntropyObserver((recipe.rollout.adaptive_temperature or AdaptiveTemperature()).pivot)
    reference = load_reference(recipe.model) if loss.kl_coef > 0 and recipe.model.lora is None else None
    if recipe.train.mismatch.correct is None:  # written back: config.yaml names the choice made
        recipe.train.mismatch.correct = corrects_mismatch(recipe, loss)
    teacher = None if recipe.distill is None or tokenizer is None else Teacher(
        recipe.distill, model, tokenizer, recipe.rollout.temperature, recipe.train.logit_chunk, loss.agg)
    kw: dict[str, Any] = {}
    learner_class: type[Learner] = Learner
    if recipe.train.parallel == "fsdp2":
        from adarl.train.sharded import ShardedLearner

        learner_class = ShardedLearner
        if tokenizer is not None:  # rank 0 keeps `model` whole for its generator (and a LoRA learner's adapters)
            kw["whole"], model = model, copy.deepcopy(model)
    return learner_class(model, loss, recipe.train, temperature=recipe.rollout.temperature, pad_id=pad_id, rng=rng,
                         reference=reference, max_len=recipe.loss.get("max_len") or recipe.rollout.max_new_tokens,
                         entropy=entropy, teacher=teacher, **kw)


def follow(recipe: Recipe) -> None:
    """Ranks 1..N-1 of `torchrun ... -m adarl.cli train RECIPE`: build the learner as rank 0 does and serve
    its calls until it closes. These ranks generate, verify and write nothing."""
    from adarl import registry
    from adarl.models import load_model

    torch.manual_seed(recipe.seed)
    if recipe.model.threads:
        torch.set_num_threads(recipe.model.threads)
    model, tokenizer = load_model(recipe.model, for_training=True)
    if recipe.train.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    learner = build_learner(recipe, model, registry.build("loss", recipe.loss, recipe.seed), pad_id,
                            np.random.default_rng(recipe.seed))
    learner.serve()
