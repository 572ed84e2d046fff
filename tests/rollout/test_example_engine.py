"""A new generation engine is one module implementing the generator contract (adarl/rollout/base.py):
docs/examples/plain_engine.py, named by import path, samples what adarl's own decoder samples, runs
through the scheduler, and trains."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from adarl.config import ModelConfig, RolloutConfig, load_recipe
from adarl.models import chat_ids, load_model
from adarl.rollout import build_generator, build_scheduler
from adarl.rollout.base import Generator, Weights
from adarl.rollout.hf import HfGenerator
from adarl.rollout.scheduler import SchedulerConfig
from adarl.types import Request

EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"
ENGINE = "plain_engine:PlainSampler"
CFG = RolloutConfig(backend=ENGINE, max_new_tokens=12, temperature=1.0)


@pytest.fixture
def engine_path(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_model_dir):
    return load_model(ModelConfig(path=str(tiny_model_dir)))


def prompts(tok) -> list[list[int]]:
    return [chat_ids(tok, [{"role": "user", "content": q}]) for q in ("What is 2+3?", "Say hi", "Count to 3")]


def test_the_example_engine_is_built_by_import_path_and_decodes_as_adarl_does(engine_path, model_and_tokenizer):
    model, tok = model_and_tokenizer
    engine = build_generator(model, tok, CFG)
    assert type(engine).__name__ == "PlainSampler" and isinstance(engine, Generator)
    requests = [Request(str(i), ids, 1) for i, ids in enumerate(prompts(tok))]
    # greedy decoding is a function of the model alone: the same tokens as the hf decoder's
    ours = engine.generate(requests, greedy=True)
    theirs = HfGenerator(model, tok, CFG.model_copy(update={"backend": "hf"})).generate(requests, greedy=True)
    assert [r.completion_ids for r in ours] == [r.completion_ids for r in theirs]
    assert all(r.finish_reason in ("stop", "length") for r in ours)
    # sampled log-probs are the policy's own: the same as the hf decoder gives the same token
    for a, b in zip(ours, theirs, strict=True):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


def test_the_example_engine_runs_partial_rollouts_through_the_scheduler(engine_path, model_and_tokenizer):
    model, tok = model_and_tokenizer
    engine = build_generator(model, tok, CFG)
    scheduler = build_scheduler(engine, SchedulerConfig(mode="partial", over_provision=1.0, max_age=2))
    first = [Request(str(i), ids, 2) for i, ids in enumerate(prompts(tok))]
    cut = scheduler.run(first, [], max_tokens=10)  # 6 rows of up to 12 tokens: the call stops at 10
    assert cut.tokens_spent <= 10 and not cut.groups
    done = []
    for step in range(1, 10):
        engine.load_weights(Weights.of(model))  # a new policy version, zero-copy: the same module
        assert engine.policy_version == step
        fresh = Request(f"new{step}", prompts(tok)[step % 3], 1)
        groups = scheduler.run([fresh], [], max_tokens=40).groups
        done += [g for g in groups if not g.request.prompt_id.startswith("new")]
        if len(done) == 3:
            break
    assert sorted(g.request.prompt_id for g in done) == ["0", "1", "2"]  # overdue groups finish first
    rollouts = [r for g in done for r in g.rollouts]
    assert all(r.finish_reason in ("stop", "length") for r in rollouts)
    # continued rows carry the versions their tokens were sampled under: older ones from the first call
    assert any(0 in r.token_versions and max(r.token_versions) > 0 for r in rollouts)


def test_a_recipe_trains_with_the_example_engine(engine_path, tiny_model_dir, tmp_path):
    from adarl.train.trainer import Trainer
    from test_train import recipe_data, write_task

    data = recipe_data(tiny_model_dir, write_task(tmp_path), budget={"max_steps": 2, "prompts_per_step": 2},
                       allocate={"name": "fixed", "n": 4},
                       rollout={"backend": ENGINE, "temperature": 1.0, "max_new_tokens": 6},
                       log={"tensorboard": False, "progress": False})
    trainer = Trainer(load_recipe(data=data), tmp_path / "run")
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.run()
    assert type(trainer.generator).__name__ == "PlainSampler" and trainer.generator.policy_version == 2
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["tokens"] > 0 for r in rows)
    moved = any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
    assert moved == any(r["trained_fraction"] > 0 for r in rows)
    recorded = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert recorded["rollout"]["backend"] == ENGINE


def test_an_engine_is_checked_against_the_contract_and_the_recipe(engine_path, model_and_tokenizer, monkeypatch):
    import plain_engine

    model, tok = model_and_tokenizer

    class Incomplete:
        def __init__(self, model, tokenizer, cfg, seed=0):
            self.tokenizer = tokenizer

    monkeypatch.setattr(plain_engine, "Incomplete", Incomplete, raising=False)
    with pytest.raises(ValueError, match="does not implement the generator contract.*new_keys, generate"):
        build_generator(model, tok, RolloutConfig(backend="plain_engine:Incomplete"))
    with pytest.raises(ValueError, match="cannot be loaded"):
        build_generator(model, tok, RolloutConfig(backend="plain_engine:Missing"))
    # EPTree forks at high-entropy tokens: an engine that records no entropies is refused, by name
    trees = RolloutConfig(backend=ENGINE, branching={"policy": "eptree"})
    with pytest.raises(ValueError, match="rollout.branching needs what 'plain_engine:PlainSampler' does not declare"):
        build_generator(model, tok, trees)
    with pytest.raises(ValueError, match="rollout.backend"):
        RolloutConfig(backend="plain engine")  # neither a built-in name nor an import path
