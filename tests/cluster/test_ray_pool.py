"""Rollout workers on a real local Ray cluster (cluster/ray_pool.py), on this machine's 2 CPUs, loopback only.

What must hold: the pool samples the in-process generator's tokens (keys are drawn in the driver and
sampling is keyed per row); a weight broadcast reaches every worker with its version; a worker
SIGKILLed mid-call or SIGSTOPped (hung) is replaced and its requests re-issued, so the call returns
exactly what a fault-free call returns; a trainer on the pool sees the in-process trainer's groups; a
run SIGKILLed mid-step resumes on the pool to the uninterrupted run's weights.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'adarl[ray]')")

from adarl.cluster import start_private  # noqa: E402
from adarl.cluster.ray_pool import RayRolloutPool  # noqa: E402
from adarl.config import ClusterConfig, ModelConfig, RolloutConfig, load_recipe  # noqa: E402
from adarl.models import load_model  # noqa: E402
from adarl.rollout.base import Weights  # noqa: E402
from adarl.rollout.hf import HfGenerator  # noqa: E402
from adarl.train.trainer import Trainer  # noqa: E402
from adarl.types import Request  # noqa: E402
from test_resume_components import rows  # noqa: E402
from test_train import recipe_data, tests_on_path, write_task  # noqa: E402,F401

ROOT = Path(__file__).resolve().parents[2]
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


@pytest.fixture(scope="module")
def local_ray():
    """One private Ray for the module's pools (each pool would otherwise start and stop its own)."""
    start_private(num_cpus=2)  # loopback only, as a run's private cluster
    yield
    ray.shutdown()


@pytest.fixture
def model(tiny_model_dir):
    return load_model(ModelConfig(path=str(tiny_model_dir), threads=1), for_training=True)


def requests(tok, n_prompts=6, n=3):
    return [Request(f"p{i}", tok.encode(f"Say {i} and {i * 7}"), n) for i in range(n_prompts)]


def pool_of(model, cfg, workers=2, **cluster):
    return RayRolloutPool(*model, cfg, ClusterConfig(backend="ray", workers=workers, **cluster), seed=11)


def assert_same_rollouts(ours, theirs, prefix_only=False):
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs, strict=True):
        assert a.prompt_id == b.prompt_id
        if prefix_only:  # a call stopped early returns the start of the straight rollout
            assert b.completion_ids[: len(a)] == a.completion_ids
            b_lp = b.logprobs[: len(a)]
        else:
            assert a.completion_ids == b.completion_ids and a.finish_reason == b.finish_reason
            b_lp = b.logprobs
        np.testing.assert_allclose(a.logprobs, b_lp, atol=1e-5)  # batch composition moves float rounding only


def test_pool_samples_the_in_process_tokens_whole_and_in_rounds(local_ray, model):
    cfg = RolloutConfig(backend="hf", max_new_tokens=20, max_batch=4)
    straight = HfGenerator(*model, cfg, seed=11).generate(requests(model[1]))
    pool = pool_of(model, cfg, round_tokens=3)
    try:
        assert_same_rollouts(pool.generate(requests(model[1])), straight)
        # rounds of 3 decoding steps, every unfinished row continued from prompt + its tokens: the same rollouts
        pool.rng.set_state({"seed": 11, "calls": 0})
        calls = []
        assert_same_rollouts(pool.generate(requests(model[1]), stop_when=lambda p: calls.append(p.tokens) and False),
                             straight)
        assert len(calls) >= 20 // 3  # stop_when was asked between rounds, not once
        # stopped once 2 groups are complete: those 2 are whole, the rest are the start of theirs
        pool.rng.set_state({"seed": 11, "calls": 0})
        early = pool.generate(requests(model[1]), stop_when=lambda p: p.groups_finished >= 2)
        assert_same_rollouts(early, straight, prefix_only=True)
        done = [all(r.finish_reason != "partial" for r in early[i * 3:(i + 1) * 3]) for i in range(6)]
        assert sum(done) >= 2 and any(r.finish_reason == "partial" for r in early)
        assert sum(len(r) for r in early) < sum(len(r) for r in straight)
        # greedy decoding (evaluation) draws no keys and moves no stream
        state = pool.rng.get_state()
        assert_same_rollouts(pool.generate(requests(model[1]), greedy=True),
                             HfGenerator(*model, cfg).generate(requests(model[1]), greedy=True))
        assert pool.rng.get_state() == state
    finally:
        pool.close()


