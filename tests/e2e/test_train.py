"""End-to-end training on a tiny model: reward rises, resume is exact, errors are clean."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file

from adarl.config import load_recipe
from adarl.metrics.step import TIMING_KEYS
from adarl.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"  # the helpers recipes name (e2e_rewards, ...)


def write_task(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    with path.open("w") as f:
        for i in range(40):
            f.write(json.dumps({"prompt": f"Say a {i}", "answer": "a"}) + "\n")
    return path


def recipe_data(model_dir: Path, task: Path, **over) -> dict:
    data = {
        "name": "tiny",
        "seed": 3,
        "model": {"path": str(model_dir), "threads": 1},
        "task": {"source": "jsonl", "path": str(task), "eval_size": 4},
        "rewards": [{"type": "callable", "function": "e2e_rewards:fraction_of_a"}],
        "reward_workers": 1,
        "rollout": {"temperature": 1.0, "max_new_tokens": 8},
        "budget": {"max_steps": 12, "prompts_per_step": 4},
        "allocate": {"name": "fixed", "n": 6},
        "train": {"lr": 0.02, "micro_batch_tokens": 64},
        "eval": {"every": 0, "at_start": False},
        "checkpoint": {"every": 0},
        "log": {"tensorboard": True, "progress": False},
    }
    for key, value in over.items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    return data


def scheduled_recipe(model_dir: Path, task: Path, scheduler: dict, max_steps: int) -> dict:
    """2 prompts a step through a RolloutScheduler mode, with the decoupled loss, checkpoints every 2 steps."""
    return recipe_data(model_dir, task, budget={"max_steps": max_steps, "prompts_per_step": 2},
                       rollout={"temperature": 1.0, "max_new_tokens": 8, "scheduler": scheduler},
                       loss={"name": "decoupled_ppo"}, checkpoint={"every": 2})


@pytest.fixture
def tests_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(TESTS))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))


def test_reward_rises_on_tiny_model(tiny_model_dir, tmp_path, tests_on_path):
    recipe = load_recipe(data=recipe_data(tiny_model_dir, write_task(tmp_path)))
    Trainer(recipe, tmp_path / "run").run()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward"] for r in rows if "reward" in r]
    assert len(rewards) == 12
    first, last = np.mean(rewards[:3]), np.mean(rewards[-3:])
    assert last > first + 0.1, rewards
    assert rows[-1]["tokens"] == sum(r["step_tokens"] for r in rows if "step_tokens" in r)
    assert all("zero_variance_fraction" in r for r in rows if "reward" in r)
    assert all("clip_fraction" in r and "entropy" in r for r in rows if r.get("trained_fraction"))
    assert (tmp_path / "run" / "final" / "config.json").is_file()
    assert list((tmp_path / "run" / "tb").iterdir())


def _run_cli(args, env, **kw):
    return subprocess.Popen([sys.executable, "-m", "adarl.cli", "train", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


def _rows(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in rows]


def test_resume_after_hard_kill_is_exact(tiny_model_dir, tmp_path, tests_on_path, warm_python):
    """N steps straight == N/2 steps, SIGKILL, --resume: same weights, same metrics. The straight and the
    resumed runs are processes forked from a warm parent (tests/warm_python.py); the killed one is a plain
    process, killed from here."""
    data = recipe_data(tiny_model_dir, write_task(tmp_path), budget={"max_steps": 6},
                       checkpoint={"every": 1, "keep": 2}, deterministic=True)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(data))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}

    straight = warm_python.run_module("adarl.cli", ["train", str(recipe), "--run-dir", str(tmp_path / "straight")],
                                      env=env, cwd=ROOT, timeout=300)
    assert straight.returncode == 0, straight.stdout
    said = straight.stdout.splitlines()
    done = next(i for i, line in enumerate(said) if line.startswith("done: "))
    assert said[done].startswith("done: step=6") and str(tmp_path / "straight") in said[done]
    # the end-of-run lines name the report (health flags, if any, follow)
    assert said[done + 1] == f"report: {tmp_path / 'straight' / 'report.html'}"
    assert all(line.startswith("health: ") for line in said[done + 2:])

    killed_dir = tmp_path / "killed"
    proc = _run_cli([str(recipe), "--run-dir", str(killed_dir)], env)
    deadline = time.time() + 300
    while not (killed_dir / "checkpoints" / "step_000003").exists():
        assert proc.poll() is None and time.time() < deadline, "run ended before the kill"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (killed_dir / "final").exists()

    resumed = warm_python.run_module("adarl.cli", ["train", "--resume", str(killed_dir)], env=env, cwd=ROOT,
                                     timeout=300)
    assert resumed.returncode == 0, resumed.stdout
    said = resumed.stdout
    assert f"resume: continuing {killed_dir} from step " in said, said
    assert "done: step=6, tokens=" in said and f"report: {killed_dir / 'report.html'}" in said, said

    a = load_file(tmp_path / "straight" / "final" / "model.safetensors")
    b = load_file(killed_dir / "final" / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        assert (a[name] == b[name]).all(), name
    assert _rows(tmp_path / "straight") == _rows(killed_dir)


def test_zero_variance_groups_cost_no_backward(tiny_model_dir, tmp_path, tests_on_path, monkeypatch):
    """A batch whose groups all have equal rewards trains no rollout and leaves weights unchanged."""
    recipe = load_recipe(data=recipe_data(tiny_model_dir, write_task(tmp_path), budget={"max_steps": 1}))
    trainer = Trainer(recipe, tmp_path / "run")
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    calls = []
    monkeypatch.setattr(trainer.learner, "_micro_step", lambda *a, **k: calls.append(a))
    from adarl.types import Batch

    step_batch = {}
    original = trainer.estimator

    def zero(batch: Batch):
        step_batch["b"] = batch
        return np.zeros(len(batch))

    trainer.estimator = zero
    metrics = trainer.train_step()
    trainer.estimator = original
    assert calls == [] and metrics["trained_fraction"] == 0.0
    for n, p in trainer.model.named_parameters():
        assert (p == before[n]).all()
    trainer.rewards.close()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_lora_with_kl_trains_adapters_only(tiny_model_dir, tmp_path, tests_on_path, dtype):
    """LoRA + KL: the reference is the base model with adapters off; only adapters change."""
    data = recipe_data(tiny_model_dir, write_task(tmp_path), budget={"max_steps": 2},
                       model={"lora": {"r": 4, "alpha": 8}, "dtype": dtype},
                       loss={"name": "ppo_clip", "kl_coef": 0.1}, checkpoint={"every": 1})
    trainer = Trainer(load_recipe(data=data), tmp_path / "run")
    assert trainer.reference is None
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.run()
    changed = {n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all("lora_" in n for n in changed)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["kl"] >= 0 for r in rows if "reward" in r)
    assert rows[-1]["kl"] > 0  # after an update the policy has moved away from the reference
    weights = load_file(tmp_path / "run" / "checkpoints" / "step_000002" / "weights.safetensors")
    assert weights and all("lora_" in n for n in weights)
