"""Async mode of the RolloutScheduler (AReaL, algorithms.md §3.2) on the tiny model.

A background thread samples from its own copy of the model, ahead of training, within the
staleness bound η; `load_weights` copies the trainer's weights into that copy.
"""

from __future__ import annotations

import copy
import json
import threading
import time

import pytest
import torch

from adarl.config import ModelConfig, RolloutConfig, load_recipe
from adarl.metrics.step import TIMING_KEYS
from adarl.models import chat_ids, load_model
from adarl.rollout import build_scheduler
from adarl.rollout.base import Weights
from adarl.rollout.hf import HfGenerator
from adarl.rollout.scheduler import RolloutScheduler, SchedulerConfig
from adarl.train import checkpoint, loop
from adarl.train.trainer import Trainer
from adarl.types import Request, Rollout
from test_train import recipe_data, scheduled_recipe, tests_on_path, write_task  # noqa: F401  (fixture)

SEED = 2
CFG = RolloutConfig(max_new_tokens=24, temperature=1.0, stop=["e", "1", " ", "a"])


@pytest.fixture
def model_and_tokenizer(tiny_model_dir):
    torch.manual_seed(0)
    return load_model(ModelConfig(path=str(tiny_model_dir)))


@pytest.fixture
def prompts(model_and_tokenizer) -> list[list[int]]:
    tok = model_and_tokenizer[1]
    return [chat_ids(tok, [{"role": "user", "content": t}]) for t in ["What is 12+34?", "Hi", "abc", "x = 7"]]


def requests(prompts: list[list[int]], step: int, n: int = 3) -> tuple[list[Request], list[Request]]:
    """Two needed groups and four spare ones; prompt ids unique across steps."""
    needed = [Request(f"s{step}-need{i}", prompts[i], n) for i in range(2)]
    spare = [Request(f"s{step}-spare{i}", prompts[i % 4], n) for i in range(4)]
    return needed, spare


def train(model: torch.nn.Module, step: int) -> None:
    """What an optimizer step does to the weights: change them in place."""
    gen = torch.Generator().manual_seed(step)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)


def idle(scheduler: RolloutScheduler, timeout: float = 60.0) -> None:
    """Wait until the thread has finished every group it may admit (a long training step)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        with scheduler._cond:
            if not scheduler._busy and all(g.complete for g in scheduler.buffer):
                return
        time.sleep(0.005)
    raise TimeoutError


def no_thread_left() -> bool:
    return not any(t.name == "adarl-rollouts" and t.is_alive() for t in threading.enumerate())


@pytest.mark.parametrize("eta", [1, 2])
def test_staleness_never_exceeds_eta(model_and_tokenizer, prompts, eta):
    model, tok = model_and_tokenizer
    gen = HfGenerator(model, tok, CFG, seed=SEED)
    scheduler = build_scheduler(gen, SchedulerConfig(mode="async", eta=eta, over_provision=3.0))
    seen_max = 0
    enqueued = returned = 0
    try:
        for step in range(6):
            needed, spare = requests(prompts, step)
            before = scheduler.next_id
            rollouts = scheduler.run(needed, spare).rollouts
            enqueued += scheduler.next_id - before
            returned += len(rollouts) // 3
            m = scheduler.metrics()
            assert len(rollouts) == 6 and all(r.finish_reason in ("stop", "length") for r in rollouts)
            for r in rollouts:
                versions = r.token_versions
                assert versions is not None and len(versions) == len(r) == len(r.logprobs)
                assert versions == sorted(versions) and r.policy_version == versions[0]
                assert step - versions[0] <= eta
            ages = [step - v for r in rollouts for v in r.token_versions or []]
            assert m["staleness_max"] == max(ages) <= eta
            assert m["staleness_hist"] == {str(a): ages.count(a) for a in sorted(set(ages))}
            assert m["groups_restarted"] == 0 and m["wait_s"] >= 0.0
            seen_max = max(seen_max, m["staleness_max"])
            # the thread runs ahead while "training", but never admits more than AReaL's capacity
            idle(scheduler)
            assert len(scheduler.buffer) <= eta * 2
            train(model, step)
            gen.load_weights(Weights.of(gen.model))
            worker = scheduler._worker
            assert worker is not None and worker.policy_version == gen.policy_version == step + 1
            assert all(torch.equal(a, b) for a, b in zip(worker.model.parameters(), model.parameters(), strict=True))
            assert scheduler.metrics()["weight_copy_s"] >= 0.0
        assert seen_max == eta  # groups admitted η versions before they were consumed
        held = len(scheduler.buffer) + len(scheduler.queue)
        assert enqueued == returned + held  # nothing dropped
    finally:
        scheduler.close()
    assert no_thread_left()


def test_eta0_tokens_are_the_training_models(model_and_tokenizer, prompts):
    """η = 0: each step's groups are sampled by the copy after the update, as sync would sample them."""
    model, tok = model_and_tokenizer
    gen = HfGenerator(model, tok, CFG, seed=SEED)
    scheduler = build_scheduler(gen, SchedulerConfig(mode="async", eta=0))
    sync = HfGenerator(model, tok, CFG, seed=SEED)
    try:
        for step in range(3):
            needed, spare = requests(prompts, step)
            got = scheduler.run(needed, spare).rollouts
            want = sync.generate(needed)
            assert [(r.prompt_id, r.completion_ids, r.logprobs, r.text) for r in got] == [
                (r.prompt_id, r.completion_ids, r.logprobs, r.text) for r in want]
            assert all(r.token_versions == [step] * len(r) for r in got)
            assert scheduler.queue == [] and scheduler.buffer == []  # η = 0 never runs ahead
            train(model, step)
            gen.load_weights(Weights.of(gen.model))
            sync.load_weights(Weights.of(sync.model))
    finally:
        scheduler.close()