def test_token_budget_is_shared_and_never_passed(local_ray, model):
    cfg = RolloutConfig(backend="hf", max_new_tokens=20, max_batch=8)
    pool = pool_of(model, cfg)
    try:
        out = pool.generate(requests(model[1]), max_tokens=100)
        assert 0 < sum(len(r) for r in out) <= 100
        assert any(r.finish_reason == "partial" for r in out)
    finally:
        pool.close()


def greedy_across_a_push(pool, model, hf_cfg):
    """The pool's greedy rollouts before and after a weight broadcast, and the in-process hf decoder's
    after it; the "update" multiplies every weight by 1.5, which changes what greedy decoding writes."""
    before = pool.generate(requests(model[1]), greedy=True)
    with torch.no_grad():
        for p in model[0].parameters():
            p.mul_(1.5)
    pool.load_weights(Weights.of(pool.model))
    after = pool.generate(requests(model[1]), greedy=True)
    return before, after, HfGenerator(*model, hf_cfg).generate(requests(model[1]), greedy=True)


def test_weight_broadcast_reaches_every_worker_with_its_version(local_ray, model):
    cfg = RolloutConfig(backend="hf", max_new_tokens=12)
    pool = pool_of(model, cfg)
    try:
        before, after, expected = greedy_across_a_push(pool, model, cfg)
        assert_same_rollouts(after, expected)
        assert [r.completion_ids for r in after] != [r.completion_ids for r in before]
        assert pool.policy_version == 1 and all(r.token_versions == [1] * len(r) for r in after)
        m = pool.pool_metrics()
        assert m["cluster/broadcast_mb"] > 0 and 0 < m["cluster/broadcast_fraction"] <= 1 and m["cluster/workers"] == 2
    finally:
        pool.close()


def test_vllm_workers_sample_greedy_as_hf_and_take_the_broadcast(local_ray, model):
    """vLLM is in the default install, so `auto` gives Ray workers vLLM engines: a worker's engine
    decodes greedily as the in-process hf decoder, before and after a weight broadcast."""
    pytest.importorskip("vllm", reason="vLLM is not installed")
    cfg = RolloutConfig(backend="vllm", max_new_tokens=12, vllm={"kv_cache_gib": 0.25})
    hf = RolloutConfig(backend="hf", max_new_tokens=12)
    pool = pool_of(model, cfg, workers=1)
    try:
        hf_before = HfGenerator(*model, hf).generate(requests(model[1]), greedy=True)
        before, after, expected = greedy_across_a_push(pool, model, hf)
        assert [r.completion_ids for r in before] == [r.completion_ids for r in hf_before]
        assert [r.completion_ids for r in after] == [r.completion_ids for r in expected]
        assert [r.completion_ids for r in after] != [r.completion_ids for r in before]
    finally:
        pool.close()


def test_a_worker_killed_mid_call_is_replaced_and_nothing_is_lost(local_ray, model):
    # 64 rows of up to 400 tokens: a worker's 32 rows take a few hundred decoding steps (the longest of 32
    # geometric lengths), so the kill lands inside the call
    cfg = RolloutConfig(backend="hf", max_new_tokens=400, max_batch=32)
    long = [Request(f"q{i}", model[1].encode(f"Count {i}"), 8) for i in range(8)]
    straight = HfGenerator(*model, cfg, seed=11).generate(long)
    pool = pool_of(model, cfg)
    try:
        victim = pool.worker_pids()[0]

        def kill_when_busy():
            deadline = time.perf_counter() + 60
            while not pool._beats().get(0) and time.perf_counter() < deadline:  # until worker 0 is decoding
                time.sleep(0.02)
            os.kill(victim, signal.SIGKILL)

        killer = threading.Thread(target=kill_when_busy)
        killer.start()
        out = pool.generate(long)
        killer.join()
        assert_same_rollouts(out, straight)
        m = pool.pool_metrics()
        assert m["cluster/workers_lost"] == 1 and m["cluster/workers_replaced"] == 1
        assert m["cluster/requests_reissued"] >= 1
        assert victim not in pool.worker_pids()
    finally:
        pool.close()


