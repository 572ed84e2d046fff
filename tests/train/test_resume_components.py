"""Every registered component resumes exactly: N steps straight == N/2, SIGKILL, resume, N.

The recipes below use every registered selector, allocator, shaping, estimator, token weighting
and loss at least once (`test_the_walk_covers_every_component` keeps it so). Each runs 4 steps
straight in-process; then the same recipe runs in a subprocess that is SIGKILLed on entering
step 3's generation (after the step-2 checkpoint), and a fresh trainer resumes it. Weights,
metrics rows and every component's state must be identical.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from adarl import registry
from adarl.config import load_recipe
from adarl.metrics.step import TIMING_KEYS
from adarl.train.loop import state_of
from adarl.train.trainer import Trainer
from test_train import recipe_data, write_task

ROOT = Path(__file__).resolve().parents[2]
ZOO = {"rollout": {"temperature": 1.0, "max_new_tokens": 8}}
WALK = {
    "uniform+fixed+rloo+overlong+e1+d3s+overlong_filter+hapo": dict(
        select={"name": "uniform"}, allocate={"name": "fixed", "n": 4}, advantage={"name": "rloo"},
        shaping=[{"name": "overlong", "buffer": 4}, {"name": "e1"}],
        tokens=[{"name": "d3s", "f0": 0.5}, {"name": "overlong_filter"}],
        loss={"name": "hapo"},
        rollout={"temperature": 1.0, "max_new_tokens": 8, "effort_sentences": {"efforts": [0.5, 1.0]}}),
    "vade+dars+reinforce_pp+length+high_entropy+bapo": dict(
        select={"name": "vade"}, allocate={"name": "dars", "n": 4, "n_max": 8}, advantage={"name": "reinforce_pp"},
        shaping=[{"name": "length_penalty", "only_correct": False}], tokens=[{"name": "high_entropy", "top": 0.5}],
        loss={"name": "bapo"}, train={"lr": 0.02, "micro_batch_tokens": 64, "mini_batches": 2}),
    "gdro+xrpo+xrpo+gspo": dict(
        select={"name": "gdro", "k": 4}, allocate={"name": "xrpo", "n": 4}, advantage={"name": "xrpo"},
        loss={"name": "gspo", "entropy_coef": 0.01}),
    "curriculum+dapo+hapo+aepo+adaptive_temperature": dict(
        select={"name": "curriculum"}, allocate={"name": "dapo", "n": 4, "max_batches": 2},
        advantage={"name": "hapo"}, loss={"name": "aepo"},
        rollout={"temperature": 1.0, "max_new_tokens": 8, "adaptive_temperature": {"tau": 0.05}}),
    "uniform+gdro+rdpo_ema+hbpo+kl": dict(
        allocate={"name": "gdro", "n_mean": 4}, advantage={"name": "rdpo", "covariance": "ema"},
        shaping=[{"name": "hbpo", "max_len": 8}], loss={"name": "ppo_clip", "kl_coef": 0.01, "kl": "k2"}),
    "vade+roc_stochastic+hbpo+fapo": dict(
        select={"name": "vade"}, allocate={"name": "roc", "n": 4, "sampling": "stochastic"},
        advantage={"name": "hbpo", "max_len": 8},
        shaping=[{"name": "hbpo", "max_len": 8},
                 {"name": "fapo", "judge": "shaping_judges:flawed_if_marked", "workers": 1}]),
    "gdro+brorl+grpo+decoupled_partial": dict(
        select={"name": "gdro", "k": 4}, allocate={"name": "brorl", "n": 6}, loss={"name": "decoupled_ppo"},
        rollout={"temperature": 1.0, "max_new_tokens": 8,
                 "scheduler": {"mode": "partial", "over_provision": 2.0}}),
    "vade+pilot_commit": dict(  # the buffer (pilot groups of earlier steps) crosses checkpoints
        select={"name": "vade"}, allocate={"name": "pilot_commit", "pilot_n": 2, "commit_n": 2, "p_lo": 0.0,
                                           "p_up": 0.0, "gen_multiplier": 2}),
    "curriculum+fixed+drgrpo+epochs2": dict(
        select={"name": "curriculum"}, advantage={"name": "drgrpo"},
        train={"lr": 0.02, "micro_batch_tokens": 64, "epochs": 2}),
    # trees, tree credit, hints and distillation: forks, prunes, IRT fits and an EMA teacher cross checkpoints
    "eptree+treerl+guide": dict(
        rollout={"temperature": 1.0, "max_new_tokens": 8, "branching": {"policy": "eptree", "roots": 1}},
        advantage={"name": "treerl"}, hints={"name": "guide", "source": "answer"}),
    "latr+polychromic+seele+sdar_snapshot": dict(
        rollout={"temperature": 1.0, "max_new_tokens": 8,
                 "branching": {"policy": "latr", "lookahead": [2, 3], "abs_threshold": 0.0, "rel_threshold": 1.0,
                               "rel_test": "below"}},
        advantage={"name": "polychromic", "n": 2, "subsets": 4},
        hints={"name": "seele", "source": "answer", "rounds": 2, "per_round": 2},
        distill={"method": "sdar", "teacher": "snapshot"}),
    "treepo+treepo+adhint+aopd_ema": dict(
        rollout={"temperature": 1.0, "max_new_tokens": 8, "branching": {"policy": "treepo", "segment": 3}},
        advantage={"name": "treepo"}, hints={"name": "adhint", "source": "answer"},
        distill={"method": "aopd", "teacher": "ema", "top_k": 4}),
    "adhint_advantage": dict(advantage={"name": "adhint"}, hints={"name": "adhint", "source": "answer"}),
    # the logistic fit (coefficients and covariance) crosses checkpoints; the run totals with the rows
    "feature_prior+dars": dict(select={"name": "feature_prior"}, allocate={"name": "dars", "n": 4, "n_max": 8}),
    # issue 54: per-prompt records (knapsack), skip streaks and adapted probabilities (greso), a GP prior
    # carried across steps (vip reuse_mean), and rounds within a step (reinforce_ada)
    "greso+knapsack": dict(select={"name": "greso"}, allocate={"name": "knapsack", "n": 4, "min_buffer_length": 2}),
    "reinforce_ada": dict(allocate={"name": "reinforce_ada", "n": 2, "round_n": 2, "max_rounds": 2,
                                    "global_stats": True}),
    "vip_reuse_mean": dict(allocate={"name": "vip", "n": 4, "n_min": 2, "n_max": 8, "reuse_mean": True}),
    # contains_a: some groups are solved (the exemplar pool fills), others all fail (they are seeded)
    "xrpo_seeding": dict(rewards=[{"type": "callable", "function": "e2e_rewards:contains_a"}],
                         hints={"name": "xrpo", "k": 1}),
}


def _recipe(model: Path, task: Path, name: str, steps: int) -> dict:
    data = recipe_data(model, task, budget={"max_steps": steps, "prompts_per_step": 3}, checkpoint={"every": 2},
                       log={"tensorboard": False, "progress": False}, **ZOO)
    data.update(WALK[name])
    return data


def assert_same(a, b, where: str = "state") -> None:
    if isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), where
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, np.ndarray):
        np.testing.assert_array_equal(a, b, err_msg=where)
    else:
        assert a == b or (a != a and b != b), f"{where}: {a!r} != {b!r}"


def rows(run: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(x).items() if k not in TIMING_KEYS}
            for x in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("name", list(WALK))
def test_component_state_resumes_exactly(name, tiny_model_dir, tmp_path, monkeypatch, warm_python):
    tests = Path(__file__).parents[1]
    monkeypatch.syspath_prepend(str(tests))
    task = write_task(tmp_path)
    straight = Trainer(load_recipe(data=_recipe(tiny_model_dir, task, name, 4)), tmp_path / "straight")
    straight.run()

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(_recipe(tiny_model_dir, task, name, 4)))
    # this checkout's src first: an editable install of another checkout must not answer the subprocess
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(tests)]), "OMP_NUM_THREADS": "1",
           "ADARL_TEST_KILL": "generate@3"}
    killed = warm_python.run_module("adarl.cli", ["train", str(recipe), "--run-dir", str(tmp_path / "split")],
                                    env=env, cwd=ROOT, timeout=300)  # a process of its own, forked warm
    assert killed.returncode == -9, killed.stdout  # SIGKILL on entering step 3's generation
    resumed = Trainer(load_recipe(tmp_path / "split" / "config.yaml"), tmp_path / "split")
    resumed.run(resume=True)

    for (param, a), b in zip(straight.model.named_parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b), param
    assert rows(tmp_path / "straight") == rows(tmp_path / "split")
    ours, theirs = state_of(straight), state_of(resumed)
    assert_same(ours["components"], theirs["components"], "components")
    assert_same(ours["store"], theirs["store"], "store")
    assert_same(ours["generator"], theirs["generator"], "generator")


def test_the_walk_covers_every_component():
    used = {(stage, combo[stage]["name"]) for combo in WALK.values()
            for stage in ("select", "allocate", "advantage", "loss", "hints") if stage in combo}
    used |= {(stage, spec["name"]) for combo in WALK.values() for stage in ("shaping", "tokens")
             for spec in combo.get(stage, [])}
    defaults = {("select", "uniform"), ("allocate", "fixed"), ("advantage", "grpo"), ("loss", "ppo_clip")}
    for stage in registry.STAGES:
        missing = set(registry.names(stage)) - {n for s, n in used | defaults if s == stage}
        assert not missing, f"{stage} components never resumed: {missing}"


def test_prompt_gdro_always_selects_k_prompts():
    # all 6 prompts sit in bin 0 (seen, pass@k 0). Bin 0 is the heaviest, so it comes first in weight order;
    # draws that land in the empty bins 1-4 after it spilled past the last bin and were lost: the old
    # loop returned fewer than k prompts (a step with fewer groups, or none)
    from adarl.select.store import DifficultyStore
    from adarl.types import Group, Problem, Rollout

    ids = [f"p{i}" for i in range(6)]
    store = DifficultyStore(ids)
    store.update([Group(Problem(q, "x"), [0], [Rollout(q, [1], [0.0], "stop")], rewards=np.zeros((1, 1)),
                        reward_names=("r",), correct=np.zeros(1)) for q in ids], 1)
    gdro = registry.build("select", {"name": "gdro", "bins": 5})
    gdro.weights = np.array([0.40, 0.15, 0.15, 0.15, 0.15])
    for seed in range(20):
        picked = gdro.select(store, 4, np.random.default_rng(seed))
        assert len(picked) == 4 and len(set(picked)) == 4


def test_every_component_answers_the_stage_contract():
    """metrics(), state_dict() and load_state_dict() on every registered component (defaults when it keeps nothing)."""
    specs = {("allocate", "xrpo"): {"n": 4}, ("advantage", "hbpo"): {"max_len": 8},
             ("shaping", "hbpo"): {"max_len": 8},
             ("shaping", "fapo"): {"judge": "shaping_judges:flawed_if_marked", "workers": 1}}
    for stage in registry.STAGES:
        for name in registry.names(stage):
            c = registry.build(stage, {"name": name, **specs.get((stage, name), {})})
            assert isinstance(c.metrics(), dict) and isinstance(c.state_dict(), dict), (stage, name)
            c.load_state_dict(c.state_dict())
