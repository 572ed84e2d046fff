"""Generator backends (the table of engines: adarl/engines.py) and the scheduler in front of them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from adarl.config import RolloutConfig, SchedulerConfig


def build_generator(model: Any, tokenizer: Any, cfg: RolloutConfig, seed: int = 0, problems: Sequence[Any] = (),
                    engine: Any = None) -> Any:
    """The generator `cfg.backend` names, sampling from (or fed by) the training `model` in this process
    (`engine`: one built elsewhere instead, such as a pool of remote rollout workers: train/build.py),
    wrapped in the tree sampler, budget sentences or agent loop (over the environments of `problems`) the
    recipe asks for. The recipe refuses the wrappers' combinations when it loads (config.RolloutConfig)."""
    if engine is not None:
        generator = engine
    elif ":" in cfg.backend:  # an engine of the user's, by import path: the contract is checked here
        generator = build_engine(cfg.backend, model, tokenizer, cfg, seed)
    else:  # a built-in engine: its row of the table (adarl/engines.py); auto resolved as a run resolves it
        from adarl import engines
        from adarl.config import pick_backend

        generator = engines.build(pick_backend(cfg), model, tokenizer, cfg, seed)
    if cfg.branching is not None:
        return build_branching(generator, cfg.branching)
    if cfg.budget_sentences is not None:
        from adarl.rollout.hbpo import BudgetSentences

        return BudgetSentences(generator, cfg.budget_sentences.budgets, cfg.budget_sentences.template)
    if cfg.effort_sentences is not None:  # e1: the same subgroups, each told its effort
        from adarl.rollout.hbpo import BudgetSentences

        e = cfg.effort_sentences
        return BudgetSentences(generator, e.efforts, e.template.replace("{r}", "{b}"))
    if cfg.agent is None:
        return generator
    from adarl.rollout.agent import AgentGenerator

    return AgentGenerator.from_config(generator, cfg.agent, {p.id: p for p in problems}, cfg.max_new_tokens)


def build_engine(path: str, model: Any, tokenizer: Any, cfg: RolloutConfig, seed: int) -> Any:
    """`Class(model, tokenizer, cfg, seed=seed)` for `rollout.backend: "package.module:Class"`, checked
    against the generator contract (rollout/base.py) and against what the recipe asks of it."""
    import importlib

    from adarl.engines import unsupported
    from adarl.rollout.base import missing_members

    module, _, name = path.partition(":")
    try:
        engine_class = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"rollout.backend {path!r} cannot be loaded ({type(err).__name__}: {err})") from None
    engine = engine_class(model, tokenizer, cfg, seed=seed)
    if missing := missing_members(engine):
        raise ValueError(f"rollout.backend {path!r} does not implement the generator contract "
                         f"(adarl/rollout/base.py): it lacks {', '.join(missing)}")
    if problems := unsupported(path, cfg.needs(), frozenset(engine.capabilities)):
        raise ValueError(problems[0].replace("needs backend: hf", f"needs what {path!r} does not declare"))
    return engine


def build_branching(generator: Any, b: Any) -> Any:
    """`generator` wrapped in the tree sampler `b.policy` names (a `rollout.branching` section)."""
    if b.policy == "latr":
        from adarl.rollout.latr import LatrGenerator

        return LatrGenerator(generator, b.abs_threshold, b.rel_threshold, tuple(b.lookahead), b.suffix_threshold,
                             b.rouge_threshold, b.mix_schedule, b.max_waves, b.edit_threshold,
                             b.rel_test)
    if b.policy == "treepo":
        from adarl.rollout.treepo import TreePOGenerator

        return TreePOGenerator(generator, b.width, b.segment, b.max_depth, (b.repetition_chars, b.repetition_count))
    from adarl.rollout.branching import BranchingGenerator

    return BranchingGenerator(generator, roots=b.roots, top_n=b.top_n, children=b.children, distinct=b.distinct)


def build_scheduler(generator: Any, cfg: SchedulerConfig | None = None) -> Any:
    """The rollout scheduler `cfg.mode` names in front of `generator`: sync or partial
    (rollout/scheduler.py), or async (rollout/async_mode.py)."""
    if cfg is not None and cfg.mode == "async":
        from adarl.rollout.async_mode import AsyncRolloutScheduler

        return AsyncRolloutScheduler(generator, cfg)
    from adarl.rollout.scheduler import RolloutScheduler

    return RolloutScheduler(generator, cfg)