def test_a_hung_worker_fails_its_health_check_and_is_replaced(local_ray, model):
    cfg = RolloutConfig(backend="hf", max_new_tokens=16)
    straight = HfGenerator(*model, cfg, seed=11).generate(requests(model[1]))
    pool = pool_of(model, cfg, check_every_s=1.0, health_timeout_s=3.0)
    try:
        hung = pool.worker_pids()[1]
        os.kill(hung, signal.SIGSTOP)  # alive to the OS, answers nothing
        out = pool.generate(requests(model[1]))
        assert_same_rollouts(out, straight)
        m = pool.pool_metrics()
        assert m["cluster/workers_replaced"] == 1 and m["cluster/health_checks_failed"] == 1
        assert hung not in pool.worker_pids()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(hung, signal.SIGKILL)
        pool.close()


def _recipe(model_dir, task, **over):
    return recipe_data(model_dir, task, budget={"max_steps": 4, "prompts_per_step": 3}, checkpoint={"every": 2},
                       log={"tensorboard": False, "progress": False}, **over)


RAY = {"cluster": {"backend": "ray", "workers": 2}}


@pytest.mark.usefixtures("local_ray", "tests_on_path")
def test_a_trainer_on_the_pool_trains_on_the_in_process_groups(tiny_model_dir, tmp_path):
    task = write_task(tmp_path)
    local = Trainer(load_recipe(data=_recipe(tiny_model_dir, task)), tmp_path / "local")
    cluster = {"backend": "ray", "workers": 2, "resources": {"num_cpus": 0.5, "threads": 1},
               "verifiers": 1, "verifier_cpus": 0.5}  # rewards scored on a verifier actor too
    # the same objective on both sides: Ray workers are not the learner's forward, so the pool would weigh by
    # π_old/π_beh (train.mismatch, on by default there) where the in-process hf run does not
    pooled = Trainer(load_recipe(data=_recipe(tiny_model_dir, task, cluster=cluster,
                                              train={"mismatch": {"correct": False}})), tmp_path / "ray")
    try:
        for _ in range(3):
            a, b = local.train_step(), pooled.train_step()
            assert [[r.completion_ids for r in g.rollouts] for g in local.last_groups] == \
                   [[r.completion_ids for r in g.rollouts] for g in pooled.last_groups]
            assert a["reward"] == b["reward"] and a["tokens"] == b["tokens"]
            assert b["cluster/workers"] == 2 and b["cluster/workers_lost"] == 0
        for p, q in zip(local.model.parameters(), pooled.model.parameters(), strict=True):
            torch.testing.assert_close(p, q, atol=1e-4, rtol=0)  # behaviour log-probs differ in rounding only
    finally:
        pooled.generator.close()
        pooled.rewards.close()


@pytest.mark.usefixtures("local_ray", "tests_on_path")
def test_a_run_killed_mid_step_resumes_on_the_pool(tiny_model_dir, tmp_path, warm_python):
    tests = Path(__file__).parents[1]
    task = write_task(tmp_path)
    straight = Trainer(load_recipe(data=_recipe(tiny_model_dir, task, **RAY)), tmp_path / "straight")
    try:
        straight.run()
    finally:
        straight.generator.close()
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(_recipe(tiny_model_dir, task, **RAY)))
    env = {**os.environ, "PYTHONPATH": str(tests), "OMP_NUM_THREADS": "1", "ADARL_TEST_KILL": "generate@3+0.2"}
    killed = warm_python.run_module("adarl.cli", ["train", str(recipe), "--run-dir", str(tmp_path / "split")],
                                    env=env, cwd=ROOT, timeout=300)  # a process of its own, forked warm
    assert killed.returncode == -9, killed.stdout  # SIGKILLed inside step 3's generation, on the pool
    resumed = Trainer(load_recipe(tmp_path / "split" / "config.yaml"), tmp_path / "split")
    try:
        resumed.run(resume=True)
    finally:
        resumed.generator.close()
    for (name, a), b in zip(straight.model.named_parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b), name
    assert rows(tmp_path / "straight") == rows(tmp_path / "split")