def test_too_stale_groups_are_restarted_not_dropped(model_and_tokenizer, prompts):
    model, tok = model_and_tokenizer
    gen = HfGenerator(model, tok, CFG, seed=SEED)
    scheduler = build_scheduler(gen, SchedulerConfig(mode="async", eta=1, over_provision=2.0))
    try:
        scheduler.run(*requests(prompts, 0))
        idle(scheduler)  # two groups admitted and finished at version 0, waiting
        held = [g.request.prompt_id for g in scheduler.buffer]
        for step in range(3):  # updates with no run between them: those groups become 3 versions old
            train(model, step)
            gen.load_weights(Weights.of(gen.model))
        rollouts = scheduler.run(*requests(prompts, 1)).rollouts
        m = scheduler.metrics()
        assert [r.prompt_id for r in rollouts[::3]] == held  # the same groups, first in first out
        assert m["groups_restarted"] == 2 and m["tokens_discarded"] > 0
        assert m["staleness_max"] <= 1
    finally:
        scheduler.close()


def test_state_dict_pauses_and_resume_loses_nothing(model_and_tokenizer, prompts):
    model, tok = model_and_tokenizer
    gen = HfGenerator(model, tok, CFG, seed=SEED)
    cfg = SchedulerConfig(mode="async", eta=2, over_provision=3.0)
    scheduler = build_scheduler(gen, cfg)
    for step in range(2):
        scheduler.run(*requests(prompts, step, n=6))
        train(model, step)
        gen.load_weights(Weights.of(gen.model))
    state = json.loads(json.dumps(scheduler.state_dict()))  # taken while the thread runs ahead
    gen_state = copy.deepcopy(gen.state_dict())
    scheduler.close()
    assert no_thread_left()
    saved = state["buffer"] + state["queue"]
    assert len(saved) == 4 and [g["id"] for g in saved] == sorted(g["id"] for g in saved)

    restored_gen = HfGenerator(model, tok, CFG, seed=123)
    restored_gen.load_state_dict(gen_state)
    restored = build_scheduler(restored_gen, cfg)
    restored.load_state_dict(state)
    got: list[Rollout] = []
    try:
        for step in range(2, 4):
            got += restored.run(*requests(prompts, step, n=6)).rollouts
            if step == 2:  # tokens sampled before the checkpoint but not yet reported count now
                assert restored.metrics()["tokens_generated"] >= state["tokens"]
            train(model, step)
            restored_gen.load_weights(Weights.of(restored_gen.model))
    finally:
        restored.close()
    # the saved groups come back first, in order, each rollout continued from its saved tokens
    assert [r.prompt_id for r in got[::6]] == [g["request"]["prompt_id"] for g in saved]
    for g in saved:
        for r, saved_r in zip([r for r in got if r.prompt_id == g["request"]["prompt_id"]], g["rollouts"], strict=True):
            old = Rollout.from_state(saved_r)
            n = len(old.completion_ids)
            assert r.completion_ids[:n] == old.completion_ids and r.logprobs[:n] == old.logprobs
            assert r.token_versions[:n] == old.token_versions  # type: ignore[index]


