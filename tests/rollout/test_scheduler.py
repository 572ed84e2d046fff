"""RolloutScheduler (APRIL, algorithms.md §3.1) on the tiny model.

The hf generator's `load_weights` of its own model's weights only moves the policy version, so across these steps the
weights never change: every rollout the scheduler returns, however often it was paused and
continued, must be exactly the rollout generated straight with the same sampling keys, while its
tokens carry the versions of the steps that sampled them.
"""

from __future__ import annotations

import copy
import json
import math
import warnings

import pytest
import torch

from adarl.config import ModelConfig, RolloutConfig
from adarl.models import chat_ids, load_model
from adarl.rollout.base import Weights
from adarl.rollout.hf import HfGenerator, SampleStream
from adarl.rollout.scheduler import RolloutScheduler, SchedulerConfig
from adarl.types import Request, Rollout

SEED = 2
# stop strings on common characters make rows end at very different lengths
CFG = RolloutConfig(max_new_tokens=24, temperature=1.0, stop=["e", "1", " ", "a"])


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_model_dir):
    torch.manual_seed(0)
    return load_model(ModelConfig(path=str(tiny_model_dir)))


@pytest.fixture(scope="module")
def prompt_ids(model_and_tokenizer) -> list[list[int]]:
    tok = model_and_tokenizer[1]
    return [chat_ids(tok, [{"role": "user", "content": t}]) for t in ["What is 12+34?", "Hi", "abc", "x = 7"]]


def step_requests(prompt_ids: list[list[int]], step: int) -> tuple[list[Request], list[Request]]:
    """Two needed groups and three spare ones of 2 rollouts each; prompt ids unique across steps."""
    needed = [Request(f"s{step}-need{i}", prompt_ids[i], 2) for i in range(2)]
    spare = [Request(f"s{step}-spare{i}", prompt_ids[(i + 2) % 4], 2) for i in range(3)]
    return needed, spare


def by_group(rollouts: list[Rollout]) -> dict[str, list[Rollout]]:
    groups: dict[str, list[Rollout]] = {}
    for r in rollouts:
        groups.setdefault(r.prompt_id, []).append(r)
    return groups


def test_sync_mode_is_the_generator(model_and_tokenizer, prompt_ids):
    model, tok = model_and_tokenizer
    needed, spare = step_requests(prompt_ids, 0)
    scheduler = RolloutScheduler(HfGenerator(model, tok, CFG, seed=SEED))
    rollouts = scheduler.run(needed, spare).rollouts
    expected = HfGenerator(model, tok, CFG, seed=SEED).generate(needed)
    assert [r.completion_ids for r in rollouts] == [r.completion_ids for r in expected]
    assert [r.token_versions for r in rollouts] == [[0] * len(r) for r in expected]
    # nothing is kept but the count of group ids handed out (one per request)
    assert scheduler.buffer == [] and scheduler.state_dict() == {"next_id": len(needed), "buffer": []}
    assert scheduler.metrics()["tokens_generated"] == sum(len(r) for r in expected)
    result = scheduler.run(needed, spare)  # groups come back whole, with ids, in request order
    assert [g.group_id for g in result.groups] == [len(needed) + i for i in range(len(needed))]
    assert [g.request.prompt_id for g in result.groups] == [r.prompt_id for r in needed]
    assert result.tokens_spent == sum(len(r) for r in result.rollouts)


@pytest.mark.parametrize("max_age", [1, 3])
def test_partial_rollouts_are_the_straight_rollouts_and_nothing_is_lost(model_and_tokenizer, prompt_ids, max_age):
    model, tok = model_and_tokenizer
    gen = HfGenerator(model, tok, CFG, seed=SEED)
    scheduler = RolloutScheduler(gen, SchedulerConfig(mode="partial", over_provision=2.0, max_age=max_age))
    straight_gen = HfGenerator(model, tok, CFG)
    straight: dict[str, list[Rollout]] = {}
    admitted_rollouts = returned_rollouts = 0
    mixed_versions = reused = overdue = 0
    for step in range(5):
        needed, spare = step_requests(prompt_ids, step)
        # what run() admits: the needed requests, then spares up to ⌈2·2⌉ groups held in all
        admitted = needed + spare[: max(0, math.ceil(2.0 * len(needed)) - len(scheduler.buffer) - len(needed))]
        stream = SampleStream(SEED)
        stream.calls = gen.rng.calls
        keys = iter(stream.new_keys(admitted))
        for req in admitted:
            straight[req.prompt_id] = straight_gen.generate([req], keys=[next(keys) for _ in range(req.n)])
        admitted_rollouts += sum(req.n for req in admitted)

        rollouts = scheduler.run(needed, spare).rollouts
        groups = by_group(rollouts)
        assert len(groups) == len(needed)  # exactly the groups the step needs, each complete
        for pid, group in groups.items():
            assert len(group) == 2
            for r, s in zip(group, straight[pid], strict=True):
                assert r.finish_reason in ("stop", "length")
                assert r.completion_ids == s.completion_ids and r.text == s.text
                torch.testing.assert_close(torch.tensor(r.logprobs), torch.tensor(s.logprobs), atol=1e-5, rtol=0)
                torch.testing.assert_close(torch.tensor(r.entropies), torch.tensor(s.entropies), atol=1e-5, rtol=0)
                versions = r.token_versions
                assert versions is not None and len(versions) == len(r)
                assert versions == sorted(versions) and versions[-1] <= step and r.policy_version == versions[0]
                assert step - versions[0] <= max_age
                mixed_versions += len(set(versions)) > 1
        returned_rollouts += len(rollouts)
        held = sum(len(g.rollouts) for g in scheduler.buffer)
        assert admitted_rollouts == returned_rollouts + held  # nothing is ever discarded

        m = scheduler.metrics()
        assert m["groups_buffered"] == len(scheduler.buffer)
        assert m["partial_rollouts_carried"] == sum(r.finish_reason == "partial" for g in scheduler.buffer
                                                    for r in g.rollouts)
        assert m["partial_age_max"] < max_age  # an overdue group was finished this step
        assert m["token_age_max"] <= max_age
        reused += m["tokens_reused"]
        overdue += m["groups_overdue"]
        gen.load_weights(Weights.of(gen.model))
    assert mixed_versions > 0 and reused > 0  # rollouts really were paused and continued across steps
    if max_age == 1:
        assert overdue > 0