@pytest.mark.usefixtures("local_ray", "tests_on_path")
@pytest.mark.parametrize("rollout", [
    {"scheduler": {"mode": "partial", "over_provision": 2.0}},
    {"scheduler": {"mode": "async", "eta": 1, "over_provision": 2.0}},
    {"agent": {"max_turns": 2}},
], ids=["partial", "async", "agent"])
def test_every_scheduler_mode_and_the_agent_loop_run_on_the_pool(rollout, tiny_model_dir, tmp_path):
    data = _recipe(tiny_model_dir, write_task(tmp_path), loss={"name": "decoupled_ppo"},
                   rollout={"temperature": 1.0, "max_new_tokens": 24, **rollout},
                   cluster={"backend": "ray", "workers": 2, "round_tokens": 4})
    data["budget"]["max_steps"] = 3
    trainer = Trainer(load_recipe(data=data), tmp_path / "run")
    try:
        out = [trainer.train_step() for _ in range(3)]
    finally:
        trainer.rollouts.close()
        trainer.generator.close()
    assert all(r["groups"] == 3 and r["cluster/workers_lost"] == 0 for r in out)
    # each step pays for the tokens that reached it: the budget equals what the scheduler reported
    assert [r["step_tokens"] for r in out] == [r["rollout/tokens_generated"] for r in out]
    if "async" in str(rollout):
        assert all(r["rollout/staleness_max"] <= 1 for r in out)  # η holds across workers
        assert max(r["rollout/staleness_max"] for r in out) == 1  # the thread ran ahead: older tokens trained
    if "partial" in str(rollout):
        assert sum(r["rollout/tokens_reused"] for r in out) > 0  # rows paused in one step finished in a later one
    versions = {v for g in trainer.last_groups for r in g.rollouts for v in r.token_versions}
    assert versions <= {0, 1, 2} and max(versions) >= 1  # stamped by the workers with the weights they held


@pytest.mark.usefixtures("local_ray", "tests_on_path")
def test_sapo_trainers_train_on_each_others_groups_scored_by_themselves(tiny_model_dir, tmp_path):
    data = _recipe(tiny_model_dir, write_task(tmp_path), loss={"name": "decoupled_ppo"},
                   cluster={"sapo": {"swarm": "pair", "share": 1.0, "take": 2}})
    a = Trainer(load_recipe(data={**data, "seed": 1}), tmp_path / "a")
    b = Trainer(load_recipe(data={**data, "seed": 2}), tmp_path / "b")
    trained = []
    update = b.learner.update
    b.learner.update = lambda batch, weights=None: trained.append(batch) or update(batch, weights)
    try:
        ra = a.train_step()
        assert ra["sapo/published"] == 3 and ra["sapo/taken"] == 0  # nobody had published yet
        rb = b.train_step()
        assert rb["sapo/published"] == 3 and rb["sapo/taken"] == 2 and rb["sapo/rejected"] == 0
        foreign = trained[0].groups[-2:]  # the newest two of A's groups, after B's own three
        assert [[r.completion_ids for r in g.rollouts] for g in foreign] == \
               [[r.completion_ids for r in g.rollouts] for g in reversed(a.last_groups[-2:])]
        for g in foreign:  # scored by B's own reward on the decoded tokens: the share of 'a' characters
            texts = [b.tokenizer.decode(r.completion_ids, skip_special_tokens=True) for r in g.rollouts]
            np.testing.assert_allclose(g.reward, [t.count("a") / max(len(t), 1) for t in texts])
        # B's budget paid for its own tokens only; its difficulty store saw only its own prompts
        own = sum(len(r) for g in b.last_groups for r in g.rollouts)
        assert rb["step_tokens"] == own
        # the effective fraction is over every token trained, foreign ones included (it was over own ones: > 1)
        effective = sum(len(r) for r, a in zip(trained[0].rollouts, trained[0].advantages, strict=True) if a)
        assert rb["effective_token_fraction"] == pytest.approx(
            effective / (own + sum(len(r) for g in foreign for r in g.rollouts)))
        assert b.store.state_dict() is not None and len(b.last_groups) == 3
        ra2 = a.train_step()
        assert ra2["sapo/taken"] == 2  # and A now trains on B's
    finally:
        a.peers.close()
        b.peers.close()