def test_thread_errors_surface_and_the_thread_stops(model_and_tokenizer, prompts):
    model, tok = model_and_tokenizer
    scheduler = build_scheduler(HfGenerator(model, tok, CFG, seed=SEED), SchedulerConfig(mode="async"))
    scheduler._start()
    assert scheduler._worker is not None

    def boom(*args, **kwargs):
        raise ValueError("out of memory, say")

    scheduler._worker.generate = boom  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="generation thread failed"):
        scheduler.run(*requests(prompts, 0))
    scheduler.close()
    assert no_thread_left()


def _rows(run) -> list[dict]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS and not k.startswith("rollout/")} for r in rows]


def test_eta0_reproduces_sync_training(tiny_model_dir, tmp_path, tests_on_path):  # noqa: F811
    """Same tokens, rewards, metrics and weights after N steps: async with η = 0 is synchronous RL."""
    common = dict(budget={"max_steps": 3, "prompts_per_step": 3}, loss={"name": "decoupled_ppo"})
    sync = recipe_data(tiny_model_dir, write_task(tmp_path), **common)
    asyn = recipe_data(tiny_model_dir, write_task(tmp_path), **common, rollout={
        "temperature": 1.0, "max_new_tokens": 8, "scheduler": {"mode": "async", "eta": 0, "over_provision": 1.0}})
    a, b = Trainer(load_recipe(data=sync), tmp_path / "sync"), Trainer(load_recipe(data=asyn), tmp_path / "async")
    a.run()
    b.run()
    assert no_thread_left()
    rows_a, rows_b = _rows(tmp_path / "sync"), _rows(tmp_path / "async")
    assert len(rows_a) == 3 and rows_a == rows_b
    raw = [json.loads(x) for x in (tmp_path / "async" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["rollout/staleness_max"] == 0 and "rollout/wait_s" in r for r in raw)
    for (ka, va), (kb, vb) in zip(a.model.state_dict().items(), b.model.state_dict().items(), strict=True):
        assert ka == kb and torch.equal(va, vb), ka


def test_async_trains_and_resumes_with_its_work(tiny_model_dir, tmp_path, tests_on_path):  # noqa: F811
    """η = 1 end to end; the checkpoint holds the unconsumed groups and the resumed run trains them next."""
    data = scheduled_recipe(tiny_model_dir, write_task(tmp_path), {"mode": "async", "eta": 1, "over_provision": 2.0},
                            max_steps=2)
    first = Trainer(load_recipe(data=data), tmp_path / "run")
    first.run()
    assert first.rollouts._thread is None and no_thread_left()
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["groups"] == 2 and r["rollout/staleness_max"] <= 1 for r in rows)
    _, state = checkpoint.load(checkpoint.latest(tmp_path / "run" / "checkpoints"), copy.deepcopy(first.model))
    saved = state["rollout_scheduler"]
    held = saved["buffer"] + saved["queue"]
    assert len(held) == 2  # η·B groups ran ahead of the last step

    resumed = Trainer(load_recipe(data={**data, "budget": {"max_steps": 3, "prompts_per_step": 2}}), tmp_path / "run")
    try:
        assert loop.resume_from_checkpoint(resumed)
        metrics = resumed.train_step()
    finally:
        resumed.rollouts.close()
    assert [g.problem.id for g in resumed.last_groups] == [g["request"]["prompt_id"] for g in held]
    for group, g in zip(resumed.last_groups, held, strict=True):
        for r, old in zip(group.rollouts, g["rollouts"], strict=True):
            old_ids = Rollout.from_state(old).completion_ids
            assert r.completion_ids[: len(old_ids)] == old_ids
    assert metrics["rollout/staleness_max"] <= 1


def test_the_thread_stops_when_training_fails(tiny_model_dir, tmp_path, tests_on_path):  # noqa: F811
    data = recipe_data(tiny_model_dir, write_task(tmp_path), budget={"max_steps": 3, "prompts_per_step": 2},
                       rollout={"temperature": 1.0, "max_new_tokens": 8, "scheduler": {"mode": "async", "eta": 2}})
    trainer = Trainer(load_recipe(data=data), tmp_path / "run")

    def boom(*args, **kwargs):
        raise KeyboardInterrupt

    trainer.learner.update = boom  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        trainer.run()
    assert trainer.rollouts._thread is None and no_thread_left()