def test_first_step_admits_over_provisioned_groups(model_and_tokenizer, prompt_ids):
    model, tok = model_and_tokenizer
    scheduler = RolloutScheduler(HfGenerator(model, tok, CFG, seed=SEED),
                                 SchedulerConfig(mode="partial", over_provision=2.5))
    needed, spare = step_requests(prompt_ids, 0)
    scheduler.run(needed, spare)
    assert scheduler.next_id == 5  # ⌈2.5 · 2⌉ groups: the 2 needed and 3 spare
    assert len(scheduler.buffer) == 3 and scheduler.metrics()["groups_buffered"] == 3
    assert scheduler.run([], spare).rollouts == []  # nothing needed: nothing generated, nothing admitted
    assert scheduler.next_id == 5


def test_partial_mode_warns_when_rows_exceed_the_decoding_batch(model_and_tokenizer, prompt_ids):
    """Over-provisioned rows past rollout.max_batch would wait, not run alongside the tail: say so, once."""
    model, tok = model_and_tokenizer
    small = CFG.model_copy(update={"max_batch": 4})
    scheduler = RolloutScheduler(HfGenerator(model, tok, small, seed=SEED), SchedulerConfig(mode="partial"))
    needed, spare = step_requests(prompt_ids, 0)
    with pytest.warns(UserWarning, match=r"8 rows requested but rollout.max_batch is 4"):
        scheduler.run(needed, spare)  # 2 needed + 2 spare groups of 2 rows
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scheduler.run(*step_requests(prompt_ids, 1))
        wide = RolloutScheduler(HfGenerator(model, tok, CFG, seed=SEED), SchedulerConfig(mode="partial"))
        wide.run(needed, spare)  # max_batch 64 holds every row: no warning


def test_complete_bypasses_the_buffer(model_and_tokenizer, prompt_ids):
    model, tok = model_and_tokenizer
    scheduler = RolloutScheduler(HfGenerator(model, tok, CFG, seed=SEED), SchedulerConfig(mode="partial"))
    needed, spare = step_requests(prompt_ids, 0)
    scheduler.run(needed, spare)
    held = copy.deepcopy(scheduler.state_dict())
    top_up = scheduler.complete([Request("top-up", prompt_ids[0], 3)]).rollouts
    assert len(top_up) == 3 and all(r.finish_reason != "partial" for r in top_up)
    held["next_id"] += 1  # the top-up's group took the next id; the buffer is untouched
    assert scheduler.state_dict() == held


def test_state_dict_resumes_exactly(model_and_tokenizer, prompt_ids):
    model, tok = model_and_tokenizer
    cfg = SchedulerConfig(mode="partial", max_age=3)
    gen = HfGenerator(model, tok, CFG, seed=SEED)
    scheduler = RolloutScheduler(gen, cfg)

    def steps(sched: RolloutScheduler, first: int, last: int) -> list[list[Rollout]]:
        out = []
        for step in range(first, last):
            out.append(sched.run(*step_requests(prompt_ids, step)).rollouts)
            sched.generator.load_weights(Weights.of(sched.generator.model))
        return out

    steps(scheduler, 0, 2)
    state = json.loads(json.dumps(scheduler.state_dict()))  # plain data: lists, ints, floats, strings
    held = [r for g in state["buffer"] for r in g["rollouts"]]
    assert any(r["finish_reason"] == "partial" and any(s["ids"] for s in r["spans"]) for r in held)
    gen_state = copy.deepcopy(gen.state_dict())
    expected = steps(scheduler, 2, 4)

    restored_gen = HfGenerator(model, tok, CFG, seed=123)
    restored_gen.load_state_dict(gen_state)
    restored = RolloutScheduler(restored_gen, cfg)
    restored.load_state_dict(state)
    got = steps(restored, 2, 4)
    for a, b in zip(got, expected, strict=True):
        assert [(r.prompt_id, r.completion_ids, r.logprobs, r.token_versions) for r in a] == [
            (r.prompt_id, r.completion_ids, r.logprobs, r.token_versions) for r in b]


def test_config_is_validated():
    with pytest.raises(ValueError):
        SchedulerConfig(mode="bogus")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        SchedulerConfig(over_provision=0.5)
    with pytest.raises(ValueError):
        SchedulerConfig(max_ages=2)  # type: ignore[call-arg]