@pytest.mark.usefixtures("local_ray")
def test_sapo_rejects_malformed_foreign_groups_and_never_trusts_their_text(model):
    from adarl.cluster.sapo import Swarm, _payload
    from adarl.config import RewardConfig, SapoConfig
    from adarl.rewards import Rewards
    from adarl.types import Group, Problem, Rollout

    tok = model[1]
    sender = Swarm(SapoConfig(swarm="hostile", take=0), tok, max_new_tokens=8)
    receiver = Swarm(SapoConfig(swarm="hostile", take=10), tok, max_new_tokens=8)
    a_id, b_id = tok.convert_tokens_to_ids("a"), tok.convert_tokens_to_ids("b")
    liar = Rollout("q", [b_id, b_id], [-1.0, -1.0], "stop", text="aaaa")  # its text claims what its tokens are not
    groups = [
        Group(Problem("q", "say a", "a"), [a_id], [liar]),
        Group(Problem("q", "say a", "a"), [a_id], [Rollout("q", [len(tok) + 5], [-1.0], "stop")]),  # not a token
        Group(Problem("q", "say a", "a"), [a_id], [Rollout("q", [a_id], [0.5], "stop")]),  # log-prob > 0
        Group(Problem("q", "say a", "a"), [a_id], [Rollout("q", [a_id] * 9, [-1.0] * 9, "stop")]),  # too long
    ]
    ray.get(sender.queue.publish.remote(sender.node, sender.vocab, [_payload(g) for g in groups]))
    ray.get(sender.queue.publish.remote(sender.node, "another-vocabulary", [_payload(groups[0])]))
    rewards = Rewards([RewardConfig(type="callable", function="e2e_rewards:fraction_of_a")], workers=1)
    try:
        sys.path.insert(0, str(Path(__file__).parents[1]))
        foreign, m = receiver.exchange([], rewards)
    finally:
        rewards.close()
        sys.path.remove(str(Path(__file__).parents[1]))
    assert m["sapo/taken"] == 1 and m["sapo/rejected"] == 4
    assert foreign[0].rollouts[0].text == "bb" and foreign[0].reward.tolist() == [0.0]  # scored on "bb", not "aaaa"


@pytest.mark.usefixtures("local_ray", "tests_on_path")
def test_verifier_actors_score_as_the_local_pool_and_survive_a_dead_actor(model):
    from adarl.cluster.verifiers import RayRewards
    from adarl.config import RewardConfig
    from adarl.rewards import Rewards
    from adarl.types import Group, Problem

    cfg = RolloutConfig(backend="hf", max_new_tokens=12)
    out = HfGenerator(*model, cfg, seed=11).generate(requests(model[1], n_prompts=5, n=3))
    configs = [RewardConfig(type="callable", function="e2e_rewards:fraction_of_a"),
               RewardConfig(type="short_answer", weight=0.5)]

    def groups():
        return [Group(Problem(f"p{i}", f"Say {i}", str(i)), [1], out[3 * i: 3 * i + 3]) for i in range(5)]

    local, here = Rewards(configs, workers=1), groups()
    remote, there = RayRewards(configs, verifiers=2, workers=1, timeout_s=10.0, num_cpus=0.25), groups()
    try:
        expected = local.score(here)
        got = remote.score(there)
        for a, b in zip(here, there, strict=True):
            np.testing.assert_array_equal(a.rewards, b.rewards)
            np.testing.assert_array_equal(a.correct, b.correct)
            assert a.reward_names == b.reward_names
        assert {k: v for k, v in got.items() if k != "verify_s"} == \
               pytest.approx({k: v for k, v in expected.items() if k != "verify_s"})
        pid = ray.get(remote.actors[0].__ray_call__.remote(lambda self: os.getpid()))
        os.kill(pid, signal.SIGKILL)  # Ray restarts the actor and retries its call: scoring is idempotent
        again = groups()
        remote.score(again)
        for a, b in zip(here, again, strict=True):
            np.testing.assert_array_equal(a.rewards, b.rewards)
    finally:
        local.close()
        remote.close()
